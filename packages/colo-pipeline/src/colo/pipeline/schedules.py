"""Schedule generators: `gpipe`, `one_f_one_b`, `interleaved_1f1b` and `zero_bubble_h1`.

Each generator decides only the order of the compute actions on every rank; `with_communication` then inserts
the sends and receives the same way for all of them, placing each message where both of its ranks are between
compute actions at the same moment (the 1F1B steady state's "send forward, receive backward" pairs), so that
blocking p2p costs no waiting. Receives in a batch are ordered like the matching sends on the peer.

A new schedule is a new generator of compute orders, nothing else.
"""

from __future__ import annotations

from ._placement import with_communication
from .actions import BW, Action, B, F, Schedule, W


class MicrobatchCountError(ValueError):
    """``num_microbatches`` does not fit the schedule: fewer than the pipeline's ranks (1F1B, zero-bubble), or not a
    multiple of them (interleaved 1F1B). A config that sets the count elsewhere can tell this apart from other
    errors by its type."""


def _check_common(name: str, num_ranks: int, num_microbatches: int) -> None:
    for field, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {field}={value!r} must be a positive int")


def _require_enough_microbatches(name: str, num_ranks: int, num_microbatches: int) -> None:
    if num_microbatches < num_ranks:
        raise MicrobatchCountError(
            f"{name}: num_microbatches={num_microbatches} is smaller than the pipeline size num_ranks={num_ranks}; "
            f"use num_microbatches >= {num_ranks} (more microbatches also shrink the bubble), or gpipe"
        )


def loop_placement(num_ranks: int, num_chunks: int) -> tuple[tuple[int, ...], ...]:
    """Stage of each (rank, chunk) when chunks loop around the ranks: chunk ``c`` of rank ``r`` is stage ``c*p + r``."""
    return tuple(tuple(chunk * num_ranks + rank for chunk in range(num_chunks)) for rank in range(num_ranks))


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards.

    Peak live activations: every microbatch on every stage.

    Args:
        num_ranks: pipeline ranks (one stage each).
        num_microbatches: microbatches per step (any number >= 1).
    """
    _check_common("gpipe", num_ranks, num_microbatches)
    compute = [
        [F(mb) for mb in range(num_microbatches)] + [BW(mb) for mb in range(num_microbatches)] for _ in range(num_ranks)
    ]
    return with_communication(
        "gpipe", num_microbatches=num_microbatches, stages=loop_placement(num_ranks, 1), compute=compute
    )


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): warm-up forwards, then one forward / one backward.

    Rank ``r`` runs ``num_ranks - 1 - r`` warm-up forwards, so at most ``num_ranks - r`` microbatches are live
    on it; the bubble is ``(p - 1) / (m + p - 1)`` of the step for equal stage costs.

    Args:
        num_ranks: pipeline ranks (one stage each).
        num_microbatches: microbatches per step, at least ``num_ranks``.
    """
    _check_common("one_f_one_b", num_ranks, num_microbatches)
    _require_enough_microbatches("one_f_one_b", num_ranks, num_microbatches)
    compute = []
    for rank in range(num_ranks):
        warmup = num_ranks - 1 - rank
        order = [F(mb) for mb in range(warmup)]
        for mb in range(num_microbatches - warmup):
            order += [F(mb + warmup), BW(mb)]
        order += [BW(mb) for mb in range(num_microbatches - warmup, num_microbatches)]
        compute.append(order)
    return with_communication(
        "1f1b", num_microbatches=num_microbatches, stages=loop_placement(num_ranks, 1), compute=compute
    )


