"""Each autograd communication step: its forward and its gradient equal the single-process computation on the
gathered tensors, and it runs exactly the collectives its docstring names (one in forward, one in backward).

The reference for a step is the total loss ``sum over ranks r of (y_r * w_r).sum()`` with a different weight
``w_r`` per rank where the output is sharded (each rank's output is a different part of the computation), and
the same weight on every rank where the output is replicated (after `all_reduce_copy` and `all_gather_split`,
every rank computes the same thing, which counts once); the gradients are computed by hand. Values are small integers
in float64, so every sum is exact and the comparisons are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import (
    all_gather_reduce_scatter,
    all_gather_split,
    all_reduce_copy,
    all_to_all_resplit,
    copy_all_reduce,
    reduce_scatter_all_gather,
    split_all_gather,
)


def _values(shape, seed):
    return torch.randint(-5, 6, shape, generator=torch.Generator().manual_seed(seed)).double()


def _apply(op, x, w, **kwargs):
    """y = op(x), backward of (y * w).sum(); returns y, x.grad and the collectives of forward and backward."""
    x = x.clone().requires_grad_(True)
    with CommTracker() as forward:
        y = op(x, **kwargs)
    with CommTracker() as backward:
        (y * w).sum().backward()
    calls = lambda tracker: [(r.op, r.axis) for r in tracker.records]  # noqa: E731
    return y.detach(), x.grad, calls(forward), calls(backward)


def _steps():
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(tp=n)
    group = mesh.group("tp")
    w = [_values((4, 8), 100 + k) for k in range(n)]  # w[k]: rank k's weight on its output
    x = [_values((4, 8), k) for k in range(n)]  # x[k]: rank k's input
    out = {}

    # copy / all-reduce: y = x (replicated); dL/dx = sum_k w_k
    out["copy_all_reduce"] = (_apply(copy_all_reduce, x[0], w[r], group=group), (x[0], sum(w)))
    # all-reduce / copy: y = sum_k x_k, replicated, so it counts once: dL/dx_r = w
    out["all_reduce_copy"] = (_apply(all_reduce_copy, x[r], w[0], group=group), (sum(x), w[0]))

    # split / all-gather along dim 1 (8 columns): y_r = x[:, chunk r]; dL/dx = concat of the w_k chunks
    chunks = lambda t, dim: list(t.chunk(n, dim=dim))  # noqa: E731
    w_split = [chunks(w[k], 1)[k] for k in range(n)]
    out["split_all_gather"] = (
        _apply(split_all_gather, x[0], w_split[r], group=group, dim=1),
        (chunks(x[0], 1)[r], torch.cat(w_split, dim=1)),
    )
    # all-gather / split along dim 0: y = concat_k x_k, replicated, so it counts once: dL/dx_r = rows r of w'
    wide = [_values((4 * n, 8), 200 + k) for k in range(n)]
    out["all_gather_split"] = (
        _apply(all_gather_split, x[r], wide[0], group=group, dim=0),
        (torch.cat(x), chunks(wide[0], 0)[r]),
    )
    # all-gather / reduce-scatter: same forward; the backward sums the ranks' gradients and scatters them
    out["all_gather_reduce_scatter"] = (
        _apply(all_gather_reduce_scatter, x[r], wide[r], group=group, dim=0),
        (torch.cat(x), chunks(sum(wide), 0)[r]),
    )
    # reduce-scatter / all-gather along dim 0 of (4n, 8) inputs: y_r = rows r of sum_k x'_k; dL/dx' = concat w_k
    tall = [_values((4 * n, 8), 300 + k) for k in range(n)]
    out["reduce_scatter_all_gather"] = (
        _apply(reduce_scatter_all_gather, tall[r], w[r], group=group, dim=0),
        (chunks(sum(tall), 0)[r], torch.cat(w)),
    )
    # all-to-all: rank r holds rows r of X = concat_k x_k (sharded on dim 0) and ends with columns r of X
    X = torch.cat(x)
    w_cols = [_values((4 * n, 8 // n), 400 + k) for k in range(n)]
    out["all_to_all_resplit"] = (
        _apply(all_to_all_resplit, x[r], w_cols[r], group=group, scatter_dim=1, gather_dim=0),
        (chunks(X, 1)[r], chunks(torch.cat(w_cols, dim=1), 0)[r]),
    )

    errors = {}
    for name, call in {
        "group": lambda: copy_all_reduce(x[0], group="tp"),
        "divisible": lambda: reduce_scatter_all_gather(torch.ones(n + 1, 2), group=group, dim=0),
        "same_dims": lambda: all_to_all_resplit(torch.ones(4, 4), group=group, scatter_dim=1, gather_dim=-1),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as error:
            errors[name] = str(error)
    out["errors"] = errors
    return out


COLLECTIVES = {  # forward, backward
    "copy_all_reduce": ([], ["all_reduce"]),
    "all_reduce_copy": (["all_reduce"], []),
    "split_all_gather": ([], ["all_gather"]),
    "all_gather_split": (["all_gather"], []),
    "all_gather_reduce_scatter": (["all_gather"], ["reduce_scatter"]),
    "reduce_scatter_all_gather": (["reduce_scatter"], ["all_gather"]),
    "all_to_all_resplit": (["all_to_all"], ["all_to_all"]),
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_step_equals_the_local_computation_forward_and_backward(world_size):
    for result in run_distributed(_steps, world_size=world_size):
        for name, (forward_ops, backward_ops) in COLLECTIVES.items():
            (y, grad, forward, backward), (expected_y, expected_grad) = result[name]
            torch.testing.assert_close(y, expected_y, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0, msg=name)
            assert forward == [(op, "tp") for op in forward_ops], name
            assert backward == [(op, "tp") for op in backward_ops], name
        errors = result["errors"]
        assert "group must be a colo.comm.Group, e.g. mesh.group('tp')" in errors["group"]
        assert f"does not divide by the 'tp' group size {world_size}; pad that dimension" in errors["divisible"]
        assert "scatter_dim and gather_dim are both 1; they must differ" in errors["same_dims"]


def _uneven_split():
    mesh = Mesh(tp=4)
    group = mesh.group("tp")
    r = mesh.rank("tp")
    x = torch.arange(10.0).view(1, 10).repeat(2, 1)  # 10 columns over 4 ranks: [3, 3, 3, 1]
    a = split_all_gather(x.clone().requires_grad_(True), group=group, dim=-1)
    sizes = [3, 3, 3, 1]
    piece = torch.arange(10.0)[sum(sizes[:r]) : sum(sizes[: r + 1])].view(1, -1).repeat(2, 1)
    b = all_gather_split(piece.clone().requires_grad_(True), group=group, dim=-1, sizes=sizes)
    return a.detach(), b.detach()


def test_split_and_gather_follow_torch_chunk_for_uneven_dims():
    x = torch.arange(10.0).view(1, 10).repeat(2, 1)
    for rank, (split, gathered) in enumerate(run_distributed(_uneven_split, world_size=4)):
        torch.testing.assert_close(split, x.chunk(4, dim=-1)[rank], rtol=0, atol=0)
        torch.testing.assert_close(gathered, x, rtol=0, atol=0)
