"""`ZeroOptimizer`: ZeRO stages 1, 2 and 3 over the fused data-parallel axes of a mesh, on top of chunks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020.

- Stage 1 shards optimizer state: gradients accumulate locally in a full flat buffer per chunk; at the step
  each chunk is reduce-scattered, the owner steps its fp32 master shard, and the chunk is all-gathered back.
- Stage 2 also shards gradients: a post-accumulate-grad hook copies each gradient into its chunk's bucket and,
  once the chunk is complete, starts an async reduce-scatter into the fp32 gradient shard, during backward,
  every micro-step.
- Stage 3 also shards parameters (see `colo.zero.stage3`).

The optimizer is any torch optimizer; `ZeroOptimizer` swaps its parameters, in place, for one flat fp32 master
per chunk shard (so LR schedulers built on it keep working). Parameter groups keep their lr / weight decay:
a chunk never mixes groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colo.comm import Mesh, all_gather, reduce_scatter

from .amp import DynamicLossScaler, MixedPrecision
from .chunk import Chunk, plan_chunks
from .clip import clip_coefficient, global_grad_norm
from .stage3 import ChunkGatherer
from .state import checkpoint_state, load_state, save_state

STAGES = (1, 2, 3)


@dataclass(kw_only=True)
class ZeroConfig:
    """Settings of `ZeroOptimizer`."""

    stage: int = 2
    """ZeRO stage: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)."""
    data_axes: tuple[str, ...] = ("dp",)
    """Mesh axes the shards are spread over, fused (``("dp", "sp")`` when sequence parallelism replicates weights)."""
    chunk_numel: int | None = None
    """Chunk capacity in elements; ``None`` searches for the size that wastes the least padding."""
    max_chunk_numel: int = 1 << 25
    """Largest capacity the search tries."""
    mixed_precision: MixedPrecision | None = None
    """Compute / communication dtypes; ``None``: compute in the model's dtype, masters alias fp32 parameters."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"ZeroConfig.stage={self.stage!r} is not a ZeRO stage; use one of {STAGES}")
        if isinstance(self.data_axes, str):
            self.data_axes = (self.data_axes,)
        self.data_axes = tuple(self.data_axes)
        if not self.data_axes:
            raise ValueError("ZeroConfig.data_axes is empty; name the data-parallel axes, e.g. ('dp',)")
        if self.chunk_numel is not None and self.chunk_numel < 1:
            raise ValueError(f"ZeroConfig.chunk_numel={self.chunk_numel} must be positive, or None to search")
        if self.max_chunk_numel < 1:
            raise ValueError(f"ZeroConfig.max_chunk_numel={self.max_chunk_numel} must be positive")


OptimizerLike = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None


def _default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, fused=True)


