"""Stage partitioning of a model given as a sequence of blocks: uniform, by parameter count, or by measured time.

Each function returns one ``range`` of block indices per stage (contiguous, in order, none empty); the first
stage may additionally hold an embedding (``first``) and the last a head (``last``), whose cost counts
towards their stage. `build_stages` turns the ranges into one ``nn.Sequential`` per stage. With an
interleaved schedule, partition into ``num_ranks * num_chunks`` stages and give rank ``r`` the stages of
``schedule.stages[r]``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def _check(num_blocks: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be at least 1")
    if num_blocks < num_stages:
        raise ValueError(
            f"cannot split {num_blocks} blocks into num_stages={num_stages} non-empty stages; "
            f"use num_stages <= {num_blocks} or split the model into more blocks"
        )


def partition_uniform(num_blocks: int, num_stages: int) -> list[range]:
    """Equal numbers of blocks per stage (the first ``num_blocks % num_stages`` stages get one more)."""
    _check(num_blocks, num_stages)
    base, extra = divmod(num_blocks, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def partition_balanced(
    costs: Sequence[float], num_stages: int, *, first_cost: float = 0.0, last_cost: float = 0.0
) -> list[range]:
    """Contiguous stages minimising the largest stage cost (exact, by dynamic programming).

    Args:
        costs: one non-negative cost per block (parameters, seconds, ...).
        num_stages: number of stages.
        first_cost: extra cost on the first stage (an embedding it also holds).
        last_cost: extra cost on the last stage (a head it also holds).

    Returns:
        One range of block indices per stage.
    """
    n = len(costs)
    _check(n, num_stages)
    if any(c < 0 for c in costs):
        raise ValueError("partition_balanced: costs must be non-negative")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (first_cost if stage == 0 else 0.0) + (last_cost if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[k][i]: smallest max cost splitting blocks[:i] into stages 0..k-1; cut[k][i]: start of stage k-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], stage_cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def _num_params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def partition_by_parameters(
    blocks: Sequence[nn.Module], num_stages: int, *, first: nn.Module | None = None, last: nn.Module | None = None
) -> list[range]:
    """Stages balanced by parameter count (a proxy for memory), embedding and head included."""
    return partition_balanced(
        [_num_params(b) for b in blocks], num_stages, first_cost=_num_params(first), last_cost=_num_params(last)
    )


def _time_call(fn: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def measure_block_times(
    blocks: Sequence[nn.Module],
    sample_input: Any,
    *,
    first: nn.Module | None = None,
    last: nn.Module | None = None,
    repeats: int = 3,
) -> tuple[list[float], float, float]:
    """Median forward + backward seconds of each block on ``sample_input`` (and of ``first`` and ``last``).

    The sample goes through ``first``, the blocks and ``last`` in order; each module is timed on the previous
    one's output (detached), backward from the sum of its output.

    Returns:
        ``(block_times, first_time, last_time)``; the two are 0 when the module is not given.
    """

    def timed(module: nn.Module, value: Any) -> tuple[float, Any]:
        x = value.detach().requires_grad_(value.is_floating_point()) if isinstance(value, torch.Tensor) else value

        def run() -> Any:
            out = module(x)
            target = out[0] if isinstance(out, (tuple, list)) else out
            if target.requires_grad:
                target.float().sum().backward()
            return out

        run()  # warm-up
        seconds = _time_call(run, repeats)
        with torch.no_grad():
            return seconds, module(x)

    value, first_time, last_time = sample_input, 0.0, 0.0
    if first is not None:
        first_time, value = timed(first, value)
    times = []
    for block in blocks:
        seconds, value = timed(block, value)
        times.append(seconds)
    if last is not None:
        last_time, _ = timed(last, value)
    for module in [first, *blocks, last]:
        if module is not None:
            module.zero_grad(set_to_none=True)
    return times, first_time, last_time


def partition_by_time(
    blocks: Sequence[nn.Module],
    num_stages: int,
    *,
    sample_input: Any,
    first: nn.Module | None = None,
    last: nn.Module | None = None,
    repeats: int = 3,
) -> list[range]:
    """Stages balanced by measured forward + backward time of each block on ``sample_input``."""
    times, first_time, last_time = measure_block_times(blocks, sample_input, first=first, last=last, repeats=repeats)
    return partition_balanced(times, num_stages, first_cost=first_time, last_cost=last_time)


def build_stages(
    blocks: Sequence[nn.Module],
    ranges: Sequence[range],
    *,
    first: nn.Module | None = None,
    last: nn.Module | None = None,
) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per stage: ``first`` + its blocks on stage 0, its blocks + ``last`` on the last."""
    covered = [i for r in ranges for i in r]
    if covered != list(range(len(blocks))):
        raise ValueError(f"ranges {list(ranges)} must cover blocks 0..{len(blocks) - 1} once each, in order")
    stages = []
    for index, block_range in enumerate(ranges):
        modules = [blocks[i] for i in block_range]
        if index == 0 and first is not None:
            modules.insert(0, first)
        if index == len(ranges) - 1 and last is not None:
            modules.append(last)
        stages.append(nn.Sequential(*modules))
    return stages
