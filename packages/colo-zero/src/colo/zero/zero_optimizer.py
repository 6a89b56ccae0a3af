"""`ZeroOptimizer`: ZeRO stages 0, 1, 2 and 3 over the fused data-parallel axes of a mesh, on top of chunks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020; the optimizer
offload follows Ren et al., "ZeRO-Offload", 2021.

- Stage 0 shards nothing: each chunk's gradient is all-reduced during backward (DDP's bucketed all-reduce) and
  every rank steps full fp32 masters; it is how data or pipeline parallelism gets `colo.zero.amp`'s mixed
  precision and loss scaling without sharding.
- Stage 1 shards optimizer state: gradients accumulate in a persistent full flat buffer per chunk (``.grad`` are
  views into it). In a `ZeroOptimizer.backward` that syncs (outside `no_sync`: with gradient accumulation, the
  last micro-step), a post-accumulate-grad hook starts each chunk's async reduce-scatter into its gradient shard
  as soon as all the chunk's gradients are in, so it runs during the rest of backward; the step waits for it,
  the owner steps its fp32 master shard, and the chunk is all-gathered back. Gradients accumulated any other
  way (a bare ``loss.backward()``, a pipeline's weight-gradient steps) are reduced at the step.
- Stage 2 also shards gradients: a post-accumulate-grad hook copies each gradient into its chunk's bucket and,
  once the chunk is complete, starts an async reduce-scatter into the fp32 gradient shard, during backward,
  every micro-step.
- Stage 3 also shards parameters (see `colo.zero.stage3`).

The optimizer is any torch optimizer; `ZeroOptimizer` swaps its parameters, in place, for one flat fp32 master
per chunk shard (so LR schedulers built on it keep working). Parameter groups keep their lr / weight decay:
a chunk never mixes groups.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colo.comm import Mesh, all_gather, all_reduce, choose_algorithm, reduce_scatter

from .amp import DynamicLossScaler, MixedPrecision
from .buffer_pool import BufferPool
from .chunk import Chunk, plan_chunks
from .clip import clip_coefficient, global_grad_norm
from .optimizer_setup import OptimizerLike, param_group_index, resolve_optimizer
from .stage3 import ChunkGatherer
from .state import checkpoint_state, load_state, save_state

STAGES = (0, 1, 2, 3)


@dataclass(kw_only=True)
class ZeroConfig:
    """Settings of `ZeroOptimizer`."""

    stage: int = 2
    """ZeRO stage: 0 (nothing sharded), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)."""
    data_axes: tuple[str, ...] = ("dp",)
    """Mesh axes the shards are spread over, fused (``("dp", "sp")`` when sequence parallelism replicates weights)."""
    chunk_numel: int | None = None
    """Chunk capacity in elements; ``None`` searches for the size that wastes the least padding."""
    max_chunk_numel: int = 1 << 22
    """Largest capacity the search tries (4M elements: 16 MiB in fp32). Chunks are the unit of overlap: one chunk
    holding a whole model leaves nothing to overlap with backward or to prefetch, and very large buffers are
    fresh memory on every allocation; about one transformer layer per chunk measured best on CPU."""
    mixed_precision: MixedPrecision | None = None
    """Compute / communication dtypes; ``None``: compute in the model's dtype, masters alias fp32 parameters."""
    offload_optimizer: bool = False
    """ZeRO-Offload: keep fp32 masters, gradient shards and optimizer state in host memory (pinned with CUDA) and
    run the optimizer step there (torch's fused CPU AdamW by default); the device keeps only the compute copies."""
    tensor_parallel_axes: tuple[str, ...] = ()
    """Mesh axes the model is tensor-parallel over. Gradient clipping sums the norm over them, counting a
    parameter sharded over an axis (its colo layout says `Shard`) on every rank of it and a replicated one once."""
    pipeline_axis: str | None = None
    """The mesh axis of pipeline stages, whose parameters are disjoint: the gradient norm sums over it too."""
    max_reductions_in_flight: int = 2
    """Stages 0/2/3: gradient buckets whose reduction may be in flight at once; the next bucket first waits for
    the oldest to land in its shard. At most this many + 1 full buckets exist during backward (they are reused
    from step to step), instead of one per chunk until the step."""
    overlap_param_gather: bool = True
    """Stages 1/2: start the all-gather of the updated parameters at the end of `step` and wait for each chunk
    only before the first module using it runs in the next forward (Megatron's overlapped parameter gather).
    Between `step` and the next forward the parameters (``model.parameters()``, read directly) may still hold the
    old values: call `wait_params` before reading them there. What hands parameters out waits itself:
    ``model.state_dict()`` (of the model or any submodule), `full_params`, `checkpoint_state` / `save` and `load`
    (which returns with the loaded values in place)."""

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
        if self.max_reductions_in_flight < 1:
            raise ValueError(
                f"ZeroConfig.max_reductions_in_flight={self.max_reductions_in_flight} must be at least 1 (1: each "
                "bucket waits for the previous reduction)"
            )
        if isinstance(self.tensor_parallel_axes, str):
            self.tensor_parallel_axes = (self.tensor_parallel_axes,)
        self.tensor_parallel_axes = tuple(self.tensor_parallel_axes)
        overlap = set(self.data_axes) & ({*self.tensor_parallel_axes, self.pipeline_axis} - {None})
        if overlap:
            raise ValueError(
                f"ZeroConfig: axes {sorted(overlap)} are named both as data axes and as model-parallel axes; "
                "an axis is one or the other"
            )

    @property
    def model_parallel_axes(self) -> tuple[str, ...]:
        """The tensor-parallel axes and the pipeline axis, the ones the model itself is split over."""
        return self.tensor_parallel_axes + ((self.pipeline_axis,) if self.pipeline_axis else ())


