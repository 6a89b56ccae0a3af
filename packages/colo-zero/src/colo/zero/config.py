"""Settings of the chunk optimizers: `ChunkConfig`, what every optimizer over colo chunks takes, and `ZeroConfig`
(colo.gemini's `GeminiConfig` extends `ChunkConfig` too). Each setting is defined once, here or in the one config
that has it; the Booster's plugins pass their fields through."""

from __future__ import annotations

from dataclasses import dataclass

from .amp import MixedPrecision

STAGES = (0, 1, 2, 3)
GRAD_REDUCTIONS = ("backward", "step")


@dataclass(kw_only=True)
class ChunkConfig:
    """Settings shared by every chunk optimizer (`ZeroOptimizer`, `GeminiOptimizer`)."""

    data_axes: tuple[str, ...] = ("dp",)
    """Mesh axes the shards are spread over, fused (``("dp", "sp")`` when sequence parallelism replicates weights)."""
    chunk_numel: int | None = None
    """Chunk capacity in elements; ``None`` searches for the size that wastes the least padding."""
    max_chunk_numel: int = 1 << 22
    """Largest capacity the search tries (4M elements: 16 MiB in fp32). Chunks are the unit of overlap: one chunk
    holding a whole model leaves nothing to overlap with backward or to prefetch, and very large buffers are
    fresh memory on every allocation; about one transformer layer per chunk measured best on CPU."""
    mixed_precision: MixedPrecision | None = None
    """Compute / communication dtypes; ``None``: compute in the model's dtype (fp32 masters alias fp32 parameters
    where the optimizer keeps its state beside them). Masters are fp32 either way."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.data_axes, str):
            self.data_axes = (self.data_axes,)
        self.data_axes = tuple(self.data_axes)
        if not self.data_axes:
            raise ValueError(f"{name}.data_axes is empty; name the data-parallel axes, e.g. ('dp',)")
        if self.chunk_numel is not None and self.chunk_numel < 1:
            raise ValueError(f"{name}.chunk_numel={self.chunk_numel} must be positive, or None to search")
        if self.max_chunk_numel < 1:
            raise ValueError(f"{name}.max_chunk_numel={self.max_chunk_numel} must be positive")


@dataclass(kw_only=True)
class ZeroConfig(ChunkConfig):
    """Settings of `ZeroOptimizer`."""

    stage: int = 2
    """ZeRO stage: 0 (nothing sharded), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)."""
    offload_optimizer: bool = False
    """ZeRO-Offload: keep fp32 masters, gradient shards and optimizer state in host memory (pinned with CUDA) and
    run the optimizer step there (torch's fused CPU AdamW by default); the device keeps only the compute copies."""
    tensor_parallel_axes: tuple[str, ...] = ()
    """Mesh axes the model is tensor-parallel over. Gradient clipping sums the norm over them, counting a
    parameter sharded over an axis (its colo layout says `Shard`) on every rank of it and a replicated one once."""
    pipeline_axis: str | None = None
    """The mesh axis of pipeline stages, whose parameters are disjoint: the gradient norm sums over it too."""
    grad_reduction: str = "backward"
    """When gradients are reduced over the data axes. ``"backward"``: during backward, from gradient hooks, as soon
    as a chunk's gradients are in (stages 0/2/3 every micro-step, stage 1 in the backward outside ``no_sync``).
    ``"step"``: gradients accumulate in full over all of a step's backward passes and each chunk is reduced once,
    at `ZeroOptimizer.reduce_gradients` or the step; at stage 3 the chunks a forward gathers then stay gathered
    until that reduction (reshard after the step, not after each forward and backward). A pipeline needs
    ``"step"``: its weight-gradient steps fire no gradient hooks and tied stages sum gradients after the last
    backward. It costs a full gradient per parameter (compute dtype) and, at stage 3, the stage's gathered
    parameters from the first forward to the reduction: the memory of ZeRO-1 during the step, the shards only
    between steps; the communication is one reduction per chunk per step (and one gather per chunk per step at
    stage 3) whatever the number of microbatches."""
    max_reductions_in_flight: int = 2
    """Stages 0/2/3: gradient buckets whose reduction may be in flight at once; the next bucket first waits for
    the oldest to land in its shard. At most this many + 1 full buckets exist during backward (they are reused
    from step to step), instead of one per chunk until the step."""
    overlap_param_gather: bool = True
    """Stages 1/2: start the all-gather of the updated parameters at the end of `step` and wait for each chunk
    only before the first module using it runs in the next forward (Megatron's overlapped parameter gather).
    Reads of the parameters through the model wait for the chunks they return: ``parameters()`` /
    ``named_parameters()`` of the model or any submodule (`colo.zero.param_reads`), ``state_dict()``,
    `full_params`, `checkpoint_state` / `save` and `load` (which returns with the loaded values in place), and a
    parameter read as an attribute (``model.lm_head.weight``). Only a reference kept from before the step reads
    the old values until the next forward: call `wait_params` first."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"ZeroConfig.stage={self.stage!r} is not a ZeRO stage; use one of {STAGES}")
        super().__post_init__()
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(
                f"ZeroConfig.grad_reduction={self.grad_reduction!r} is unknown; use one of {GRAD_REDUCTIONS}"
            )
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
