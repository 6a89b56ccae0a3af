"""`ChunkOptimizer`: the chunk-sharded optimizer core shared by `ZeroOptimizer` and colo.gemini's `GeminiOptimizer`.

The core owns what every optimizer over colo chunks does the same way: building the chunks from a model and a
torch optimizer (checks, param groups, mixed-precision dtypes, the loss scaler), the training-loop API
(``backward``, ``no_sync``, ``reduce_gradients``, ``clip_grad_norm_``, ``grad_norm``, ``step``, ``zero_grad``),
preparing the gradients once per step (sync, overflow check, unscale), gathering full tensors for inspection,
and the checkpoint state (the tensors and scalars each chunk saves and loads, `state_dict` of the optimizer's
param groups and loss scaler). A subclass says where the state lives and how gradients reach it:

- `_finish_grad_sync` returns the step's fp32 gradient shards once every reduction has landed;
- `_update` steps the masters and refreshes the compute copies;
- `_discard_grads` drops this step's gradients;
- `_counted_grads` names the gradient ranges the norm counts on this rank;
- `shard_tensors` / `load_targets` / `finish_load` give checkpoints the chunk state to save and load.

Gradient synchronization itself is a strategy object (`colo.zero.grad_sync`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection

import torch

from colo.comm import Mesh, all_gather

from .amp import DynamicLossScaler
from .chunk import Chunk, plan_chunks
from .clip import clip_coefficient, global_grad_norm
from .optimizer_setup import OptimizerLike, param_group_index, resolve_optimizer

CheckpointNames = Callable[[str, torch.nn.Parameter], "list[tuple[str, int, int]] | None"]


def ordered_params(
    params: dict[str, torch.nn.Parameter], order: list[str] | None
) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters in ``order`` (names from `execution_order`), then any the order does not name, in registration
    order."""
    if order is None:
        return list(params.items())
    unknown = [name for name in order if name not in params]
    if unknown:
        raise ValueError(f"param_order names {unknown[:3]} that are not parameters of the model; use its names")
    named = set(order)
    return [(name, params[name]) for name in dict.fromkeys(order)] + [
        (name, p) for name, p in params.items() if name not in named
    ]