def _default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, fused=True)


class _Done:
    """A finished `Handle` look-alike (a reduction over a group of one is the tensor itself)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


def _to_state_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; host copies of device tensors are pinned when CUDA is present (fast, async copies)."""
    if tensor.device == device:
        return tensor
    moved = tensor.to(device)
    return moved.pin_memory() if device.type == "cpu" and torch.cuda.is_available() else moved


def _ordered(params: dict[str, torch.nn.Parameter], order: list[str] | None) -> list[tuple[str, torch.nn.Parameter]]:
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
        param_order: parameter names in packing order (`execution_order`); default registration order.
        checkpoint_names: ``fn(name, parameter) -> [(checkpoint name, first row, rows), ...]`` or ``None``: the
            names a parameter is saved under (a fused q/k/v weight as q, k and v rows); default its own name.

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
        param_order: list[str] | None = None,
        checkpoint_names: Callable[[str, torch.nn.Parameter], list[tuple[str, int, int]] | None] | None = None,
        **config_fields,
    ) -> None:
        if config is not None and config_fields:
            raise ValueError(f"pass either config= or its fields ({sorted(config_fields)}), not both")
        self.config = config if config is not None else ZeroConfig(**config_fields)
        self.model = model
        self.mesh = mesh
        self.checkpoint_names = checkpoint_names
        named_axes = self.config.data_axes + self.config.model_parallel_axes
        unknown = [axis for axis in named_axes if axis not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"ZeroConfig names axes {unknown} that are not axes of the mesh {mesh.axis_names}; pick from those"
            )
        params = dict(model.named_parameters())
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            raise ValueError(
                f"the model's parameters are on several devices {sorted(map(str, devices))}; move it "
                "to one device (model.to(device)) before ZeroOptimizer"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        self.offload = self.config.offload_optimizer
        self.state_device = torch.device("cpu") if self.offload else self.device
        self.optimizer = resolve_optimizer(
            optimizer, list(params.values()), default=_default_optimizer, owner="ZeroOptimizer"
        )
        group_of = param_group_index(self.optimizer, params, owner="ZeroOptimizer")

        mp = self.config.mixed_precision
        self.param_dtype = mp.param_dtype if mp is not None else None
        self.reduce_dtype = mp.reduce_dtype if mp is not None else None
        self.loss_scaler = loss_scaler
        self.group = mesh.group(*self.config.data_axes)
        self.num_shards = 1 if self.config.stage == 0 else self.group.size
        if loss_scaler is None and self.param_dtype == torch.float16:
            self.loss_scaler = DynamicLossScaler(group=mesh.group(*named_axes))

        entries = [(name, p, group_of.get(id(p), -1)) for name, p in _ordered(params, param_order)]
        plans = plan_chunks(
            entries,
            num_shards=self.num_shards,
            chunk_numel=self.config.chunk_numel,
            max_chunk_numel=self.config.max_chunk_numel,
        )
        shard_rank = 0 if self.config.stage == 0 else self.group.rank
        self.chunks = [
            Chunk(i, plan, num_shards=self.num_shards, shard_rank=shard_rank) for i, plan in enumerate(plans)
        ]
        self.chunk_of: dict[int, Chunk] = {id(slot.param): c for c in self.chunks for slot in c.slots}
        self._norm_ranges = self._counted_ranges()
        # the gradient norm sums over the shards (not at stage 0: every data rank holds the whole gradient) and over
        # the model-parallel axes; the group is created here, by every rank, not lazily at the first clip
        norm_axes = (self.config.data_axes if self.config.stage else ()) + self.config.model_parallel_axes
        self.norm_group = mesh.group(*norm_axes) if norm_axes else None
        self._build_buffers()
        self._swap_optimizer_params()
        self._ready: dict[int, int] = {chunk.index: 0 for chunk in self.chunks}
        self.pool = BufferPool()
        """Reused full-chunk buffers: gradient buckets, and stage 3's gathered parameters."""
        self._pending: list = []
        """``(chunk, handle, bucket)`` of reductions in flight, oldest first, each added into (stages 0/2/3) or
        written over (stage 1) the chunk's gradient shard; ``bucket`` goes back to the pool once it has landed."""
        self._in_flight: dict[int, tuple] = {}
        """Stage 1: chunk index -> ``(handle, version of the full gradient buffer after the launch)`` of the one
        reduction of the buffer in flight; it overwrites the shard, and is superseded if the buffer changes."""
        self._written: dict[int, set[int]] = {}
        """Stages 0/2/3: per chunk with a bucket, the offsets of the slots a gradient was written to."""
        self._shard_zero: set[int] = set()
        """Stages 0/2/3: chunks whose gradient shard counts as zero (since `zero_grad`) though it is not zeroed."""
        self._in_backward = False
        self._grads_prepared = False
        self._sync_enabled = True
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self._hooks = []
        self.gatherer: ChunkGatherer | None = None
        for chunk in self.trainable_chunks:
            for slot in chunk.slots:
                if self.config.stage == 1:
                    before = functools.partial(self._before_accumulate, chunk)
                    self._hooks.append(slot.param.register_hook(before))
                    hook = functools.partial(self._on_grad_accumulated, chunk, slot)
                else:
                    hook = functools.partial(self._on_grad_ready, chunk, slot)
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(hook))
        if self.config.stage == 3:
            self.gatherer = ChunkGatherer(self.chunks, group=self.group, pool=self.pool)
            self.gatherer.install(model, self.chunk_of)
        self._param_gathers: dict[int, object] = {}
        self._overlap_gathers = self.config.stage in (1, 2) and self.config.overlap_param_gather
        if self._overlap_gathers:
            self._install_param_waits(model)
        self.zero_grad()

    # --- construction -----------------------------------------------------------------------------------------

    def _build_buffers(self) -> None:
        stage = self.config.stage
        for chunk in self.chunks:
            compute_dtype = self.param_dtype or chunk.dtype
            full = chunk.pack(compute_dtype, self.device)
            fp32_full = full if full.dtype == torch.float32 else chunk.pack(torch.float32, self.device)
            alias = self.param_dtype is None and chunk.dtype == torch.float32 and not self.offload
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
            tier = "host" if self.offload else "device"
            if alias:  # fp32 without mixed precision: the master is the compute shard itself
                chunk.set_buffer("master", shard, aliases="param_shard" if stage == 3 else "param")
            else:
                master = _to_state_device(chunk.shard_of(fp32_full).clone(), self.state_device)
                chunk.set_buffer("master", master, tier=tier)
            if stage == 1:  # the persistent full gradient; the reduced shard lands in its own region when it can
                chunk.set_buffer("grad", torch.zeros(chunk.numel, dtype=compute_dtype, device=self.device))
                if compute_dtype == self.grad_dtype and not self.offload:
                    chunk.set_buffer("grad_shard", chunk.shard_of(chunk.buffer("grad")), aliases="grad")
                    continue
            grad_shard = torch.zeros(chunk.shard_numel, dtype=self.grad_dtype, device=self.device)
            chunk.set_buffer("grad_shard", _to_state_device(grad_shard, self.state_device), tier=tier)

    @property
    def grad_dtype(self) -> torch.dtype:
        """dtype of the persistent gradient shards: the dtype gradients are reduced in (fp32 without mixed
        precision). They are converted to fp32 for unscaling, clipping and the step, transiently."""
        return self.reduce_dtype or torch.float32

    def is_tensor_parallel_replica(self, param: torch.Tensor) -> bool:
        """Whether another rank holds the same elements of ``param`` as this one and stands for both: ``param`` is
        replicated over a tensor-parallel axis (not `Shard` there in its colo layout, or without a layout) and
        this rank is not at coordinate 0 of it. The one rule for what is counted once (the gradient norm) and
        written once (checkpoints). Only the tensor-parallel axes replicate a parameter: the data axes shard it,
        and the pipeline axis holds different parameters on each stage (a stage's layout may say `Replicate` over
        ``pp``, but no other stage holds its elements)."""
        from colo.tensor import Shard, layout_of

        layout = layout_of(param)
        sharded_over = set()
        if layout is not None:
            sharded_over = {a for a, p in zip(layout.mesh.axis_names, layout.placements) if isinstance(p, Shard)}
        return any(axis not in sharded_over and self.mesh.rank(axis) != 0 for axis in self.config.tensor_parallel_axes)

    def _counted_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Per chunk, the ranges of this rank's shard whose squares the global gradient norm counts here: all of
        them without tensor parallelism; with it, a parameter replicated over a tensor-parallel axis counts only
        at coordinate 0 of that axis (so it is counted once), a sharded one everywhere."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for chunk in self.chunks:
            counted = []
            for slot in chunk.slots:
                if self.is_tensor_parallel_replica(slot.param):
                    continue
                begin = max(slot.offset, chunk.shard_offset)
                end = min(slot.offset + slot.numel, chunk.shard_offset + chunk.shard_numel)
                if begin >= end:
                    continue
                begin, end = begin - chunk.shard_offset, end - chunk.shard_offset
                if counted and counted[-1][1] == begin:  # adjacent parameters: one range, one norm kernel
                    counted[-1] = (counted[-1][0], end)
                else:
                    counted.append((begin, end))
            ranges[chunk.index] = counted
        return ranges

    def _swap_optimizer_params(self) -> None:
        for index, group in enumerate(self.optimizer.param_groups):
            group["params"] = [c.buffer("master") for c in self.trainable_chunks if c.group_index == index]

    @property
    def trainable_chunks(self) -> list[Chunk]:
        """Chunks of trainable parameters (the ones with masters, gradients and optimizer state)."""
        return [chunk for chunk in self.chunks if chunk.trainable]

    # --- gradients --------------------------------------------------------------------------------------------

    def _on_grad_ready(self, chunk: Chunk, slot, param: torch.Tensor) -> None:
        """Stages 0/2/3: add the gradient into its chunk's bucket; reduce the bucket once it is complete."""
        if not chunk.has_buffer("grad"):
            chunk.set_buffer("grad", self._take_bucket(chunk.numel, param.grad.dtype))
            self._written[chunk.index] = set()
        region = chunk.slot_view(chunk.buffer("grad"), slot)
        written = self._written[chunk.index]
        if slot.offset in written:  # ``no_sync`` accumulates in the bucket
            region.add_(param.grad)
        else:  # the bucket is not zeroed: its first gradient of a slot is copied in
            region.copy_(param.grad)
            written.add(slot.offset)
        param.grad = None
        if not self._all_grads_in(chunk):
            return
        if self._sync_enabled:
            self._reduce_grads(chunk)
        elif self.gatherer is not None:
            self.gatherer.release(chunk)

    def _all_grads_in(self, chunk: Chunk) -> bool:
        """Count one more gradient of the chunk in; whether that was its last (the count then starts afresh)."""
        self._ready[chunk.index] += 1
        if self._ready[chunk.index] < len(chunk.slots):
            return False
        self._ready[chunk.index] = 0
        return True

    def _take_bucket(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A gradient bucket from the pool (contents undefined until `_on_grad_ready` writes a slot), once fewer than
        ``max_reductions_in_flight`` reductions are in flight."""
        while len(self._pending) >= self.config.max_reductions_in_flight:
            self._land_oldest()
        return self.pool.take(numel, dtype, self.device)

    def _zero_unwritten(self, chunk: Chunk, bucket: torch.Tensor) -> None:
        """Zero the regions of a bucket no gradient was written to: unused parameters and the padding."""
        written = self._written.pop(chunk.index, set())
        for slot in chunk.slots:
            if slot.offset not in written:
                chunk.slot_view(bucket, slot).zero_()
        bucket.narrow(0, chunk.used_numel, chunk.padding_numel).zero_()

    def _land_oldest(self) -> None:
        """Wait for the oldest reduction in flight and put it in its chunk's gradient shard; its bucket goes back to
        the pool (nothing here keeps a reference to it: the handle and the result are dropped first)."""
        chunk, handle, bucket = self._pending.pop(0)
        reduced = handle.wait().to(self.state_device, non_blocking=True)
        shard = chunk.buffer("grad_shard")
        if self.config.stage == 1:  # one reduction of the accumulated full buffer: it overwrites the shard
            torch.mul(reduced, 1.0 / self.group.size, out=reduced)
            shard.copy_(reduced)
        elif chunk.index in self._shard_zero:  # the step's first reduction of the chunk writes the shard
            torch.mul(reduced.to(shard.dtype), 1.0 / self.group.size, out=shard)
            self._shard_zero.discard(chunk.index)
        else:  # stages 0/2/3 reduce every micro-step into the shard
            shard.add_(reduced.to(shard.dtype), alpha=1.0 / self.group.size)
        del reduced, handle
        if bucket is not None:
            self.pool.give(bucket)

    def _before_accumulate(self, chunk: Chunk, _grad: torch.Tensor) -> None:
        """Stage 1, before autograd adds a gradient into the chunk's buffer: if the buffer's reduction is still in
        flight (another backward without `no_sync`), finish it first; it is superseded by the next one."""
        if chunk.index in self._in_flight:
            self._discard_reduction(chunk)

    def _on_grad_accumulated(self, chunk: Chunk, slot, param: torch.Tensor) -> None:
        """Stage 1: keep the gradient in the chunk's buffer; in a `backward` that syncs, start reducing the buffer
        once every gradient of the chunk is in."""
        region = chunk.slot_view(chunk.buffer("grad"), slot)
        if param.grad.data_ptr() != region.data_ptr():  # ``.grad`` was None or replaced before this backward
            region.copy_(param.grad)
            param.grad = region
        if not self._all_grads_in(chunk):
            return
        if self._in_backward and self._sync_enabled:
            self._reduce_grads(chunk)

    def _reduce_grads(self, chunk: Chunk) -> None:
        """Start reducing the chunk's full gradient buffer: all-reduce at stage 0, reduce-scatter into the shard
        otherwise; stages 0/2/3 then drop the bucket, stage 1 keeps its persistent buffer (the all-reduce form of
        the reduce-scatter sums in it, see `_discard_reduction`)."""
        bucket = chunk.buffer("grad")
        if self.config.stage != 1:
            self._zero_unwritten(chunk, bucket)
        sent = bucket
        if self.reduce_dtype is not None and bucket.dtype != self.reduce_dtype:
            sent = bucket.to(self.reduce_dtype)
        if self.config.stage == 0:
            handle = all_reduce(sent, group=self.group, async_op=True) if self.group.size > 1 else _Done(sent)
        else:
            donate = True
            if self.config.stage == 1 and sent is bucket:
                # stage 1 goes on accumulating in its buffer: a reduction may sum in it only where
                # `_discard_reduction` can undo that (the all-reduce form sums every part, the p2p form only its own)
                nbytes = sent.numel() * sent.element_size()
                donate = choose_algorithm("reduce_scatter", self.group.backend, nbytes) == "all_reduce"
            handle = reduce_scatter(sent, "sum", group=self.group, async_op=True, donate=donate)
        self._ready[chunk.index] = 0
        if self.config.stage == 1:
            self._in_flight[chunk.index] = (handle, bucket._version)
            return
        chunk.drop_buffer("grad")
        if sent is bucket:  # the reduction holds the bucket until it lands
            self._pending.append((chunk, handle, bucket))
        else:
            self._pending.append((chunk, handle, None))
            del sent
            self.pool.give(bucket)
        if self.gatherer is not None:
            self.gatherer.release(chunk)

    def _discard_reduction(self, chunk: Chunk) -> None:
        """Stage 1: wait for the reduction of the chunk's buffer in flight and discard it. When it ran in place (the
        all-reduce form) the buffer holds the sum over ranks; divided by the rank count it is the mean, which the
        next reduction sums back to the same total, so accumulating on top of it stays correct."""
        handle, _ = self._in_flight.pop(chunk.index)
        reduced = handle.wait()
        grad = chunk.buffer("grad")
        if reduced.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
            grad.div_(self.group.size)

    def _sync_full_grads(self) -> None:
        """Stage 1: reduce every chunk whose buffer was not reduced during backward, or no longer holds ``.grad``."""
        for chunk in self.trainable_chunks:
            launched = self._in_flight.get(chunk.index)
            grad = chunk.buffer("grad")
            if launched is not None and grad._version != launched[1]:
                names = [slot.name for slot in chunk.slots][:3]
                raise RuntimeError(
                    f"ZeroOptimizer (stage 1): gradients of {names} were changed in place after backward had "
                    "started reducing them; once backward returns, gradients belong to the optimizer (as at "
                    "stages 2/3). Change them in a gradient hook during backward, or accumulate under no_sync() and "
                    "change them before the last backward"
                )
            regions = [(slot, chunk.slot_view(grad, slot)) for slot in chunk.slots]
            if any(s.param.grad is None or s.param.grad.data_ptr() != r.data_ptr() for s, r in regions):
                if launched is not None:  # the user dropped or replaced .grad after backward
                    self._discard_reduction(chunk)
                for slot, region in regions:
                    if slot.param.grad is None:
                        region.zero_()
                    elif slot.param.grad.data_ptr() != region.data_ptr():
                        region.copy_(slot.param.grad)
            if chunk.index not in self._in_flight:  # hooks that never completed, or gradients from outside autograd
                self._reduce_grads(chunk)

    def _finish_grad_sync(self) -> None:
        """Reduce whatever is not reduced yet and wait for every reduction to land in the gradient shards."""
        if self.config.stage == 1:
            self._sync_full_grads()
            self._pending = [(self.chunks[index], handle, None) for index, (handle, _) in self._in_flight.items()]
            self._in_flight.clear()
        else:  # chunks with unused parameters, or accumulated under no_sync, still hold a bucket: every rank flushes
            for chunk in self.trainable_chunks:
                if chunk.has_buffer("grad"):
                    self._reduce_grads(chunk)
        while self._pending:
            self._land_oldest()
        for index in self._shard_zero:  # chunks no gradient reached this step
            self.chunks[index].buffer("grad_shard").zero_()
        self._shard_zero.clear()
        if self.offload and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the non-blocking copies into host memory

    def _master_grads(self) -> list[torch.Tensor]:
        return [chunk.buffer("master").grad for chunk in self.trainable_chunks]

    def _prepare_grads(self) -> bool:
        """Sync, give the masters fp32 gradients, check for overflow and unscale once per step; returns whether the
        step must be skipped."""
        if self._grads_prepared:
            return self.last_step_skipped
        self._finish_grad_sync()
        for chunk in self.trainable_chunks:
            shard = chunk.buffer("grad_shard")
            chunk.buffer("master").grad = shard if shard.dtype == torch.float32 else shard.float()
        self.last_step_skipped = False
        if self.loss_scaler is not None:
            self.last_step_skipped = self.loss_scaler.found_inf(self._master_grads())
            if not self.last_step_skipped:
                for grad in self._master_grads():
                    grad.div_(self.loss_scaler.scale)
        self._grads_prepared = True
        return self.last_step_skipped

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, for the backward passes inside the context.

        The next backward outside it (or `step`) reduces the sum. Stage 1 accumulates in its persistent full
        buffers either way, and reduces them once, in the backward outside it (several backward passes outside it
        each reduce again; the last reduction wins). At stages 0/2/3 every trainable chunk keeps a full gradient
        bucket in the compute dtype while accumulating: 2Ψ bytes (bf16) or 4Ψ (fp32) on every rank, the memory
        stages 2/3 otherwise save; use it to trade that memory for fewer reductions (one per accumulation window
        instead of one per micro-step).
        """
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # --- the training-loop API --------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scaler when there is one.

        At stage 1, outside `no_sync`, it also reduce-scatters each chunk during the backward, as soon as all the
        chunk's gradients are accumulated (a bare ``loss.backward()`` leaves that to `step`). From then until
        `step` the gradients belong to the optimizer: replacing or dropping a ``.grad`` is honoured (the chunk is
        reduced again), changing one in place is an error.
        """
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        if self.config.stage == 1:  # counts start afresh: a chunk left incomplete before (unused params) waits
            self._ready = dict.fromkeys(self._ready, 0)
        self._in_backward = True
        try:
            loss.backward()
        finally:
            self._in_backward = False

    def reduce_gradients(self) -> bool:
        """Reduce this step's gradients over the data axes now (``step()`` does it otherwise).

        The hook for a pipeline executor's ``on_backward_end`` callback: a pipeline's weight-gradient (W) steps
        accumulate outside autograd's hooks, so the sync must be driven explicitly after the step's last backward.
        Stage 1 handles gradients however they were accumulated into ``.grad`` (it reduces during backward only
        inside `backward`, which a pipeline does not call); stages 2/3 rely on the post-accumulate-grad hooks
        during backward. Idempotent within a step.

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
            for grad in self._master_grads():
                grad.mul_(coefficient)
        return total

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The global norm of this step's (unscaled) gradients over every shard and model-parallel rank."""
        if self._prepare_grads():
            return float("inf")
        counted = []
        for chunk in self.trainable_chunks:
            grad = chunk.buffer("master").grad
            counted.extend(grad[start:end] for start, end in self._norm_ranges[chunk.index])
        total = global_grad_norm(counted, group=self.norm_group, norm_type=norm_type)
        self.last_grad_norm = total
        return total

    def step(self) -> bool:
        """Reduce gradients, step the masters, refresh the compute copies. Returns whether the step was skipped.

        At stages 1/2 with ``overlap_param_gather`` (the default) the refresh is an all-gather still in flight when
        `step` returns: it lands before the next forward uses each chunk, and ``model.state_dict()``,
        `full_params`, `save` and `load` wait for it; read ``model.parameters()`` directly only after
        `wait_params`.
        """
        self.wait_params()  # a step without a forward since the last one (the gathers must land first)
        skipped = self._prepare_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(skipped)
        if not skipped:
            self.optimizer.step()
            self._register_optimizer_state()
            self._refresh_params()
        for chunk in self.trainable_chunks:  # the fp32 gradients are transient unless they are the shards
            chunk.buffer("master").grad = None
        self._grads_prepared = False
        return skipped

    def zero_grad(self) -> None:
        """Zero the gradient shards (and stage 1's full gradient buffers, which ``param.grad`` views), discarding
        reductions still in flight and gradients accumulated under `no_sync` (a backward not followed by a step)."""
        for index in list(self._in_flight):  # stage 1, a backward not followed by a step: let its reductions land
            self._discard_reduction(self.chunks[index])
        while self._pending:  # stages 0/2/3, likewise: the reductions finish (collective order) and are dropped
            _, handle, bucket = self._pending.pop(0)
            handle.wait()
            del handle
            if bucket is not None:
                self.pool.give(bucket)
        for chunk in self.trainable_chunks:
            if self.config.stage == 1:
                chunk.buffer("grad_shard").zero_()
                grad = chunk.buffer("grad").zero_()
                for slot in chunk.slots:
                    slot.param.grad = chunk.slot_view(grad, slot)
                continue
            if chunk.has_buffer("grad"):  # a bucket still accumulating (no_sync) is dropped too
                bucket = chunk.buffer("grad")
                chunk.drop_buffer("grad")
                self.pool.give(bucket)
                self._written.pop(chunk.index, None)
                self._ready[chunk.index] = 0
            self._shard_zero.add(chunk.index)  # zero in effect: the first reduction to land overwrites the shard
            for slot in chunk.slots:
                slot.param.grad = None
        self._grads_prepared = False

    def _register_optimizer_state(self) -> None:
        for chunk in self.trainable_chunks:
            for key, value in self.optimizer.state.get(chunk.buffer("master"), {}).items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    chunk.set_buffer(f"optim/{key}", value, tier="host" if self.offload else "device")

    @torch.no_grad()
    def _refresh_params(self) -> None:
        for chunk in self.trainable_chunks:
            master = chunk.buffer("master")
            aliased = chunk.buffers["master"].aliases is not None
            if self.config.stage == 3:
                if not aliased:
                    chunk.buffer("param_shard").copy_(master, non_blocking=True)
                continue
            param = chunk.buffer("param")
            if self.config.stage == 0:
                if not aliased:
                    param.copy_(master, non_blocking=True)
                continue
            piece = master if aliased else master.to(self.device, param.dtype, non_blocking=True)
            # in place when the master is the param's own shard; overlapped with the next forward when configured
            handle = all_gather(piece, group=self.group, out=param, async_op=True)
            self._param_gathers[chunk.index] = handle
        if not self._overlap_gathers:
            self.wait_params()
        if self.gatherer is not None:
            self.gatherer.release_all()

    def _install_param_waits(self, model: torch.nn.Module) -> None:
        """Forward and state-dict pre-hooks that wait for the in-flight gather of a module's chunks (stages 1/2,
        overlapped): a forward, and a ``state_dict()`` of the module or of any module holding it, see the
        parameters `step` or `load` wrote."""
        for module in model.modules():
            owned = {self.chunk_of[id(p)].index for p in module.parameters(recurse=False) if id(p) in self.chunk_of}
            if owned:
                wait = functools.partial(self._wait_chunks, sorted(owned))
                self._hooks.append(module.register_forward_pre_hook(wait))
                self._hooks.append(module.register_state_dict_pre_hook(wait))

    def _wait_chunks(self, indices: list[int], *_) -> None:
        for index in indices:
            handle = self._param_gathers.pop(index, None)
            if handle is not None:
                handle.wait()

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight after `step` (stages 1/2 with
        ``overlap_param_gather``): call it before reading ``model.parameters()`` outside a forward pass (a forward,
        ``model.state_dict()``, `full_params`, `save` and `load` wait themselves)."""
        self._wait_chunks(list(self._param_gathers))

    def release_params(self) -> None:
        """Stage 3: free every gathered chunk (after an evaluation forward, say). A no-op at stages 0/1/2."""
        if self.gatherer is not None:
            self.gatherer.release_all()

    # --- inspection -------------------------------------------------------------------------------------------

    def _gather_named(self, buffer_name: str) -> dict[str, torch.Tensor]:
        """Full tensors per parameter name from a sharded buffer (collective: every rank must call it)."""
        self.wait_params()
        result = {}
        for chunk in self.trainable_chunks:
            if buffer_name == "master.grad":
                shard = chunk.buffer("master").grad
            else:
                shard = chunk.buffer(buffer_name)
            shard = shard.to(self.device).contiguous()
            full = shard if self.num_shards == 1 else all_gather(shard, group=self.group)
            for slot in chunk.slots:
                result[slot.name] = chunk.slot_view(full, slot).clone()
        return result

    def full_params(self) -> dict[str, torch.Tensor]:
        """The fp32 masters of every trainable parameter, gathered (a collective)."""
        return self._gather_named("master")

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced, unscaled fp32 gradients of every trainable parameter, gathered (a collective; after
        backward, before `step`)."""
        self._prepare_grads()
        return self._gather_named("master.grad")

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
        """Load a checkpoint written by `save` at any data-parallel size; returns its metadata (every rank calls it).
        The model's parameters hold the loaded values when it returns."""
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
