"""`StepTimer`: per-rank wall time of a step's phases (forward, backward, optimizer step, communication wait), and
`phase`, the one context the Booster's step runners open around each phase.

Off by default: an engine without a timer opens only `colo.comm.regions.region` (a no-op unless a torch profiler
records), so a run without timing executes no timing code. With one (`Booster.set_step_timer`), every phase adds
its wall time to the timer's sums; on CUDA the device is synchronized at both ends of a phase so kernels count in
the phase that launched them (this serializes the GPU with the host: timing is for finding a slow rank, and costs
some throughput while on).

What counts as what: ``forward`` the model's forward and loss, ``backward`` the backward (with the gradient
communication it overlaps: DDP's buckets, ZeRO's reduce-scatters issued from hooks), ``optimizer`` the engine's
step (the waits for the last gradient reductions, clipping, the update, zeroing), ``comm_wait`` the step's
synchronization points: the all-reduces of the loss (and of the token counts) across the data ranks, where a
fast rank waits for a slow one, and a pipeline's blocking receives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from colo.comm.regions import region

PHASES = ("forward", "backward", "optimizer", "comm_wait")
"""The phases a step is timed in."""

DEFAULT_NAMES = {
    "forward": "colo.forward",
    "backward": "colo.backward",
    "optimizer": "colo.optimizer_step",
    "comm_wait": "colo.comm_wait",
}
"""The profiler range of each phase, unless its caller names it."""
_DEFAULT_NAMES = DEFAULT_NAMES


class StepTimer:
    """Sums of wall time per phase on this rank since the last `take`.

    Args:
        device: the compute device; CUDA is synchronized around each phase.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def phase(self, kind: str, name: str | Callable[[], str] | None = None) -> _Timed:
        """A context timing its block as ``kind`` (one of `PHASES`), also a profiler range named ``name``
        (default `DEFAULT_NAMES`)."""
        return _Timed(self, kind, name or _DEFAULT_NAMES[kind])

    def take(self) -> dict[str, float]:
        """The sums since the last call (``{"forward_s": ..., "backward_s": ..., "optimizer_s": ...,
        "comm_wait_s": ...}``), resetting them."""
        taken = {f"{kind}_s": seconds for kind, seconds in self.seconds.items()}
        self.seconds = dict.fromkeys(PHASES, 0.0)
        return taken

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _Timed:
    __slots__ = ("timer", "kind", "name", "region", "start")

    def __init__(self, timer: StepTimer, kind: str, name) -> None:
        self.timer, self.kind, self.name = timer, kind, name

    def __enter__(self) -> None:
        self.region = region(self.name)
        self.region.__enter__()
        self.timer._synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc_info) -> bool:
        self.timer._synchronize()
        self.timer.seconds[self.kind] += time.perf_counter() - self.start
        self.region.__exit__(*exc_info)
        return False


def phase(timer: StepTimer | None, kind: str, name: str | Callable[[], str] | None = None):
    """The context of one phase of a step: timed by ``timer`` when there is one, else only a profiler range
    (``name``, default `DEFAULT_NAMES`) that exists while a profiler records."""
    if timer is None:
        return region(name or _DEFAULT_NAMES[kind])
    return timer.phase(kind, name)
