"""Every collective is correct on a group of one rank, in every algorithm form and on both sides of 1 MiB.

A one-rank group is common: the dp group of a tp=2 x pp=2 run on 4 ranks, the tp group of Mesh(dp=2, tp=1). On
it a collective is a local copy (or nothing): all_reduce, broadcast and barrier leave the tensor as it is, an
all-gather or a reduce-scatter returns a copy of the input, an all-to-all returns its input's rows. The ranks here
are a 2-rank world, and each one runs the collective on its own single-rank ``tp`` group of Mesh(dp=2, tp=1), so the
other rank never takes part. Nothing moves, so the tracker records a volume of 0 bytes (every formula gives 0 for
n = 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import (
    CommTracker,
    Mesh,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    broadcast_object,
    force_algorithm,
    gather_object,
    reduce_scatter,
)
from colo.comm.testing import run_distributed

SHAPES = {"small": (4, 6), "1MiB": (512, 520)}
"""Below and above 1 MiB in float32: gloo's table switches all_gather and reduce_scatter to p2p from 1 MiB."""

TABLE = "table"
"""Run with the algorithm the table picks for the size (no forcing): the case that crashed the Booster example."""

CASES = [
    ("all_reduce", TABLE),
    ("all_reduce_avg", TABLE),
    ("broadcast", TABLE),
    ("barrier", TABLE),
    *[("all_gather", form) for form in (TABLE, "native", "all_reduce", "p2p")],
    *[("all_gather_out", form) for form in (TABLE, "native", "all_reduce", "p2p")],
    *[("all_gather_in_place", form) for form in (TABLE, "native", "all_reduce", "p2p")],
    *[("all_gather_dim1", form) for form in (TABLE, "native", "all_reduce", "p2p")],
    *[("all_gather_sizes", form) for form in (TABLE, "native", "all_reduce", "p2p")],
    *[("reduce_scatter", form) for form in (TABLE, "native", "all_reduce", "all_to_all", "p2p")],
    *[("reduce_scatter_max_dim1", form) for form in (TABLE, "native", "all_reduce", "all_to_all", "p2p")],
    *[("reduce_scatter_donated", form) for form in (TABLE, "native", "all_reduce", "all_to_all", "p2p")],
    ("all_to_all", TABLE),
    ("all_to_all_splits", TABLE),
    ("objects", TABLE),
]


def _input(shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's input: distinct per rank, so a result that mixed in the other rank's data would show."""
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return torch.randn(shape, generator=generator)


def _run(case: str, shape: tuple[int, ...], async_op: bool, group) -> tuple[object, object]:
    """Run ``case`` on ``group``; return (result, expected)."""
    x = _input(shape)
    original = x.clone()

    def done(value):
        if not async_op:
            return value
        result = value.wait()
        assert value.is_completed(), f"{case}: the handle is not complete after wait()"
        assert value.wait() is result, f"{case}: a second wait() returns another result"
        return result

    if case in ("all_reduce", "all_reduce_avg"):
        result = done(all_reduce(x, "avg" if case == "all_reduce_avg" else "sum", group=group, async_op=async_op))
        assert result is x, "all_reduce works in place and returns its tensor"
        return result, original
    if case == "broadcast":
        result = done(broadcast(x, src=0, group=group, async_op=async_op))
        assert result is x, "broadcast works in place and returns its tensor"
        return result, original
    if case == "barrier":
        barrier(group=group)
        return x, original
    if case == "all_gather":
        result = done(all_gather(x, group=group, async_op=async_op))
        assert result.data_ptr() != x.data_ptr(), "all_gather returns a new tensor, not its input"
        return result, original
    if case == "all_gather_out":
        out = torch.full(shape, -1.0)
        result = done(all_gather(x, group=group, out=out, async_op=async_op))
        assert result is out, "all_gather(out=...) returns out"
        return result, original
    if case == "all_gather_in_place":
        out = x  # this rank's piece is the whole of out
        result = done(all_gather(out, group=group, out=out, async_op=async_op))
        assert result is out
        return result, original
    if case == "all_gather_dim1":
        return done(all_gather(x.t(), group=group, dim=1, async_op=async_op)), original.t()
    if case == "all_gather_sizes":
        result = done(all_gather(x, group=group, dim=1, sizes=[shape[1]], async_op=async_op))
        return result, original
    if case == "reduce_scatter":
        result = done(reduce_scatter(x, "avg", group=group, async_op=async_op))
        assert result.data_ptr() != x.data_ptr(), "without donate, reduce_scatter returns a new tensor"
        return result, original
    if case == "reduce_scatter_max_dim1":
        return done(reduce_scatter(x, "max", group=group, dim=1, async_op=async_op)), original
    if case == "reduce_scatter_donated":
        return done(reduce_scatter(x, group=group, donate=True, async_op=async_op)), original
    if case == "all_to_all":
        return done(all_to_all(x, group=group, async_op=async_op)), original
    if case == "all_to_all_splits":
        result = done(all_to_all(x, group=group, input_split_sizes=[shape[0]], async_op=async_op))
        passed = all_to_all(x, group=group, input_split_sizes=[shape[0]], output_split_sizes=[shape[0]])
        torch.testing.assert_close(passed, original, rtol=0, atol=0)
        return result, original
    if case == "objects":
        value = {"rank": dist.get_rank(), "shape": shape}
        assert broadcast_object(value, src=0, group=group) == value
        assert all_gather_object(value, group=group) == [value]
        assert gather_object(value, dst=0, group=group) == [value]
        return x, original
    raise AssertionError(f"unknown case {case}")


def _on_a_single_rank_group(case: str, algorithm: str, shape: tuple[int, ...], async_op: bool):
    group = Mesh(dp=2, tp=1).group("tp")
    assert group.size == 1 and group.ranks == (dist.get_rank(),)
    op = "reduce_scatter" if case.startswith("reduce_scatter") else "all_gather"
    forced = force_algorithm(op, algorithm) if algorithm != TABLE else None
    with CommTracker() as tracker:
        if forced is not None:
            with forced:
                result, expected = _run(case, shape, async_op, group)
        else:
            result, expected = _run(case, shape, async_op, group)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert tracker.calls() >= 1, f"{case}: the call was not recorded"
    return tracker.bytes(), tracker.impl_bytes()


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("size", list(SHAPES))
@pytest.mark.parametrize(("case", "algorithm"), CASES, ids=[f"{case}-{form}" for case, form in CASES])
def test_a_collective_on_a_one_rank_group_is_a_local_copy(case, algorithm, size, async_op):
    if case in ("barrier", "objects") and async_op:
        pytest.skip("no async form")
    for volume, impl_volume in run_distributed(
        _on_a_single_rank_group, case, algorithm, SHAPES[size], async_op, world_size=2
    ):
        assert volume == 0 and impl_volume == 0, "a one-rank group moves no bytes"
