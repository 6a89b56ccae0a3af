"""`ExpertParallelZero`: ZeRO stages 0-2 for a mixture-of-experts model whose experts are split over an ``ep`` axis.

The data ranks are ``dp x ep`` (`colo.tensor.moe.parallel`). Dense parameters are replicated on all of them and
expert parameters only on the ``dp`` ranks holding the same experts, so the two live in separate chunks with
separate groups: two `ZeroOptimizer` s over one model, one for the dense parameters sharded and averaged over
``("dp", "ep")``, one for the experts over ``("dp",)`` (their gradients were scaled by ``1 / ep`` in backward, so
that average is the gradient of the mean loss over every data rank). One torch optimizer steps both sets of fp32
masters (so LR schedulers built on it keep working), and the gradient norm counts every expert once: the expert
part of the squared norm is summed over ``ep`` too.

With tensor parallelism (``tensor_parallel_axes``) both parts count tp-replicated parameters once, as one
`ZeroOptimizer` does (the experts are replicated over tp). With a pipeline (``pipeline_axis``) each stage holds its
own dense and expert parameters: the dense part sums its norm over the stages itself; the expert part sums its
squares within the stage (over dp and tp) and then over ``ep`` and the stages together, so a stage without MoE
blocks (a dense first layer) holds no expert part and adds nothing.

At stage 3 each part gathers its own chunks over its own group (dense over ``dp x ep``, experts over ``dp``) with
its own hooks; the weights autograd saves are stored as positions in either part's chunks (one chain of saved-tensor
hooks), so both parts free their full copies after use.

fp16: one `DynamicLossScaler` over every rank of the model (``dp x ep``, the model-parallel axes and the pipeline
stages) serves both parts: the loss is scaled once, each part checks its own gradients for inf / nan over that whole
group (so every rank sees an overflow in any rank's experts, on any stage), the step is skipped everywhere when either
part overflowed, and the scale is updated once per step. A pipeline stage without MoE blocks has no expert part: it
joins the expert check with no gradients of its own (`_expert_overflow`), so every rank makes the same two checks
and the same decision.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from colo.comm import Mesh, all_reduce
from colo.tensor.checkpoint import CheckpointError
from colo.tensor.moe import dense_data_axes, expert_data_axes, is_expert_param

from .amp import DynamicLossScaler
from .clip import clip_coefficient
from .config import ZeroConfig
from .stage3 import SavedChunkView
from .state import OPTIMIZER_KEY, checkpoint_names_of, load_state, parameter_of
from .zero_optimizer import ZeroOptimizer


class _Continue:
    """A loss look-alike whose ``backward()`` runs the next optimizer's backward context (nests their hooks)."""

    def __init__(self, run) -> None:
        self.run = run

    def backward(self) -> None:
        self.run()


def _subset_optimizer(template: torch.optim.Optimizer, keep: set[int]):
    """A callable building an optimizer of ``template``'s type and hyperparameters over the kept parameters, with
    the same param groups (possibly empty), so group indices agree with ``template``'s. It only carries the groups
    (``template`` steps every master), so the base ``Optimizer`` constructor builds it: the subclass's own would
    re-validate ``defaults`` it derived itself."""

    def build(_params):
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in group["params"] if id(p) in keep],
            }
            for group in template.param_groups
        ]
        holder = type(template).__new__(type(template))
        torch.optim.Optimizer.__init__(holder, groups, dict(template.defaults))
        return holder

    return build


def _chain_saved_tensor_hooks(*, outer, inner) -> None:
    """Stage 3: both parts' gatherers enter saved-tensor hooks around the model's forward, and only the innermost
    (``inner``, the expert part's, registered last) sees what autograd saves; let it store a weight lying in the
    dense part's gathered chunks as ``outer`` would (where it lies, not the buffer), so the dense chunks are freed
    after forward as without experts, and give such a view back to ``outer`` to rebuild in backward."""
    pack_inner, unpack_inner = inner.pack_saved, inner.unpack_saved
    outer_chunks = {id(chunk) for chunk in outer.chunks}

    def pack(tensor: torch.Tensor):
        saved = pack_inner(tensor)
        if isinstance(saved, SavedChunkView) or not isinstance(tensor, torch.Tensor) or saved is tensor:
            return saved
        return saved if outer.locate_saved(tensor) is None else outer.pack_saved(tensor)

    def unpack(saved):
        if isinstance(saved, SavedChunkView) and id(saved.chunk) in outer_chunks:
            return outer.unpack_saved(saved)
        return unpack_inner(saved)

    inner.pack_saved, inner.unpack_saved = pack, unpack


