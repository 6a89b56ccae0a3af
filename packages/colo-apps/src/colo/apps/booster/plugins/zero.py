"""The `Zero` plugin: colo.zero's `ZeroOptimizer` (stages 0-3) over every rank, with fp32 masters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from colo.zero import MixedPrecision, ZeroOptimizer

from ..plans import find_plan
from ..replicas import broadcast_model_state, model_tensors
from .base import Engine, Plugin
from .driver import OptimizerDriver


@dataclass(kw_only=True)
class Zero(Plugin):
    """ZeRO data parallelism over every rank (`colo.zero.ZeroOptimizer`).

    ``precision="bf16"``/``"fp16"`` keeps bf16/fp16 compute copies and gradients with fp32 masters (fp16 with
    dynamic loss scaling over every rank). Stages 2/3 reduce-scatter every microbatch (the memory bound they
    exist for); set ``accumulate_without_sync=True`` to accumulate full gradients locally instead.
    """

    packs_chunks: ClassVar[bool] = True

    stage: int = 2
    """ZeRO stage: 0 (nothing sharded), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    offload_optimizer: bool = False
    """ZeRO-Offload: masters, gradient shards and optimizer state in host memory, the step on the host."""
    chunk_numel: int | None = None
    """Chunk capacity in elements (``None``: searched for the least padding)."""
    comm_dtype: str | None = None
    """Gradient reduction precision (``None``: the compute precision)."""
    accumulate_without_sync: bool = False
    """Accumulate gradients over microbatches without communication (`ZeroOptimizer.no_sync`): one full gradient
    buffer per chunk is held meanwhile."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Zero.stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        if self.comm_dtype is not None and self.comm_dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"Zero.comm_dtype={self.comm_dtype!r} is not supported; use fp32, bf16, fp16 or None")
        if self.stage == 3 and self.compile_blocks:
            raise ValueError(
                "Zero.compile_blocks=True does not work with stage=3: the per-block parameter gathers swap the "
                "parameters' storage inside the blocks, which torch.compile cannot trace; use stage <= 2 or "
                "compile_blocks=False"
            )
        if self.stage == 3 and self.activation_checkpointing == "selective":
            raise ValueError(
                "Zero.activation_checkpointing='selective' does not work with stage=3: gathering parameters inside the "
                "blocks runs different ops in the recomputation; use 'full' or 'offload', or stage <= 2"
            )

    def mixed_precision(self) -> MixedPrecision | None:
        """The `MixedPrecision` for this plugin's precision (``None`` for fp32 with fp32 communication)."""
        from ..precision import PRECISIONS

        comm = PRECISIONS[self.comm_dtype] if self.comm_dtype else None
        if self.precision == "fp32" and comm in (None, torch.float32):
            return None
        return MixedPrecision(param_dtype=self.compute_dtype, comm_dtype=comm)

    def configure(self, model, optimizer, *, criterion=None, param_order=None) -> Engine:
        plan = find_plan(model)
        mesh = self.build_mesh()
        broadcast_model_state(model_tensors(model), group=mesh.group("dp"))  # rank 0's values, before chunking
        self.maybe_checkpoint_activations(model)
        self.maybe_compile(model)
        zero = ZeroOptimizer(
            model,
            optimizer,
            mesh=mesh,
            stage=self.stage,
            chunk_numel=self.chunk_numel,
            mixed_precision=self.mixed_precision(),
            offload_optimizer=self.offload_optimizer,
            checkpoint_names=plan.checkpoint_names(model) if plan is not None else None,
            param_order=param_order,
        )
        return ZeroEngine(
            self,
            model=model,
            optimizer=zero,
            mesh=mesh,
            criterion=criterion,
            accumulate_without_sync=self.accumulate_without_sync,
        )


class ZeroEngine(OptimizerDriver, Engine):
    """Runs steps for `Zero` (and for the data-parallel part of `HybridParallel` without a pipeline).

    Args:
        accumulate_without_sync: accumulate full gradients over microbatches without communication (stages 0/2/3;
            `Zero.accumulate_without_sync`). Default: ``False``.
    """

    def __init__(self, plugin, *, model, optimizer: ZeroOptimizer, mesh, criterion, accumulate_without_sync=False):
        # stage 1 accumulates in its full buffers and reduces (overlapped) in the last microbatch's backward, the
        # others under no_sync; stages 0/2/3 reduce every microbatch unless told to accumulate
        sync_every = optimizer.reduces_every_microbatch and not accumulate_without_sync
        super().__init__(
            plugin, model=model, optimizer=optimizer, mesh=mesh, criterion=criterion, sync_every_microbatch=sync_every
        )