def interleaved_1f1b(num_ranks: int, num_microbatches: int, *, num_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): each rank holds ``num_chunks`` model chunks, looped over ranks.

    Chunk ``c`` of rank ``r`` is stage ``c * p + r``. Microbatches go through the chunks in groups of ``p``;
    rank ``r`` runs ``2 (p - 1 - r) + (v - 1) p`` warm-up forwards. The bubble shrinks to
    ``(p - 1) / (v m + p - 1)`` of the step for equal stage costs.

    Args:
        num_ranks: pipeline ranks.
        num_microbatches: microbatches per step, a multiple of ``num_ranks``.
        num_chunks: model chunks per rank (``v``), at least 1.
    """
    _check_common("interleaved_1f1b", num_ranks, num_microbatches)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"interleaved_1f1b: num_chunks={num_chunks!r} must be a positive int (2 is typical)")
    if num_microbatches % num_ranks:
        raise MicrobatchCountError(
            f"interleaved_1f1b: num_microbatches={num_microbatches} is not a multiple of num_ranks={num_ranks}; "
            f"microbatches go through the chunks in groups of {num_ranks}: use "
            f"num_microbatches={num_microbatches + num_ranks - num_microbatches % num_ranks}"
        )
    p, v, m = num_ranks, num_chunks, num_microbatches
    total = m * v

    def forward_slot(k: int) -> Action:
        return F((k // (p * v)) * p + k % p, (k // p) % v)

    def backward_slot(k: int) -> Action:
        return BW((k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    compute, comm_points = [], []
    for rank in range(p):
        warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
        order = [forward_slot(k) for k in range(warmup)]
        points = list(range(warmup + 1))
        for k in range(total - warmup):
            order += [forward_slot(warmup + k), backward_slot(k)]
            points.append(len(order))
        for k in range(total - warmup, total):
            order.append(backward_slot(k))
            points.append(len(order))
        compute.append(order)
        comm_points.append(points)
    return with_communication(
        f"interleaved_1f1b(v={v})",
        num_microbatches=m,
        stages=loop_placement(p, v),
        compute=compute,
        comm_points=comm_points,
    )


def zero_bubble_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): split backward, weights deferred into bubbles.

    The backward is split into ``B`` (input gradient, on the critical path) and ``W`` (weight gradient, off it).
    Rank ``r`` runs ``p - r`` warm-up forwards, then ``B``/``F`` pairs with each ``W`` deferred by ``r``
    microbatches, then ``B``/``W``/``F`` triples, then drains the deferred ``W``s, which fill the cool-down
    bubble. Every rank holds at most ``p`` live microbatches, 1F1B's peak (on its first rank). With equal
    ``F``, ``B`` and ``W`` times the idle time is a third of 1F1B's: ``(p - 1)`` units against ``3 (p - 1)``.

    Args:
        num_ranks: pipeline ranks (one stage each).
        num_microbatches: microbatches per step, at least ``num_ranks``.
    """
    _check_common("zero_bubble_h1", num_ranks, num_microbatches)
    _require_enough_microbatches("zero_bubble_h1", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    compute = []
    for rank in range(p):
        order = [F(mb) for mb in range(p - rank)]
        next_forward, next_weight = p - rank, 0
        for mb in range(m):
            order.append(B(mb))
            if mb >= rank:
                order.append(W(next_weight))
                next_weight += 1
            if next_forward < m:
                order.append(F(next_forward))
                next_forward += 1
        order += [W(mb) for mb in range(next_weight, m)]
        compute.append(order)
    return with_communication("zero_bubble_h1", num_microbatches=m, stages=loop_placement(p, 1), compute=compute)


GENERATORS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble_h1": zero_bubble_h1,
}
"""Schedule generators by name (the names a config uses)."""


def make_schedule(name: str, num_ranks: int, num_microbatches: int, *, num_chunks: int = 2) -> Schedule:
    """The schedule ``name`` (a key of `GENERATORS`); ``num_chunks`` applies to interleaved schedules only."""
    if name not in GENERATORS:
        raise ValueError(f"schedule={name!r} is unknown; use one of {sorted(GENERATORS)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, num_chunks=num_chunks)
    return GENERATORS[name](num_ranks, num_microbatches)
