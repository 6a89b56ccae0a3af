"""`CommTracker`: counts calls and bytes of every colo collective, per op and per mesh axis.

Two volumes are kept per call. ``bytes`` is the logical collective's formula volume per rank, the "bus bytes"
of nccl-tests: what a bandwidth-optimal ring moves through each rank's link. ``impl_bytes`` is the same
formula applied to the implementation colo actually ran (an all-reduce standing in for a reduce-scatter moves
twice as much; a padded uneven all-gather moves the padding too). Tests assert the first against the formulas
of ZeRO, TP and pipelines; benchmarks read the second.

Formulas, for a group of ``n`` ranks and a buffer of ``S`` bytes:

=================  ===============================================  =========================
op                 bytes per rank                                   ``S`` is
=================  ===============================================  =========================
all_reduce         ``2 (n - 1) / n * S``                            the buffer
all_gather         ``S - own`` (``(n - 1) / n * S`` when even)      the gathered output
reduce_scatter     ``(n - 1) / n * S``                              the full input
all_to_all         ``S - own`` (``(n - 1) / n * S`` when even)      the input
broadcast          ``S``                                            the buffer
send / recv        ``S``                                            the message
object ops         ``S``                                            the pickled object(s)
barrier            ``0``                                            --
=================  ===============================================  =========================

On a group of one rank every op records 0 bytes under the algorithm ``"local"``: nothing leaves the rank (the
formulas give 0 for n = 1, and broadcast's ``S`` counts bytes sent to other ranks, of which there are none).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

_active: list[CommTracker] = []
_lock = threading.Lock()


@dataclass(frozen=True)
class CommRecord:
    """One communication call as the tracker saw it.

    Attributes:
        op: logical collective (``"all_reduce"``, ``"all_gather"``, ``"send"``, ...).
        axis: the group's name (mesh axis such as ``"tp"``, fused ``"dp+sp"``, ``"world"`` or ``"custom"``).
        group_size: ranks in the group.
        dtype: element type, as a string (``"torch.float32"``; ``"object"`` for object collectives).
        bytes: formula volume of the logical collective, per rank.
        impl_bytes: formula volume of the implementation that ran, per rank.
        algorithm: the implementation that ran (``"native"``, ``"all_reduce"``, ``"padded"``, ...).
    """

    op: str
    axis: str
    group_size: int
    dtype: str
    bytes: float
    impl_bytes: float
    algorithm: str


class CommTracker:
    """Context manager recording every colo communication call made inside it, on this rank.

    Trackers nest: every active tracker records each call. Example::

        with CommTracker() as tracker:
            all_reduce(grad, group=mesh.group("dp"))
        assert tracker.bytes("all_reduce", axis="dp") == 2 * (n - 1) / n * grad.numel() * grad.element_size()
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommTracker:
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        with _lock:
            if self in _active:
                _active.remove(self)

    def _select(self, op: str | None, axis: str | None) -> list[CommRecord]:
        return [r for r in self.records if (op is None or r.op == op) and (axis is None or r.axis == axis)]

    def bytes(self, op: str | None = None, *, axis: str | None = None) -> float:
        """Formula volume per rank of the logical collectives matching ``op`` and ``axis`` (``None``: any)."""
        return sum(r.bytes for r in self._select(op, axis))

    def impl_bytes(self, op: str | None = None, *, axis: str | None = None) -> float:
        """Formula volume per rank of the implementations that ran, for calls matching ``op`` and ``axis``."""
        return sum(r.impl_bytes for r in self._select(op, axis))

    def calls(self, op: str | None = None, *, axis: str | None = None) -> int:
        """Number of calls matching ``op`` and ``axis`` (``None``: any)."""
        return len(self._select(op, axis))

    def algorithms(self, op: str | None = None, *, axis: str | None = None) -> dict[str, int]:
        """How often each implementation ran, for calls matching ``op`` and ``axis``."""
        counts: dict[str, int] = defaultdict(int)
        for record in self._select(op, axis):
            counts[record.algorithm] += 1
        return dict(counts)

    def reset(self) -> None:
        """Drop everything recorded so far."""
        self.records.clear()

    def summary(self) -> str:
        """A table of calls and volumes per (op, axis)."""
        rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for record in self.records:
            row = rows[(record.op, record.axis)]
            row[0] += 1
            row[1] += record.bytes
            row[2] += record.impl_bytes
        lines = [f"{'op':<16}{'axis':<10}{'calls':>8}{'bytes':>16}{'impl bytes':>16}"]
        for (op, axis), (calls, volume, impl) in sorted(rows.items()):
            lines.append(f"{op:<16}{axis:<10}{calls:>8}{volume:>16.0f}{impl:>16.0f}")
        return "\n".join(lines)


def record(
    op: str, axis: str, group_size: int, dtype: object, volume: float, impl_volume: float, algorithm: str
) -> None:
    """Add one call to every active tracker (a no-op when none is active)."""
    if not _active:
        return
    entry = CommRecord(op, axis, group_size, str(dtype), float(volume), float(impl_volume), algorithm)
    with _lock:
        for tracker in _active:
            tracker.records.append(entry)


def tracking() -> bool:
    """Whether any tracker is active (so callers can skip computing a volume nobody records)."""
    return bool(_active)


def reset_active_trackers() -> None:
    """Deactivate every tracker (the test harness calls this between tests)."""
    with _lock:
        _active.clear()
