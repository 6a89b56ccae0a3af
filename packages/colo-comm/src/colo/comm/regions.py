"""`region`: a named range in a `torch.profiler` trace, in colo's words, that costs nothing when no profiler runs.

colo names what it does so a trace reads like the run: every collective as ``colo.all_reduce[dp] 1.2 MiB`` (op,
the group's axis name, this rank's buffer), the wait for an asynchronous one as ``colo.wait reduce_scatter[dp]``;
colo.pipeline its actions, colo.apps the forward, backward, optimizer step, rollout and checkpoint save. No hook
is registered anywhere: a region exists only inside the call that opens it, and only while a profiler records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

_NO_REGION = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a torch profiler records on this thread now (one C call)."""
    return torch.autograd._profiler_enabled()


def region(name: str | Callable[[], str]):
    """A context that marks its block as a range named ``name`` in the running torch profiler's trace.

    Args:
        name: the range's name, or a function returning it (called only while a profiler records, so a name that
            formats sizes costs nothing otherwise).

    Returns:
        A `torch.profiler.record_function` while a profiler records, else a shared no-op context.
    """
    if not torch.autograd._profiler_enabled():
        return _NO_REGION
    return torch.profiler.record_function(name() if callable(name) else name)


def size_text(nbytes: float) -> str:
    """``1258291 -> '1.2 MiB'``: a buffer's size in a region's name."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"
