"""`ZeroOptimizer`: ZeRO stages 0, 1, 2 and 3 over the fused data-parallel axes of a mesh, on top of chunks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020; the optimizer
offload follows Ren et al., "ZeRO-Offload", 2021.

The stages differ in two strategies, chosen once in `ZeroOptimizer._select_strategies`: how gradients reach the
shards (`colo.zero.grad_sync`: a persistent buffer at stage 1, pooled buckets at 0/2/3) and where the compute
copy lives (`colo.zero.param_sync`: full at 0/1/2, sharded at 3); the rest is the chunk optimizer core
(`colo.zero.core`).

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

With ``grad_reduction="step"`` (a pipeline schedule's microbatches) no stage reduces during backward: the full
gradients accumulate over the step and each chunk is reduced once, at `reduce_gradients` (the executor's
``on_backward_end``) or the step; at stage 3 each chunk is gathered once per step, at its first use, and held
until that reduction (`colo.zero.grad_sync`, `colo.zero.stage3`).

The optimizer is any torch optimizer; `ZeroOptimizer` swaps its parameters, in place, for one flat fp32 master
per chunk shard (so LR schedulers built on it keep working). Parameter groups keep their lr / weight decay:
a chunk never mixes groups.
"""

from __future__ import annotations

import torch

from .buffer_pool import BufferPool
from .chunk import Chunk
from .config import STAGES, ZeroConfig  # noqa: F401 - ZeroConfig is re-exported here, where it was defined
from .core import ChunkOptimizer
from .grad_sync import (
    BucketGradSync,
    GradSync,
    PersistentGradSync,
    all_reduce_async,
    reduce_scatter_async,
    to_state_device,
)
from .param_sync import FullParams, ShardedParams


