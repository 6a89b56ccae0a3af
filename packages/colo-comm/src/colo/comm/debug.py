"""Checks that ranks which must agree do agree: the one debug setting of colo, and the small exchanges behind it.

``COLO_DEBUG_CHECKS=1`` (read here, by `debug_checks`, and nowhere else) turns on checks that cost a small exchange
per call, as ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for torch:

- every colo collective first exchanges its op, shapes and dtype over the group and raises on every rank, naming
  the op, the group (axis) and each rank's shape, when they differ (without it, gloo aborts rank 0 with SIGABRT
  and NCCL hangs or reads garbage);
- the checks colo runs once anyway run on every call instead: that the ranks of a tensor- or sequence-parallel
  group got the same batch (`colo.apps.Booster.train_step`), the same token ids and the same labels
  (`colo.tensor.VocabParallelEmbedding`, the vocabulary-parallel cross-entropy), and that these lie in the
  vocabulary.

The exchanges go straight to ``torch.distributed``: a `CommTracker` does not count them, so the communication
volumes asserted against formulas stay the same with the checks on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .group import Group
from .handle import translate_errors

DEBUG_CHECKS_ENV = "COLO_DEBUG_CHECKS"
"""The environment variable that turns the per-call checks on (``1``, ``true``, ``yes`` or ``on``)."""

_OFF = ("", "0", "false", "no", "off")

# an odd 64-bit multiplier (the golden ratio's, as a signed int64): position i of a tensor weighs (i * K) | 1
_POSITION_MULTIPLIER = 0x9E3779B97F4A7C15 - 2**64
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def debug_checks() -> bool:
    """Whether ``COLO_DEBUG_CHECKS`` asks for the per-call checks (read on every call, so it can change at run time)."""
    return os.environ.get(DEBUG_CHECKS_ENV, "").strip().lower() not in _OFF


@contextlib.contextmanager
def debug_checks_enabled(enabled: bool = True) -> Iterator[None]:
    """Turn the per-call checks on (or off) inside the block, by setting ``COLO_DEBUG_CHECKS`` in this process."""
    before = os.environ.get(DEBUG_CHECKS_ENV)
    os.environ[DEBUG_CHECKS_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DEBUG_CHECKS_ENV, None)
        else:
            os.environ[DEBUG_CHECKS_ENV] = before


def fingerprint(tensor: torch.Tensor) -> int:
    """A 64-bit hash of ``tensor``'s values in order (its bits, for floats), computed where it lives.

    ``sum_i bits_i * ((i * K) | 1)`` in wrapping int64 arithmetic: exact, so equal tensors give equal numbers on
    every rank, and two tensors differing in one element never collide. Shape and dtype are not part of it.
    """
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view(_BITS_OF_SIZE[min(flat.element_size(), 8)])
    values = flat.to(torch.int64)
    weights = torch.arange(values.numel(), dtype=torch.int64, device=values.device).mul_(_POSITION_MULTIPLIER)
    return int((values * weights.bitwise_or_(1)).sum())  # not in place: ``values`` may be ``tensor`` itself


def exchange(obj: Any, group: Group, what: str = "debug check") -> list[Any]:
    """Every rank's ``obj`` (small and picklable), in group-rank order, on every rank of ``group``; not counted by
    a `CommTracker`. ``what`` names the exchange in a `CommError` if a peer fails."""
    if group.size == 1:
        return [obj]
    gathered: list[Any] = [None] * group.size
    with translate_errors(what, group):
        dist.all_gather_object(gathered, obj, group=group.process_group)
    return gathered


def disagreement(values: Sequence[Any], group: Group) -> str | None:
    """``None`` when every rank's value is equal, else which (global) ranks hold which:
    ``"ranks [0, 2] hold one value, ranks [1, 3] another"``."""
    classes: list[tuple[Any, list[int]]] = []
    for group_rank, value in enumerate(values):
        for seen, ranks in classes:
            if seen == value:
                ranks.append(group.ranks[group_rank])
                break
        else:
            classes.append((value, [group.ranks[group_rank]]))
    if len(classes) == 1:
        return None
    names = ["one value"] + ["another"] * (len(classes) - 1)
    return ", ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {ranks[0] if len(ranks) == 1 else ranks} "
        f"{'holds' if len(ranks) == 1 else 'hold'} {name}"
        for (_, ranks), name in zip(classes, names)
    )
