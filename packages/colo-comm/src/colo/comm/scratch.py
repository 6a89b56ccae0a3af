"""Receive buffers of the exchange forms of reduce_scatter, kept for reuse between calls.

The all-to-all and p2p forms of `colo.comm.reduce_scatter` receive the other ranks' copies of this rank's part
into a buffer of their own, reduce them into the result and are done with it. ZeRO reduces a chunk-sized bucket
several times a step, and a fresh buffer each time costs page faults and zero fills that measured as much as the
bytes saved (see `colo.comm.algorithms`), so the buffers are kept: the buffer is private to one call (never
returned, only read by the local reduction after the exchange has completed), so it can be reused as soon as that
reduction is done.
"""

from __future__ import annotations

import torch

MAX_FREE_PER_SIZE = 4
"""Free buffers kept per ``(numel, dtype, device)``; more are freed."""

_free: dict[tuple, list[torch.Tensor]] = {}


def take(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of ``numel`` elements with undefined contents, reused when one is free."""
    free = _free.get((numel, dtype, torch.device(device)))
    return free.pop() if free else torch.empty(numel, dtype=dtype, device=device)


def give(buffer: torch.Tensor) -> None:
    """Return a buffer from `take` whose contents nobody reads any more."""
    free = _free.setdefault((buffer.numel(), buffer.dtype, buffer.device), [])
    if len(free) < MAX_FREE_PER_SIZE:
        free.append(buffer)


def held_bytes() -> int:
    """Bytes of the free buffers kept."""
    return sum(b.numel() * b.element_size() for buffers in _free.values() for b in buffers)


def release_scratch() -> None:
    """Free every kept buffer."""
    _free.clear()
