"""colo.gemini: the heterogeneous memory manager: chunk placement over device, host and disk tiers, memory tracing,
prefetch and the hybrid optimizer.

Example::

    from colo.gemini import GeminiOptimizer

    gemini = GeminiOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh=mesh,
                             placement="auto", device_capacity="8GiB", host_capacity="64GiB")
    gemini.backward(loss)
    gemini.clip_grad_norm_(1.0)
    gemini.step()
    gemini.zero_grad()
    print(gemini.memory_report())
"""

from .checkpoint import load_gemini, save_gemini
from .config import GeminiConfig, GeminiTiers, parse_bytes
from .gemini import GeminiOptimizer
from .hooks import GeminiGatherer
from .manager import ChunkManager
from .optimizer import HybridAdam
from .placement import AutoPolicy, ChunkSizes, Placement, StaticPolicy, static_placement
from .tiers import DeviceArena, DiskTier, GeminiMemoryError, HostTier, format_bytes
from .tracer import AccessSample, GeminiMemoryReport, MemoryTracer, NonModelMemory, StepTraffic, TierReport

__version__ = "0.1.0"

__all__ = [
    "AccessSample",
    "AutoPolicy",
    "ChunkManager",
    "ChunkSizes",
    "DeviceArena",
    "DiskTier",
    "GeminiConfig",
    "GeminiTiers",
    "GeminiGatherer",
    "GeminiMemoryError",
    "GeminiMemoryReport",
    "GeminiOptimizer",
    "HostTier",
    "HybridAdam",
    "MemoryTracer",
    "NonModelMemory",
    "Placement",
    "StaticPolicy",
    "StepTraffic",
    "TierReport",
    "__version__",
    "format_bytes",
    "load_gemini",
    "parse_bytes",
    "save_gemini",
    "static_placement",
]