class ZeroOptimizer:
    """Shards a model's optimizer state (stage 1), gradients (2) and parameters (3) over the data axes.

    Build every model replica with the same seed: the initial masters are this rank's slices of its own copy.

    Args:
        model: the model, on one device; its parameters become views into chunk buffers.
        optimizer: a fresh torch optimizer over the model's parameters (its param groups carry lr / weight
            decay), a callable building one from a parameter list, or ``None`` for fused AdamW.
        mesh: the mesh holding ``config.data_axes``.
        config: a `ZeroConfig`; or pass its fields as keyword arguments (``stage=2``).
        loss_scaler: a `DynamicLossScaler`; created over the data group when ``param_dtype`` is fp16.

    Example::

        zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh=mesh, stage=2)
        loss = model(x).loss
        zero.backward(loss)
        zero.clip_grad_norm_(1.0)
        zero.step()
        zero.zero_grad()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerLike = None,
        *,
        mesh: Mesh,
        config: ZeroConfig | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        **config_fields,
    ) -> None:
        if config is not None and config_fields:
            raise ValueError(f"pass either config= or its fields ({sorted(config_fields)}), not both")
        self.config = config if config is not None else ZeroConfig(**config_fields)
        self.model = model
        self.mesh = mesh
        unknown = [axis for axis in self.config.data_axes if axis not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"ZeroConfig.data_axes names {unknown}, not axes of the mesh {mesh.axis_names}; pick from those"
            )
        params = dict(model.named_parameters())
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            raise ValueError(
                f"the model's parameters are on several devices {sorted(map(str, devices))}; move it "
                "to one device (model.to(device)) before ZeroOptimizer"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        self.optimizer = self._resolve_optimizer(optimizer, list(params.values()))
        group_of = self._param_group_index(params)

        mp = self.config.mixed_precision
        self.param_dtype = mp.param_dtype if mp is not None else None
        self.reduce_dtype = mp.reduce_dtype if mp is not None else None
        self.loss_scaler = loss_scaler
        self.group = mesh.group(*self.config.data_axes)
        self.num_shards = self.group.size
        if loss_scaler is None and self.param_dtype == torch.float16:
            self.loss_scaler = DynamicLossScaler(group=self.group)

        entries = [(name, p, group_of.get(id(p), -1)) for name, p in params.items()]
        plans = plan_chunks(
            entries,
            num_shards=self.num_shards,
            chunk_numel=self.config.chunk_numel,
            max_chunk_numel=self.config.max_chunk_numel,
        )
        self.chunks = [
            Chunk(i, plan, num_shards=self.num_shards, shard_rank=self.group.rank) for i, plan in enumerate(plans)
        ]
        self.chunk_of: dict[int, Chunk] = {id(slot.param): c for c in self.chunks for slot in c.slots}
        self._build_buffers()
        self._swap_optimizer_params()
        self._ready: dict[int, int] = {chunk.index: 0 for chunk in self.chunks}
        self._pending: list = []
        self._grads_prepared = False
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self._hooks = []
        self.gatherer: ChunkGatherer | None = None
        if self.config.stage >= 2:
            for chunk in self.trainable_chunks:
                for slot in chunk.slots:
                    hook = functools.partial(self._on_grad_ready, chunk, slot)
                    self._hooks.append(slot.param.register_post_accumulate_grad_hook(hook))
        if self.config.stage == 3:
            self.gatherer = ChunkGatherer(self.chunks, group=self.group)
            self.gatherer.install(model, self.chunk_of)
        self.zero_grad()

    # --- construction -----------------------------------------------------------------------------------------

    def _resolve_optimizer(self, optimizer: OptimizerLike, params: list) -> torch.optim.Optimizer:
        if optimizer is None:
            optimizer = _default_optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise TypeError(f"optimizer must be a torch optimizer, a callable or None, not {type(optimizer)}")
            optimizer = optimizer([p for p in params if p.requires_grad])
        if len(optimizer.state):
            raise ValueError(
                f"the optimizer already holds state for {len(optimizer.state)} parameters (it has stepped); build "
                "ZeroOptimizer around a fresh optimizer, before the first step"
            )
        return optimizer

    def _param_group_index(self, params: dict[str, torch.nn.Parameter]) -> dict[int, int]:
        group_of: dict[int, int] = {}
        model_ids = {id(p) for p in params.values()}
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in model_ids:
                    raise ValueError(
                        "the optimizer holds a tensor that is not a parameter of the model; build it "
                        "from model.parameters()"
                    )
                group_of[id(p)] = index
        for name, p in params.items():
            if p.requires_grad and id(p) not in group_of:
                raise ValueError(
                    f"trainable parameter {name!r} is in no optimizer param group; add it to one or "
                    "set requires_grad=False"
                )
            if not p.is_floating_point():
                raise ValueError(f"parameter {name!r} has dtype {p.dtype}; ZeRO shards floating-point parameters")
        return group_of

    def _build_buffers(self) -> None:
        stage = self.config.stage
        for chunk in self.chunks:
            compute_dtype = self.param_dtype or chunk.dtype
            full = chunk.pack(compute_dtype, self.device)
            fp32_full = full if full.dtype == torch.float32 else chunk.pack(torch.float32, self.device)
            alias = self.param_dtype is None and chunk.dtype == torch.float32
            if stage == 3:
                shard = chunk.shard_of(full).clone()
                chunk.set_buffer("param_shard", shard)
                chunk.unbind_params()
            else:
                chunk.set_buffer("param", full)
                chunk.bind_params(full)
                shard = chunk.shard_of(full)
            if not chunk.trainable:
                continue
            if alias:  # fp32 without mixed precision: the master is the compute shard itself
                chunk.set_buffer("master", shard, aliases="param_shard" if stage == 3 else "param")
            else:
                master = chunk.shard_of(fp32_full).clone()
                chunk.set_buffer("master", master)
            chunk.set_buffer("grad_shard", torch.zeros(chunk.shard_numel, dtype=torch.float32, device=self.device))
            chunk.buffer("master").grad = chunk.buffer("grad_shard")

    def _swap_optimizer_params(self) -> None:
        for index, group in enumerate(self.optimizer.param_groups):
            group["params"] = [c.buffer("master") for c in self.trainable_chunks if c.group_index == index]

    @property
    def trainable_chunks(self) -> list[Chunk]:
        """Chunks of trainable parameters (the ones with masters, gradients and optimizer state)."""
        return [chunk for chunk in self.chunks if chunk.trainable]

    # --- gradients --------------------------------------------------------------------------------------------

    def _on_grad_ready(self, chunk: Chunk, slot, param: torch.Tensor) -> None:
        """Stages 2/3: move the gradient into its chunk's bucket; reduce-scatter the bucket once it is complete."""
        if not chunk.has_buffer("grad"):
            chunk.set_buffer("grad", torch.zeros(chunk.numel, dtype=param.grad.dtype, device=self.device))
        chunk.slot_view(chunk.buffer("grad"), slot).copy_(param.grad)
        param.grad = None
        self._ready[chunk.index] += 1
        if self._ready[chunk.index] == len(chunk.slots):
            self._reduce_scatter_grads(chunk)

    def _reduce_scatter_grads(self, chunk: Chunk) -> None:
        """Start the reduce-scatter of the chunk's full gradient into its shard; drop the bucket (stages 2/3)."""
        bucket = chunk.buffer("grad")
        if self.reduce_dtype is not None and bucket.dtype != self.reduce_dtype:
            bucket = bucket.to(self.reduce_dtype)
        handle = reduce_scatter(bucket, "sum", group=self.group, async_op=True)
        self._pending.append((chunk, handle))
        self._ready[chunk.index] = 0
        if self.config.stage >= 2:
            chunk.drop_buffer("grad")
        if self.gatherer is not None:
            self.gatherer.release(chunk)

    def _finish_grad_sync(self) -> None:
        """Reduce whatever is not reduced yet and wait for every reduce-scatter to land in the grad shards."""
        if self.config.stage == 1:
            for chunk in self.trainable_chunks:
                grad = chunk.buffer("grad")
                for slot in chunk.slots:  # the user may have replaced or dropped .grad
                    region = chunk.slot_view(grad, slot)
                    if slot.param.grad is None:
                        region.zero_()
                    elif slot.param.grad.data_ptr() != region.data_ptr():
                        region.copy_(slot.param.grad)
                self._reduce_scatter_grads(chunk)
        else:  # chunks with unused parameters never completed during backward; every rank flushes them here
            for chunk in self.trainable_chunks:
                if self._ready[chunk.index]:
                    self._reduce_scatter_grads(chunk)
        for chunk, handle in self._pending:
            chunk.buffer("grad_shard").add_(handle.wait().float(), alpha=1.0 / self.num_shards)
        self._pending.clear()

    def _grad_shards(self) -> list[torch.Tensor]:
        return [chunk.buffer("grad_shard") for chunk in self.trainable_chunks]

    def _prepare_grads(self) -> bool:
        """Sync, check for overflow and unscale once per step; returns whether the step must be skipped."""
        if self._grads_prepared:
            return self.last_step_skipped
        self._finish_grad_sync()
        self.last_step_skipped = False
        if self.loss_scaler is not None:
            self.last_step_skipped = self.loss_scaler.found_inf(self._grad_shards())
            if not self.last_step_skipped:
                for shard in self._grad_shards():
                    shard.div_(self.loss_scaler.scale)
        self._grads_prepared = True
        return self.last_step_skipped

    # --- the training-loop API --------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scaler when there is one."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        loss.backward()

    def reduce_gradients(self) -> bool:
        """Reduce this step's gradients over the data axes now (``step()`` does it otherwise).

        The hook for a pipeline executor's ``on_backward_end`` callback: a pipeline's weight-gradient (W) steps
        accumulate outside autograd's hooks, so the sync must be driven explicitly after the step's last backward.
        Stage 1 handles gradients however they were accumulated into ``.grad``; stages 2/3 rely on the
        post-accumulate-grad hooks during backward. Idempotent within a step.

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
        total = global_grad_norm(self._grad_shards(), group=self.group, norm_type=norm_type)
        coefficient = clip_coefficient(total, max_norm)
        if coefficient < 1.0:
            for shard in self._grad_shards():
                shard.mul_(coefficient)
        self.last_grad_norm = total
        return total

    def step(self) -> bool:
        """Reduce gradients, step the masters, refresh the compute copies. Returns whether the step was skipped."""
        skipped = self._prepare_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(skipped)
        if not skipped:
            self.optimizer.step()
            self._register_optimizer_state()
            self._refresh_params()
        self._grads_prepared = False
        return skipped

    def zero_grad(self) -> None:
        """Zero the gradient shards (and stage 1's full gradient buffers, which ``param.grad`` views)."""
        for chunk in self.trainable_chunks:
            chunk.buffer("grad_shard").zero_()
            if self.config.stage == 1:
                if not chunk.has_buffer("grad"):
                    chunk.set_buffer(
                        "grad", torch.zeros(chunk.numel, dtype=chunk.buffer("param").dtype, device=self.device)
                    )
                grad = chunk.buffer("grad").zero_()
                for slot in chunk.slots:
                    slot.param.grad = chunk.slot_view(grad, slot)
            else:
                for slot in chunk.slots:
                    slot.param.grad = None
        self._grads_prepared = False

    def _register_optimizer_state(self) -> None:
        for chunk in self.trainable_chunks:
            for key, value in self.optimizer.state.get(chunk.buffer("master"), {}).items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    chunk.set_buffer(f"optim/{key}", value)

    @torch.no_grad()
    def _refresh_params(self) -> None:
        for chunk in self.trainable_chunks:
            master = chunk.buffer("master")
            if self.config.stage == 3:
                if chunk.buffers["master"].aliases is None:
                    chunk.buffer("param_shard").copy_(master)
                continue
            piece = master if chunk.buffers["master"].aliases else master.to(chunk.buffer("param").dtype)
            chunk.buffer("param").copy_(all_gather(piece, group=self.group))
        if self.gatherer is not None:
            self.gatherer.release_all()

    def release_params(self) -> None:
        """Stage 3: free every gathered chunk (after an evaluation forward, say). A no-op at stages 1/2."""
        if self.gatherer is not None:
            self.gatherer.release_all()

    # --- inspection -------------------------------------------------------------------------------------------

    def _gather_named(self, buffer_name: str) -> dict[str, torch.Tensor]:
        """Full tensors per parameter name from a sharded fp32 buffer (collective: every rank must call it)."""
        result = {}
        for chunk in self.trainable_chunks:
            full = all_gather(chunk.buffer(buffer_name).contiguous(), group=self.group)
            for slot in chunk.slots:
                result[slot.name] = chunk.slot_view(full, slot).clone()
        return result

    def full_params(self) -> dict[str, torch.Tensor]:
        """The fp32 masters of every trainable parameter, gathered (a collective)."""
        return self._gather_named("master")

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced fp32 gradients of every trainable parameter, gathered (a collective; after backward)."""
        self._prepare_grads()
        return self._gather_named("grad_shard")

    def checkpoint_state(self):
        """``(tensors, metadata)`` for `colo.tensor.checkpoint.save_checkpoint`: this rank's flat ranges of every
        parameter (fp32 masters as the weights) and optimizer state, plus JSON metadata (see `colo.zero.state`)."""
        return checkpoint_state(self)

    def save(self, path, *, metadata: dict | None = None, group=None) -> None:
        """Save parameters and optimizer state to the new checkpoint directory ``path`` (every rank calls it).

        Args:
            path: the checkpoint directory to create.
            metadata: more JSON-serialisable state (step, data position, RNG) to store beside the tensors.
            group: the ranks saving together (default: the world).
        """
        save_state(self, path, metadata=metadata, group=group)

    def load(self, path) -> dict:
        """Load a checkpoint written by `save` at any data-parallel size; returns its metadata (every rank calls it)."""
        return load_state(self, path)

    def full_optimizer_states(self) -> dict[str, torch.Tensor]:
        """Every per-element optimizer state, gathered, keyed ``<param name>/<state>`` (a collective)."""
        keys = sorted({name.removeprefix("optim/") for c in self.trainable_chunks for name in c.buffers if "/" in name})
        result = {}
        for key in keys:
            for name, tensor in self._gather_named(f"optim/{key}").items():
                result[f"{name}/{key}"] = tensor
        return result

    def memory_report(self):
        """Bytes of parameters, gradients, masters, optimizer state and padding held on this rank."""
        from .memory import memory_report

        return memory_report(self)
