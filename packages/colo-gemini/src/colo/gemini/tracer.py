"""The memory tracer: per-tier use and high-water marks, bytes moved per step, prefetch hits and misses, and the
non-model memory in use around each chunk access.

`MemoryTracer` is told of every tier allocation and free (its own running count of the device tier must agree
with the arena's bookkeeping), of every transfer between tiers and of every chunk access. `NonModelMemory`
measures the memory in use that is not chunk data (activations, temporaries, gradients before they reach their
chunk) during the warm-up step: on CPU by a dispatch mode that counts the live bytes of every storage an
operator creates (freed storages are noticed through weak references), on CUDA from the allocator's figures
minus the arena. `memory_report()` of `GeminiOptimizer` returns a `GeminiMemoryReport`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .tiers import format_bytes

DIRECTIONS = ("host->device", "device->host", "disk->device", "disk->host", "device->disk", "host->disk")
"""The transfers the tracer counts (``device->disk`` goes through a host staging buffer on CUDA)."""


@dataclass
class StepTraffic:
    """What moved during one training step (from one ``step()`` to the next)."""

    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    """Bytes per direction (see `DIRECTIONS`)."""
    prefetch_hits: int = 0
    """Accesses to a chunk whose parameters a prefetch had brought (or was bringing) to the device."""
    prefetch_misses: int = 0
    """Accesses that had to fetch the chunk's parameters to the device synchronously."""
    cache_hits: int = 0
    """Accesses to an offloaded chunk that was still on the device from an earlier access."""
    evictions: int = 0
    """Chunk parameter copies dropped from the device to make room."""
    wasted_prefetches: int = 0
    """Prefetched copies evicted before they were used."""
    budget_overruns: int = 0
    """Allocations that went past the auto policy's planned device limit (capacity minus the recorded non-model
    memory) because nothing else could be evicted; the arena's capacity itself is never exceeded."""
    compactions: int = 0
    """Times the device arena slid its live buffers together because free memory was split into small holes."""
    device_peak: int = 0
    """Highest device-tier bytes in use during the step."""

    @property
    def total_moved(self) -> int:
        """Bytes moved in every direction."""
        return sum(self.bytes_moved.values())


@dataclass(frozen=True)
class TierReport:
    """One tier's figures, in bytes."""

    name: str
    capacity: float
    used: int
    high_water: int
    params: int
    """Parameter (compute copy) bytes homed on the tier, gathered copies and gradient buckets included."""
    optimizer: int
    """fp32 masters, gradient shards and optimizer states on the tier (disk staging buffers included)."""