class ZeroOptimizer(ChunkOptimizer):
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
        param_filter: ``fn(name) -> bool``: manage only the parameters it accepts (another optimizer has the rest,
            as in `ExpertParallelZero`); default all of the model's.
        norm_replicas: parameters whose gradient another rank holds too and counts in the global norm, left out of
            it here: e.g. the last pipeline stage's copy of an embedding tied to the first stage's (the executor
            sums their gradients, so both stages hold the same one); default none.

    Example::

        zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh=mesh, stage=2)
        loss = model(x).loss
        zero.backward(loss)
        zero.clip_grad_norm_(1.0)
        zero.step()
        zero.zero_grad()
    """

    config_type = ZeroConfig

    def _default_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, fused=True)

    def _build(self, group_of: dict[int, int]) -> None:
        config = self.config
        self.offload = config.offload_optimizer
        self.state_device = torch.device("cpu") if self.offload else self.device
        self.pool = BufferPool()
        """Reused full-chunk buffers: gradient buckets, and stage 3's gathered parameters."""
        shard_over_data = self._select_strategies()
        self._plan_chunks(
            group_of,
            num_shards=self.group.size if shard_over_data else 1,
            shard_rank=self.group.rank if shard_over_data else 0,
        )
        self._norm_ranges = self._counted_ranges()
        # the gradient norm sums over the shards (not when every data rank holds the whole gradient) and over the
        # model-parallel axes; the group is created here, by every rank, not lazily at the first clip
        norm_axes = (config.data_axes if shard_over_data else ()) + config.model_parallel_axes
        self.norm_group = self.mesh.group(*norm_axes) if norm_axes else None
        self.param_sync = self._make_params()
        self.grad_sync = self._make_grad_sync()
        self._build_buffers()
        self._swap_optimizer_params()
        self._hooks += self.grad_sync.install()
        self._hooks += self.param_sync.install(self.model, self.chunk_of)
        self.gatherer = self.param_sync.gatherer
        """Stage 3's `ChunkGatherer` (``None`` at stages 0/1/2)."""

    @property
    def reduces_every_microbatch(self) -> bool:
        """Whether gradients are reduced in every microbatch's backward (stages 0, 2, 3; a training loop accumulating
        microbatches then runs the others under ``no_sync`` only if it wants to skip that), or accumulate in full
        buffers and reduce once, in the last microbatch's backward (stage 1)."""
        return self._grad_strategy is not PersistentGradSync and self.config.grad_reduction == "backward"

    # --- the one place the stage is read ----------------------------------------------------------------------

    def _select_strategies(self) -> bool:
        """Choose the gradient and parameter strategies of the stage; returns whether the chunks are sharded over
        the data axes (every stage but 0)."""
        stage = self.config.stage
        self._grad_strategy = PersistentGradSync if stage == 1 else BucketGradSync
        self._reduce = all_reduce_async(self.group) if stage == 0 else reduce_scatter_async(self.group, donate=True)
        self._param_strategy = ShardedParams if stage == 3 else FullParams
        self._overlap_param_gather = stage in (1, 2) and self.config.overlap_param_gather
        return stage != 0

    def _make_params(self) -> FullParams | ShardedParams:
        if self._param_strategy is ShardedParams:
            hold = self.config.grad_reduction == "step"
            return ShardedParams(self.chunks, group=self.group, pool=self.pool, hold_until_reduced=hold)
        return FullParams(self.chunks, group=self.group, device=self.device, overlap=self._overlap_param_gather)

    def _make_grad_sync(self) -> GradSync:
        chunks = self.trainable_chunks
        deferred = self.config.grad_reduction == "step"
        if self._grad_strategy is PersistentGradSync:
            return PersistentGradSync(
                chunks,
                group=self.group,
                reduce_dtype=self.reduce_dtype,
                state_device=self.state_device,
                deferred=deferred,
            )
        return BucketGradSync(
            chunks,
            group=self.group,
            reduce=self._reduce,
            reduce_dtype=self.reduce_dtype,
            pool=self.pool,
            device=self.device,
            state_device=self.state_device,
            max_in_flight=self.config.max_reductions_in_flight,
            on_reduced=self.param_sync.release,
            deferred=deferred,
        )

    # --- construction -----------------------------------------------------------------------------------------

    def _build_buffers(self) -> None:
        persistent = isinstance(self.grad_sync, PersistentGradSync)
        tier = "host" if self.offload else "device"
        for chunk in self.chunks:
            compute_dtype = self.param_dtype or chunk.dtype
            full = chunk.pack(compute_dtype, self.device)
            fp32_full = full if full.dtype == torch.float32 else chunk.pack(torch.float32, self.device)
            alias = self.param_dtype is None and chunk.dtype == torch.float32 and not self.offload
            shard, shard_buffer = self.param_sync.place(chunk, full)
            if not chunk.trainable:
                continue
            if alias:  # fp32 without mixed precision: the master is the compute shard itself
                chunk.set_buffer("master", shard, aliases=shard_buffer)
            else:
                master = to_state_device(chunk.shard_of(fp32_full).clone(), self.state_device)
                chunk.set_buffer("master", master, tier=tier)
            if persistent:  # the persistent full gradient; the reduced shard lands in its own region when it can
                chunk.set_buffer("grad", torch.zeros(chunk.numel, dtype=compute_dtype, device=self.device))
                if compute_dtype == self.grad_dtype and not self.offload:
                    chunk.set_buffer("grad_shard", chunk.shard_of(chunk.buffer("grad")), aliases="grad")
                    continue
            grad_shard = torch.zeros(chunk.shard_numel, dtype=self.grad_dtype, device=self.device)
            chunk.set_buffer("grad_shard", to_state_device(grad_shard, self.state_device), tier=tier)

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
        at coordinate 0 of that axis (so it is counted once), a sharded one everywhere; never ``norm_replicas``."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for chunk in self.chunks:
            counted = []
            for slot in chunk.slots:
                if self.is_tensor_parallel_replica(slot.param) or id(slot.param) in self._norm_replicas:
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

    # --- the core's steps -------------------------------------------------------------------------------------

    def _finish_grad_sync(self) -> list[torch.Tensor]:
        self.grad_sync.finish()
        if self.config.grad_reduction == "step":  # stage 3: frozen chunks held for the step (no gradient frees them)
            self.param_sync.release_all()
        if self.offload and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the non-blocking copies into host memory
        grads = []
        for chunk in self.trainable_chunks:
            shard = chunk.buffer("grad_shard")
            master = chunk.buffer("master")
            master.grad = shard if shard.dtype == torch.float32 else shard.float()
            grads.append(master.grad)
        return grads

    def _counted_grads(self) -> list[torch.Tensor]:
        counted = []
        for chunk, grad in zip(self.trainable_chunks, self._grad_shards):
            counted.extend(grad[start:end] for start, end in self._norm_ranges[chunk.index])
        return counted

    def _update(self, skipped: bool) -> None:
        if not skipped:
            self.optimizer.step()
            self.register_optimizer_state()
            self.param_sync.refresh(self.trainable_chunks)
        for chunk in self.trainable_chunks:  # the fp32 gradients are transient unless they are the shards
            chunk.buffer("master").grad = None

    def _discard_grads(self) -> None:
        self.grad_sync.discard()

    def register_optimizer_state(self) -> None:
        """Record the optimizer's per-element state tensors as chunk buffers (``optim/<state>``), after a step or a
        load created them."""
        for chunk in self.trainable_chunks:
            for key, value in self.optimizer.state.get(chunk.buffer("master"), {}).items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    chunk.set_buffer(f"optim/{key}", value, tier="host" if self.offload else "device")

    # --- the training-loop API --------------------------------------------------------------------------------

    def no_sync(self):
        """Accumulate gradients locally, without communication, for the backward passes inside the context.

        The next backward outside it (or `step`) reduces the sum. Stage 1 accumulates in its persistent full
        buffers either way, and reduces them once, in the backward outside it (several backward passes outside it
        each reduce again; the last reduction wins). At stages 0/2/3 every trainable chunk keeps a full gradient
        bucket in the compute dtype while accumulating: 2Ψ bytes (bf16) or 4Ψ (fp32) on every rank, the memory
        stages 2/3 otherwise save; use it to trade that memory for fewer reductions (one per accumulation window
        instead of one per micro-step).
        """
        return super().no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scaler when there is one.

        At stage 1, outside `no_sync`, it also reduce-scatters each chunk during the backward, as soon as all the
        chunk's gradients are accumulated (a bare ``loss.backward()`` leaves that to `step`). From then until
        `step` the gradients belong to the optimizer: replacing or dropping a ``.grad`` is honoured (the chunk is
        reduced again), changing one in place is an error.
        """
        super().backward(loss)

    def step(self) -> bool:
        """Reduce gradients, step the masters, refresh the compute copies. Returns whether the step was skipped.

        At stages 1/2 with ``overlap_param_gather`` (the default) the refresh is an all-gather still in flight when
        `step` returns: it lands before the next forward uses each chunk, and reads through the model
        (``model.parameters()``, ``named_parameters()``, ``model.state_dict()``, ``model.lm_head.weight``),
        `full_params`, `save` and `load` wait for it; only a parameter reference kept from before the step needs
        `wait_params`.
        """
        self.wait_params()  # a step without a forward since the last one (the gathers must land first)
        return super().step()

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight after `step` (stages 1/2 with
        ``overlap_param_gather``): needed only to read, outside a forward pass, a parameter reference kept from
        before the step (reads through the model, a forward, `full_params`, `save` and `load` wait themselves)."""
        self.param_sync.wait()

    def release_params(self) -> None:
        """Stage 3: free every gathered chunk (after an evaluation forward, say). A no-op at stages 0/1/2."""
        self.param_sync.release_all()

    # --- inspection and checkpoint state ----------------------------------------------------------------------

    def full_params(self) -> dict[str, torch.Tensor]:
        """The fp32 masters of every trainable parameter, gathered (a collective)."""
        self.wait_params()
        return super().full_params()

    def full_optimizer_states(self) -> dict[str, torch.Tensor]:
        """Every per-element optimizer state, gathered, keyed ``<param name>/<state>`` (a collective)."""
        self.wait_params()
        keys = sorted({name.removeprefix("optim/") for c in self.trainable_chunks for name in c.buffers if "/" in name})
        result = {}
        for key in keys:
            shards = {chunk.index: chunk.buffer(f"optim/{key}") for chunk in self.trainable_chunks}
            for name, tensor in self._gather_shards(shards).items():
                result[f"{name}/{key}"] = tensor
        return result

    def shard_tensors(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        if not chunk.trainable:
            if chunk.has_buffer("param_shard"):
                return {"master": chunk.buffer("param_shard")}
            return {"master": chunk.shard_of(chunk.buffer("param"))}
        master = chunk.buffer("master")
        states = self.optimizer.state.get(master, {})
        per_element = {k: v for k, v in states.items() if isinstance(v, torch.Tensor) and v.shape == master.shape}
        return {"master": master, **per_element}

    def shard_scalars(self, chunk: Chunk) -> dict[str, list]:
        scalars = {}
        master = chunk.buffer("master")
        for key, value in self.optimizer.state.get(master, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == master.shape:
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                scalars[key] = [value.item(), str(value.dtype).removeprefix("torch.")]
            elif isinstance(value, (int, float, bool)):
                scalars[key] = [value, None]
            else:
                raise TypeError(
                    f"optimizer state {key!r} of {type(self.optimizer).__name__} is a {type(value).__name__}; ZeRO "
                    "checkpoints hold per-element tensors and scalars only"
                )
        return scalars

    def load_targets(self, chunk: Chunk, state_names: list[str]) -> dict[str, torch.Tensor]:
        if chunk.trainable:
            master = chunk.buffer("master")
            state = self.optimizer.state.setdefault(master, {})
            for key in state_names:
                if not (isinstance(state.get(key), torch.Tensor) and state[key].shape == master.shape):
                    state[key] = torch.zeros_like(master)
        return self.shard_tensors(chunk)

    @torch.no_grad()
    def finish_load(self, loaded: dict[int, dict[str, torch.Tensor]], scalars: dict[int, dict[str, list]]) -> None:
        for chunk in self.trainable_chunks:  # the tensors were loaded in place
            saved = scalars.get(chunk.index)
            if not saved:
                continue
            state = self.optimizer.state[chunk.buffer("master")]
            for key, (value, dtype) in saved.items():
                if dtype is None:
                    state[key] = value
                else:
                    state[key] = torch.tensor(value, dtype=getattr(torch, dtype), device=chunk.buffer("master").device)
        self.register_optimizer_state()
        self.param_sync.refresh(self.trainable_chunks)
        self.param_sync.refresh_frozen()
        self.wait_params()  # the compute copies' all-gather (overlapped after a step) must land before load returns

    def before_checkpoint(self) -> None:
        """Wait for the parameter gathers in flight: a checkpoint reads and writes the chunk shards."""
        self.wait_params()

    def checkpoint_metadata(self) -> dict:
        return {"stage": self.config.stage, **super().checkpoint_metadata()}

    def memory_report(self):
        """Bytes of parameters, gradients, masters, optimizer state and padding held on this rank."""
        from .memory import memory_report

        return memory_report(self)