class ChunkOptimizer:
    """The core of an optimizer over flat, sharded chunks; see the module docstring. Not built directly."""

    checkpoint_key = "zero"
    """The metadata key this optimizer's own checkpoint state (loss scaler, ...) is saved under."""
    config_type: type
    """The settings dataclass (`ZeroConfig`, `GeminiConfig`); it has ``data_axes``, ``chunk_numel``,
    ``max_chunk_numel`` and ``mixed_precision``, and may name ``model_parallel_axes``."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerLike = None,
        *,
        mesh: Mesh,
        config=None,
        loss_scaler: DynamicLossScaler | None = None,
        param_order: list[str] | None = None,
        checkpoint_names: CheckpointNames | None = None,
        param_filter: Callable[[str], bool] | None = None,
        norm_replicas: Collection[torch.Tensor] = (),
        **config_fields,
    ) -> None:
        if config is not None and config_fields:
            raise ValueError(f"pass either config= or its fields ({sorted(config_fields)}), not both")
        config = config if config is not None else self.config_type(**config_fields)
        owner = type(self).__name__
        self.model = model
        self.mesh = mesh
        self.config = config
        self.checkpoint_names = checkpoint_names
        self._norm_replicas = {id(param) for param in norm_replicas}
        """Parameters of this rank another rank holds too and counts in the gradient norm (see the subclass)."""
        model_parallel_axes = getattr(config, "model_parallel_axes", ())
        unknown = [axis for axis in config.data_axes + model_parallel_axes if axis not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"{type(config).__name__} names axes {unknown} that are not axes of the mesh {mesh.axis_names}; "
                "pick from those"
            )
        params = dict(model.named_parameters())
        if param_filter is not None:  # a part of the model (its experts, say): another optimizer has the rest
            params = {name: p for name, p in params.items() if param_filter(name)}
        if not params:
            raise ValueError(f"the model has no parameters for {owner} to shard")
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            raise ValueError(
                f"the model's parameters are on several devices {sorted(map(str, devices))}; move it to one device "
                f"(model.to(device)) before {owner}"
            )
        self.device = self._compute_device(devices.pop())
        self._named_params = ordered_params(params, param_order)
        self.optimizer = resolve_optimizer(
            optimizer, list(params.values()), default=self._default_optimizer, owner=owner
        )
        mixed = config.mixed_precision
        self.param_dtype = mixed.param_dtype if mixed is not None else None
        self.reduce_dtype = mixed.reduce_dtype if mixed is not None else None
        self.group = mesh.group(*config.data_axes)
        self.loss_scaler = loss_scaler
        if loss_scaler is None and self.param_dtype == torch.float16:
            self.loss_scaler = DynamicLossScaler(group=mesh.group(*config.data_axes, *model_parallel_axes))
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self._grads_prepared = False
        self._grad_shards: list[torch.Tensor] = []
        self._hooks: list = []
        self._build(param_group_index(self.optimizer, params, owner=owner))
        self.zero_grad()

    def _compute_device(self, model_device: torch.device) -> torch.device:
        """The device the model computes on (default: where its parameters are)."""
        return model_device

    def _default_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The torch optimizer built when none is given."""
        return torch.optim.AdamW(params)

    def _build(self, group_of: dict[int, int]) -> None:
        """Plan the chunks (`_plan_chunks`), build their buffers and the strategies; ``group_of`` maps
        ``id(parameter)`` to its param group index."""
        raise NotImplementedError

    def _plan_chunks(self, group_of: dict[int, int], *, num_shards: int, shard_rank: int) -> None:
        """Pack the parameters into chunks of ``num_shards`` shards, this rank holding shard ``shard_rank``."""
        self.num_shards = num_shards
        entries = [(name, p, group_of.get(id(p), -1)) for name, p in self._named_params]
        plans = plan_chunks(
            entries,
            num_shards=num_shards,
            chunk_numel=self.config.chunk_numel,
            max_chunk_numel=self.config.max_chunk_numel,
        )
        self.chunks = [Chunk(i, plan, num_shards=num_shards, shard_rank=shard_rank) for i, plan in enumerate(plans)]
        self.chunk_of: dict[int, Chunk] = {id(slot.param): c for c in self.chunks for slot in c.slots}

    @property
    def trainable_chunks(self) -> list[Chunk]:
        """Chunks of trainable parameters (the ones with masters, gradients and optimizer state)."""
        return [chunk for chunk in self.chunks if chunk.trainable]

    # --- what a subclass provides ----------------------------------------------------------------------------

    def _finish_grad_sync(self) -> list[torch.Tensor]:
        """Reduce whatever is not reduced yet, wait for every reduction; return this rank's fp32 gradient shards."""
        raise NotImplementedError

    def _update(self, skipped: bool) -> None:
        """Step the masters (unless ``skipped``) and refresh the compute copies."""
        raise NotImplementedError

    def _discard_grads(self) -> None:
        """Drop this step's gradients (the shards count as zero afterwards)."""
        raise NotImplementedError

    def _counted_grads(self) -> list[torch.Tensor]:
        """The gradient ranges whose squares the global norm counts on this rank."""
        raise NotImplementedError

    def before_checkpoint(self) -> None:
        """Called before a checkpoint reads or writes the chunk shards (ZeRO waits for its parameter gathers)."""

    # --- gradients --------------------------------------------------------------------------------------------

    def _prepare_grads(self) -> bool:
        """Sync, check for overflow and unscale, once per step; returns whether the step must be skipped."""
        if self._grads_prepared:
            return self.last_step_skipped
        grads = self._finish_grad_sync()
        self.last_step_skipped = False
        if self.loss_scaler is not None:
            self.last_step_skipped = self.loss_scaler.found_inf(grads, device=self.device)
            if not self.last_step_skipped:
                for grad in grads:
                    grad.div_(self.loss_scaler.scale)
        self._grad_shards = grads
        self._grads_prepared = True
        return self.last_step_skipped

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, for the backward passes inside the context; the
        next backward outside it (or `step`) reduces the sum."""
        previous, self.grad_sync.sync_enabled = self.grad_sync.sync_enabled, False
        try:
            yield
        finally:
            self.grad_sync.sync_enabled = previous

    # --- the training-loop API --------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scaler when there is one."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        self.grad_sync.run_backward(loss)

    def reduce_gradients(self) -> bool:
        """Reduce this step's gradients over the data axes now (``step()`` does it otherwise).

        The hook for a pipeline executor's ``on_backward_end`` callback: a pipeline's weight-gradient (W) steps
        accumulate outside autograd's hooks, so the sync must be driven explicitly after the step's last backward.
        Idempotent within a step.

        Returns:
            Whether the step will be skipped (an fp16 overflow).
        """
        return self._prepare_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip gradients by their global norm over all shards, like ``torch.nn.utils.clip_grad_norm_``.

        Returns:
            The total norm before clipping (``inf`` when the step overflowed and will be skipped).
        """
        if self._prepare_grads():
            return float("inf")
        total = self.grad_norm(norm_type)
        coefficient = clip_coefficient(total, max_norm)
        if coefficient < 1.0:
            for grad in self._grad_shards:
                grad.mul_(coefficient)
        return total

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The global norm of this step's (unscaled) gradients over every shard and model-parallel rank."""
        if self._prepare_grads():
            return float("inf")
        total = global_grad_norm(self._counted_grads(), group=self.norm_group, norm_type=norm_type)
        self.last_grad_norm = total
        return total

    def step(self) -> bool:
        """Reduce gradients, step the masters, refresh the compute copies. Returns whether the step was skipped."""
        skipped = self._prepare_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(skipped)
        self._update(skipped)
        self._grads_prepared = False
        self._grad_shards = []
        return skipped

    def zero_grad(self) -> None:
        """Zero the gradients, discarding reductions still in flight and gradients accumulated under `no_sync` (a
        backward not followed by a step)."""
        self._discard_grads()
        self._grads_prepared = False

    # --- inspection -------------------------------------------------------------------------------------------

    def _gather_shards(self, shards: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors per parameter name from one shard per trainable chunk (a collective)."""
        result = {}
        for chunk in self.trainable_chunks:
            shard = shards[chunk.index].to(self.device).contiguous()
            full = shard if self.num_shards == 1 else all_gather(shard, group=self.group)
            for slot in chunk.slots:
                result[slot.name] = chunk.slot_view(full, slot).detach().to(self.gathered_device, copy=True)
        return result

    @property
    def gathered_device(self) -> torch.device:
        """Where `full_params` / `full_grads` return their tensors: the compute device."""
        return self.device

    def full_params(self) -> dict[str, torch.Tensor]:
        """The fp32 masters of every trainable parameter, gathered (a collective)."""
        return self._gather_shards({c.index: self.shard_tensors(c)["master"] for c in self.trainable_chunks})

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced, unscaled fp32 gradients of every trainable parameter, gathered (a collective; after
        backward, before `step`)."""
        self._prepare_grads()
        return self._gather_shards({c.index: g for c, g in zip(self.trainable_chunks, self._grad_shards)})

    # --- checkpoint state -------------------------------------------------------------------------------------

    def shard_tensors(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """This rank's shard of the chunk's weights (``"master"``: the fp32 master, or a frozen chunk's compute
        copy) and of each per-element optimizer state, by state name (no copy where the state is in memory)."""
        raise NotImplementedError

    def shard_scalars(self, chunk: Chunk) -> dict[str, list]:
        """The chunk's optimizer scalars (AdamW's ``step``) as ``name -> [value, dtype name or None]``."""
        raise NotImplementedError

    def load_targets(self, chunk: Chunk, state_names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors to read the chunk's shard into, named as `shard_tensors` names them (``state_names``: the
        optimizer states the checkpoint holds for the chunk); `finish_load` puts them in place."""
        raise NotImplementedError

    def finish_load(self, loaded: dict[int, dict[str, torch.Tensor]], scalars: dict[int, dict[str, list]]) -> None:
        """Put what `load_targets` received (and the chunks' saved scalars) in place; refresh the compute copies."""
        raise NotImplementedError

    def is_tensor_parallel_replica(self, param: torch.Tensor) -> bool:
        """Whether another rank holds the same elements of ``param`` and stands for both (counted once in the norm,
        written once in checkpoints); never without tensor parallelism."""
        return False

    def checkpoint_metadata(self) -> dict:
        """This optimizer's own JSON checkpoint state, saved under `checkpoint_key`: the loss scaler."""
        return {"loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def state_dict(self) -> dict:
        """The JSON state of the optimizer besides its chunk tensors: ``"optimizer"``, the torch optimizer's type
        and param groups (hyperparameters), and `checkpoint_metadata` (the loss scaler, ...)."""
        groups = [
            {key: list(value) if isinstance(value, tuple) else value for key, value in group.items() if key != "params"}
            for group in self.optimizer.param_groups
        ]
        return {
            "optimizer": {"type": type(self.optimizer).__name__, "param_groups": groups},
            **self.checkpoint_metadata(),
        }

    def check_state_dict(self, state: dict, *, where: str = "the state") -> None:
        """Raise a `ValueError` naming the difference when ``state`` (as `state_dict` returns it) cannot be loaded:
        another optimizer type, or another number of param groups."""
        saved = state["optimizer"]
        if saved["type"] != type(self.optimizer).__name__:
            raise ValueError(
                f"{where}: saved with a {saved['type']} optimizer, loading into {type(self.optimizer).__name__}"
            )
        if len(saved["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"{where}: the checkpoint has {len(saved['param_groups'])} optimizer param groups, this optimizer "
                f"{len(self.optimizer.param_groups)}; build the optimizer with the same param groups"
            )

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned: the param groups' hyperparameters and the loss scaler (when both
        this optimizer and ``state`` have one)."""
        self.check_state_dict(state)
        for group, saved in zip(self.optimizer.param_groups, state["optimizer"]["param_groups"]):
            for key, value in saved.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def save(self, path: str | os.PathLike, *, metadata: dict | None = None, group=None, expected_names=None) -> None:
        """Save parameters and optimizer state to the new checkpoint directory ``path`` (every rank calls it).

        Args:
            path: the checkpoint directory to create.
            metadata: more JSON-serialisable state (step, data position, RNG) to store beside the tensors.
            group: the ranks saving together (default: the world).
            expected_names: tensors the checkpoint must hold besides this rank's (`save_checkpoint`'s).
        """
        from .state import save_state

        save_state(self, path, metadata=metadata, group=group, expected_names=expected_names)

    def load(self, path: str | os.PathLike) -> dict:
        """Load a checkpoint written by `save` (of this or another chunk optimizer) at any data-parallel size;
        returns its metadata (every rank calls it). The model's parameters hold the loaded values when it returns."""
        from .state import load_state

        return load_state(self, path)

    def checkpoint_state(self):
        """``(tensors, metadata)`` for `colo.tensor.checkpoint.save_checkpoint`: this rank's flat ranges of every
        parameter (fp32 masters as the weights) and optimizer state, plus JSON metadata (see `colo.zero.state`)."""
        from .state import checkpoint_state

        return checkpoint_state(self)