@dataclass(frozen=True)
class GeminiMemoryReport:
    """`GeminiOptimizer.memory_report()`: per-tier use and what moved, step by step."""

    tiers: dict[str, TierReport]
    setup: StepTraffic
    """Moving the model into the tiers, at construction."""
    steps: list[StepTraffic]
    """One entry per completed training step, oldest first (the tracer keeps the most recent 1000; under auto
    placement step 1 is the warm-up)."""
    current: StepTraffic
    """The step in progress (forward and backward since the last ``step()``)."""
    non_model_peak: int | None
    """Peak non-model bytes the warm-up recorded (auto placement), else ``None``."""
    tracer_device_peak: int
    """The tracer's own high-water mark of the device tier (counted from allocation events)."""

    @property
    def prefetch_hits(self) -> int:
        """Prefetch hits over all steps."""
        return sum(step.prefetch_hits for step in self.steps)

    @property
    def prefetch_misses(self) -> int:
        """Synchronous fetches over all steps."""
        return sum(step.prefetch_misses for step in self.steps)

    def __str__(self) -> str:
        lines = [f"{'tier':8} {'capacity':>12} {'used':>12} {'high water':>12} {'params':>12} {'optimizer':>12}"]
        for tier in self.tiers.values():
            capacity = "unlimited" if tier.capacity == float("inf") else format_bytes(tier.capacity)
            lines.append(
                f"{tier.name:8} {capacity:>12} {format_bytes(tier.used):>12} {format_bytes(tier.high_water):>12} "
                f"{format_bytes(tier.params):>12} {format_bytes(tier.optimizer):>12}"
            )
        for i, step in enumerate(self.steps, start=1):
            moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in step.bytes_moved.items() if v)
            lines.append(
                f"step {i}: moved {moved or 'nothing'}; prefetch hits {step.prefetch_hits}, misses "
                f"{step.prefetch_misses}, cache hits {step.cache_hits}, evictions {step.evictions}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class AccessSample:
    """The device tier at one chunk access."""

    step: int
    """The training step, counted from 1."""
    chunk: int
    device_used: int
    """Device-tier bytes in use once the access was served."""
    device_limit: int
    """What the policy allowed the device tier at this access (capacity, minus recorded non-model memory)."""


class MemoryTracer:
    """Counts tier use, transfers, chunk accesses and prefetch outcomes; see the module docstring.

    Args:
        history: completed steps kept (older ones are dropped; totals such as high-water marks are kept apart).
        max_samples: access samples kept (the most recent).
    """

    def __init__(self, *, history: int = 1000, max_samples: int = 100_000) -> None:
        self.used: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.setup = StepTraffic()
        """Moving the model into the tiers, at construction."""
        self.steps: collections.deque[StepTraffic] = collections.deque(maxlen=history)
        """The most recent completed training steps."""
        self.current = self.setup
        """The step in progress (the setup until `end_setup`)."""
        self.step_index = 0
        """Training steps completed."""
        self.samples: collections.deque[AccessSample] = collections.deque(maxlen=max_samples)
        self.record_samples = True

    def on_tier_change(self, tier: str, delta: int, used_after: int) -> None:
        """Observer of every tier: keep an independent running count and high-water mark."""
        used = self.used.get(tier, 0) + delta
        self.used[tier] = used
        self.peak[tier] = max(self.peak.get(tier, 0), used)
        if tier == "device":
            self.current.device_peak = max(self.current.device_peak, used)

    def moved(self, direction: str, nbytes: int) -> None:
        """Count a transfer."""
        self.current.bytes_moved[direction] += int(nbytes)

    def access(self, chunk: int, device_used: int, device_limit: int) -> None:
        """Record the device tier at a chunk access."""
        if self.record_samples:
            self.samples.append(AccessSample(self.step_index + 1, chunk, device_used, device_limit))

    def end_setup(self) -> None:
        """The model is in its tiers: training step 1 begins."""
        self.current = StepTraffic(device_peak=self.used.get("device", 0))

    def end_step(self) -> None:
        """Close the step's record and open the next."""
        self.steps.append(self.current)
        self.step_index += 1
        self.current = StepTraffic(device_peak=self.used.get("device", 0))


SWEEP_INTERVAL = 16
"""Operators between two checks for freed storages. Between checks the count may include storages already
freed, so the recorded peaks err high (the safe side for a budget) by at most what 16 operators free."""


class _LiveBytesMode(TorchDispatchMode):
    """Counts the bytes of live storages created by operators, skipping the ones ``is_model`` claims."""

    def __init__(self, is_model: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.is_model = is_model
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.interval_peak = 0
        self.counting = False
        self.suspended = 0
        self._since_sweep = 0

    def sweep(self) -> None:
        """Forget the storages freed since the last sweep."""
        self._since_sweep = 0
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.counting or self.suspended:
            return out
        self._since_sweep += 1
        if self._since_sweep >= SWEEP_INTERVAL:
            self.sweep()
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or self.is_model(tensor):
                continue
            if key in self.live:
                if not self.live[key][0].expired():
                    continue
                self.current -= self.live.pop(key)[1]  # a freed storage's address, reused
            self.live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.current += storage.nbytes()
        self.interval_peak = max(self.interval_peak, self.current)
        return out


class NonModelMemory:
    """Measures non-model memory during a warm-up step; see the module docstring.

    Counting runs from `start` (the model's forward begins) to `pause` (its backward ends; callable from the
    autograd engine) and resumes at the next `start`; `stop` ends it (from the thread that started it).

    Args:
        device: the compute device.
        is_model: whether a tensor's storage is chunk data (CPU only; on CUDA the arena's bytes are subtracted).
        model_bytes: the bytes of chunk data on the device now (CUDA: subtracted from the allocator's figure).
    """

    def __init__(
        self, device: torch.device, *, is_model: Callable[[torch.Tensor], bool], model_bytes: Callable[[], int]
    ) -> None:
        self.device = device
        self.model_bytes = model_bytes
        self._mode = _LiveBytesMode(is_model) if device.type != "cuda" else None
        self._entered = False
        self.active = False
        self.peak = 0

    def start(self) -> None:
        """Count from now (the model's forward begins)."""
        if self.active:
            return
        self.active = True
        if self._mode is None:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if not self._entered:
            self._mode.__enter__()
            self._entered = True
        self._mode.sweep()
        self._mode.counting = True

    def pause(self) -> None:
        """Stop counting until the next `start` (a backward ended)."""
        self.active = False
        if self._mode is not None:
            self._mode.counting = False

    def stop(self) -> None:
        """Stop counting for good (the warm-up's optimizer step)."""
        self.pause()
        if self._mode is not None and self._entered:
            self._mode.__exit__(None, None, None)
            self._entered = False

    @contextlib.contextmanager
    def suspended(self):
        """Do not count what the memory manager itself allocates inside the block."""
        if self._mode is None or not self.active:
            yield
            return
        self._mode.suspended += 1
        try:
            yield
        finally:
            self._mode.suspended -= 1

    def sample(self) -> int:
        """The peak non-model bytes since the previous sample (or the start), then start a new interval."""
        if not self.active:
            return 0
        if self._mode is not None:
            peak = self._mode.interval_peak
            self._mode.sweep()
            value = max(peak, self._mode.current)
            self._mode.interval_peak = self._mode.current
        else:
            value = max(0, torch.cuda.max_memory_allocated(self.device) - self.model_bytes())
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = max(self.peak, value)
        return value
