"""colo.zero: ZeRO stages 0/1/2/3 over the fused data-parallel axes of a mesh, on flat padded chunks, with mixed
precision, optimizer offload and checkpoints in the common format.

Example::

    from colo.zero import ZeroOptimizer

    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh=mesh, stage=2)
    zero.backward(loss)
    zero.clip_grad_norm_(1.0)
    zero.step()
    zero.zero_grad()
"""

from .amp import DynamicLossScaler, MixedPrecision
from .buffer_pool import BufferPool
from .chunk import BUFFER_NAMES, TIERS, Chunk, ChunkBuffer, ChunkPlan, ParamSlot, execution_order, plan_chunks
from .clip import clip_coefficient, global_grad_norm
from .config import ChunkConfig, ZeroConfig
from .core import ChunkOptimizer
from .expert_parallel import ExpertParallelZero
from .grad_sync import BucketGradSync, GradSync, PersistentGradSync
from .memory import MemoryEstimate, MemoryReport, estimate_memory, memory_report
from .stage3 import ChunkGatherer
from .zero_optimizer import ZeroOptimizer

__version__ = "0.1.0"

__all__ = [
    "BucketGradSync",
    "BufferPool",
    "BUFFER_NAMES",
    "TIERS",
    "Chunk",
    "ChunkBuffer",
    "ChunkConfig",
    "ChunkGatherer",
    "ChunkOptimizer",
    "ChunkPlan",
    "DynamicLossScaler",
    "ExpertParallelZero",
    "GradSync",
    "MemoryEstimate",
    "MemoryReport",
    "MixedPrecision",
    "ParamSlot",
    "PersistentGradSync",
    "ZeroConfig",
    "ZeroOptimizer",
    "__version__",
    "clip_coefficient",
    "estimate_memory",
    "execution_order",
    "global_grad_norm",
    "memory_report",
    "plan_chunks",
]