class ExpertParallelZero:
    """ZeRO over a model with expert-parallel MoE blocks (see the module docstring).

    Args:
        model: the model, its experts already split by `colo.tensor.moe.shard_experts`.
        optimizer: a fresh torch optimizer over all the model's parameters (or ``None``: fused AdamW).
        mesh: a mesh with ``dp`` and ``ep`` axes.
        stage: ZeRO stage 0, 1, 2 or 3.
        checkpoint_names: the names parameters are saved under (`ZeroOptimizer`'s argument), for both parts.
        norm_replicas: parameters another rank counts in the global norm (`ZeroOptimizer`'s argument).
        **config_fields: other `ZeroConfig` fields (``chunk_numel``, ``mixed_precision``, ...).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mesh: Mesh,
        stage: int = 2,
        checkpoint_names=None,
        norm_replicas=(),
        **config_fields,
    ) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ExpertParallelZero: stage={stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        if "dp" not in mesh.axis_names or "ep" not in mesh.axis_names:
            raise ValueError(
                f"ExpertParallelZero needs a mesh with 'dp' and 'ep' axes (dp may be 1), got {mesh.axis_names}"
            )
        mixed = config_fields.get("mixed_precision")
        pipeline_axis = config_fields.get("pipeline_axis")
        fp16 = mixed is not None and mixed.param_dtype == torch.float16
        # fp16: one loss scaler for both parts, over every rank of the model (module docstring)
        model_parallel = tuple(config_fields.get("tensor_parallel_axes", ()))
        model_parallel += (pipeline_axis,) if pipeline_axis is not None else ()
        self.loss_scaler = (
            DynamicLossScaler(group=mesh.group(*dense_data_axes(mesh), *model_parallel)) if fp16 else None
        )
        if optimizer is None:
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
        self.mesh = mesh
        self.model = model
        self.optimizer = optimizer
        self.ep_group = mesh.group("ep")
        expert_ids = {id(p) for name, p in model.named_parameters() if is_expert_param(name)}
        dense_ids = {id(p) for p in model.parameters()} - expert_ids
        if not expert_ids and pipeline_axis is None:
            raise ValueError("ExpertParallelZero: the model has no expert parameters (...experts.w1/w2/w3)")
        self.dense = ZeroOptimizer(
            model,
            _subset_optimizer(optimizer, dense_ids),
            mesh=mesh,
            config=ZeroConfig(stage=stage, data_axes=dense_data_axes(mesh), **config_fields),
            checkpoint_names=checkpoint_names,
            param_filter=lambda name: not is_expert_param(name),
            norm_replicas=norm_replicas,
            loss_scaler=self.loss_scaler,
        )
        # the expert part's norm stays inside the stage; `grad_norm` sums it over ep and the stages together
        expert_fields = {**config_fields, "pipeline_axis": None}
        self.experts: ZeroOptimizer | None = None
        """The expert parameters' optimizer (``None`` on a pipeline stage without MoE blocks)."""
        if expert_ids:
            self.experts = ZeroOptimizer(
                model,
                _subset_optimizer(optimizer, expert_ids),
                mesh=mesh,
                config=ZeroConfig(stage=stage, data_axes=expert_data_axes(mesh), **expert_fields),
                checkpoint_names=checkpoint_names,
                param_filter=is_expert_param,
                loss_scaler=self.loss_scaler,
            )
        self.expert_norm_group = mesh.group("ep", pipeline_axis) if pipeline_axis else self.ep_group
        """Where the expert part's squared norm is summed: ``ep`` (and the pipeline stages)."""
        self.parts = (self.dense,) if self.experts is None else (self.dense, self.experts)
        if self.experts is not None and self.dense.gatherer is not None:
            _chain_saved_tensor_hooks(outer=self.dense.gatherer, inner=self.experts.gatherer)
        # one torch optimizer steps both parts' masters: group i holds the masters of both parts' group i
        for index, group in enumerate(optimizer.param_groups):
            group["params"] = [p for part in self.parts for p in part.optimizer.param_groups[index]["params"]]
        for part in self.parts:
            part.optimizer = optimizer
        self.config = self.dense.config
        self.last_grad_norm: float | None = None
        self._expert_overflow: bool | None = None
        """fp16 on a stage without an expert part: this step's answer of the expert overflow check it joins."""

    @property
    def reduces_every_microbatch(self) -> bool:
        """As `ZeroOptimizer.reduces_every_microbatch` (both parts run the same stage)."""
        return self.dense.reduces_every_microbatch

    # --- the training-loop API (as `ZeroOptimizer`) -----------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` (scaled by the loss scaler under fp16) inside both parts' backward contexts (their
        gradient hooks)."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        if self.experts is None:
            self.dense.grad_sync.run_backward(loss)
            return
        self.dense.grad_sync.run_backward(_Continue(lambda: self.experts.grad_sync.run_backward(loss)))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally in both parts."""
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.no_sync())
            yield

    def reduce_gradients(self) -> bool:
        """Reduce both parts' gradients now; returns whether the step will be skipped (an fp16 overflow in either)."""
        return self._prepare_grads()

    def _prepare_grads(self) -> bool:
        """Each part's sync, overflow check and unscaling (idempotent within a step); a stage without an expert part
        joins the expert check with no gradients (every rank of the scaler's group makes the same checks)."""
        skipped = any([part._prepare_grads() for part in self.parts])
        if self.experts is None and self.loss_scaler is not None:
            if self._expert_overflow is None:
                self._expert_overflow = self.loss_scaler.found_inf([], device=self.dense.device)
            skipped = skipped or self._expert_overflow
        return skipped

    @property
    def last_step_skipped(self) -> bool:
        """Whether this step's gradients overflowed (fp16) in either part."""
        return any(part.last_step_skipped for part in self.parts) or bool(self._expert_overflow)

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The global 2-norm over dense and expert gradients, every parameter element counted once."""
        if norm_type != 2.0:
            raise ValueError(f"ExpertParallelZero.grad_norm: norm_type={norm_type}; only the 2-norm is supported")
        if self.reduce_gradients():  # an fp16 overflow in either part: both skip, every rank agrees
            self.last_grad_norm = float("inf")
            return self.last_grad_norm
        dense = self.dense.grad_norm()
        local = 0.0 if self.experts is None else self.experts.grad_norm() ** 2
        expert_sq = torch.tensor([local], dtype=torch.float64)
        if self.expert_norm_group.size > 1:
            expert_sq = all_reduce(expert_sq.to(self.dense.device), group=self.expert_norm_group).cpu()
        self.last_grad_norm = math.sqrt(dense**2 + float(expert_sq))
        return self.last_grad_norm

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip both parts by the global norm; returns the norm before clipping."""
        total = self.grad_norm(norm_type)
        if self.last_step_skipped:
            return total
        coefficient = clip_coefficient(total, max_norm)
        if coefficient < 1.0:
            for part in self.parts:
                for grad in part._grad_shards:
                    grad.mul_(coefficient)
        return total

    def step(self) -> bool:
        """Reduce gradients, step every master with the one torch optimizer, refresh the compute copies; under fp16
        skip all of it when either part overflowed, and update the loss scale once. Returns whether it skipped."""
        skipped = self._prepare_grads()
        self._expert_overflow = None
        if self.loss_scaler is not None:
            self.loss_scaler.update(skipped)
        if not skipped:
            self.optimizer.step()
        for part in self.parts:
            if not skipped:
                part.register_optimizer_state()
                part.param_sync.refresh(part.trainable_chunks)
            for chunk in part.trainable_chunks:
                chunk.buffer("master").grad = None
            part._grads_prepared = False
            part._grad_shards = []
        return skipped

    def zero_grad(self) -> None:
        self._expert_overflow = None
        for part in self.parts:
            part.zero_grad()

    def wait_params(self) -> None:
        for part in self.parts:
            part.wait_params()

    # --- inspection and checkpoints -----------------------------------------------------------------------------

    def memory_report(self):
        """Both parts' buffers as one `colo.zero.MemoryReport` (each storage counted once: the parts share one torch
        optimizer, whose states `memory_report` reads besides the chunks)."""
        from types import SimpleNamespace

        from .memory import memory_report

        both = SimpleNamespace(
            chunks=[chunk for part in self.parts for chunk in part.chunks],
            optimizer=self.optimizer,
            offload=self.dense.offload,
            gatherer=None
            if self.dense.gatherer is None
            else SimpleNamespace(  # stage 3: both parts' gathered copies (their peaks may not coincide: an upper bound)
                peak_gathered_bytes=sum(part.gatherer.peak_gathered_bytes for part in self.parts)
            ),
            pool=SimpleNamespace(nbytes=sum(part.pool.nbytes for part in self.parts)),
        )
        return memory_report(both)

    def full_params(self) -> dict[str, torch.Tensor]:
        """fp32 masters of every parameter, gathered over the data axes (expert tensors: this rank's experts)."""
        return {name: value for part in self.parts for name, value in part.full_params().items()}

    def checkpoint_state(self):
        """``(tensors, metadata)`` for `colo.tensor.checkpoint.save_checkpoint`, in the format of a single
        `ZeroOptimizer`'s (`colo.zero.state`): both parts' tensors (the expert tensors keep their `Shard` layout over
        ``ep``, so the checkpoint holds the global ``(E, ...)`` tensors) and one ``"optimizer"`` entry (the shared
        param groups, both parts' scalars). So a checkpoint saved at any ``ep`` loads at any other, or into a plain
        `ZeroOptimizer` in one process."""
        tensors, metadata = self.dense.checkpoint_state()
        metadata = dict(metadata)
        optimizer = dict(metadata[OPTIMIZER_KEY])
        if self.experts is not None:
            expert_tensors, expert_meta = self.experts.checkpoint_state()
            tensors = {**tensors, **expert_tensors}
            optimizer["scalars"] = {**optimizer["scalars"], **expert_meta[OPTIMIZER_KEY]["scalars"]}
        metadata[OPTIMIZER_KEY] = optimizer
        return tensors, metadata

    def save(self, path: str | os.PathLike, *, metadata: dict | None = None, group=None, expected_names=None) -> None:
        """Save parameters and optimizer state of both parts to the new checkpoint directory ``path`` (every rank
        calls it; arguments as `ZeroOptimizer.save`)."""
        from colo.tensor.checkpoint import save_checkpoint

        tensors, own = self.checkpoint_state()
        save_checkpoint(path, tensors, metadata={**(metadata or {}), **own}, group=group, expected_names=expected_names)

    def load(self, path: str | os.PathLike) -> dict:
        """Load a checkpoint of this model saved at any ``ep`` and data-parallel size (or by a plain `ZeroOptimizer`)
        into both parts; returns its metadata (every rank calls it)."""
        from colo.tensor.checkpoint import read_index

        directory = os.fspath(path)
        names = {n for part in self.parts for c in part.chunks for s in c.slots for n in checkpoint_names_of(part, s)}
        saved = {parameter_of(name) for name in read_index(directory).tensors}
        unexpected, missing = sorted(saved - names), sorted(names - saved)
        if unexpected or missing:
            raise CheckpointError(
                f"{directory}: the checkpoint does not match the model: unexpected {unexpected[:3]} "
                f"({len(unexpected)}), missing {missing[:3]} ({len(missing)}); load it into the model it was saved from"
            )
        metadata = {}
        for part in self.parts:
            metadata = load_state(part, directory, check_names=False)
        return metadata
