"""Column- and row-parallel linears equal ``torch.nn.Linear`` on tp=2 and tp=4, forward and backward, with
sharded weights equal to the matching slices of the full weights (Megatron's TP-1 vs TP-n check), and a
Megatron MLP block communicates one all-reduce of b*s*h in forward and one in backward.

Tolerances: float32, rtol=1e-5 and atol=1e-6. A sharded matmul sums over a different split of the reduction
dimension (row parallel: partial sums over each rank's input features, then an all-reduce; the input gradient of
a column-parallel layer: partial sums over output features), so results differ from the unsharded matmul by
rounding; weights and the seeded initialisation are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import ColumnParallelLinear, Replicate, RowParallelLinear, Shard, layout_of

IN, HIDDEN, OUT = 8, 16, 12
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _data(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(module, x, grad_output):
    """Forward ``module(x)`` and backward of ``(y * grad_output).sum()``; the output and the input's gradient."""
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * grad_output).sum().backward()
    return y.detach(), x.grad


def _linears(mesh_shape):
    mesh = Mesh(**mesh_shape)
    n, r = mesh.size("tp"), mesh.rank("tp")
    rows = lambda t, dim=0: t.chunk(n, dim=dim)[r]  # noqa: E731  this rank's slice
    x, g_out, g_in = _data(3, 5, IN, seed=1), _data(3, 5, OUT, seed=2), _data(3, 5, IN, seed=3)
    out = {"pairs": {}, "exact": {}}
    pairs, exact = out["pairs"], out["exact"]

    # Same seed: the layer draws the full weight as nn.Linear does and keeps its slice.
    torch.manual_seed(0)
    reference = nn.Linear(IN, OUT)
    torch.manual_seed(0)
    seeded = ColumnParallelLinear(IN, OUT, mesh=mesh)
    exact["seeded_column"] = (
        seeded.weight,
        rows(reference.weight.detach()),
        seeded.bias,
        rows(reference.bias.detach()),
    )
    torch.manual_seed(0)
    reference_row = nn.Linear(OUT, IN)
    torch.manual_seed(0)
    seeded_row = RowParallelLinear(OUT, IN, mesh=mesh)
    exact["seeded_row"] = (
        seeded_row.weight,
        rows(reference_row.weight.detach(), 1),
        seeded_row.bias,
        reference_row.bias,
    )

    y_ref, x_grad_ref = _run(reference, x, g_out)
    for gather_output in (False, True):
        column = ColumnParallelLinear.from_linear(reference, mesh=mesh, gather_output=gather_output)
        y, x_grad = _run(column, x, g_out if gather_output else rows(g_out, -1))
        name = f"column_gather={gather_output}"
        pairs[f"{name}/y"] = (y, y_ref if gather_output else rows(y_ref, -1))
        pairs[f"{name}/x.grad"] = (x_grad, x_grad_ref)
        pairs[f"{name}/weight.grad"] = (column.weight.grad, rows(reference.weight.grad))
        pairs[f"{name}/bias.grad"] = (column.bias.grad, rows(reference.bias.grad))
        exact[f"{name}/weight"] = (column.weight, rows(reference.weight.detach()))
    reference.zero_grad()

    y_ref, x_grad_ref = _run(reference_row, _data(3, 5, OUT, seed=4), g_in)
    for input_is_parallel in (True, False):
        row = RowParallelLinear.from_linear(reference_row, mesh=mesh, input_is_parallel=input_is_parallel)
        x_row = _data(3, 5, OUT, seed=4)
        y, x_grad = _run(row, rows(x_row, -1) if input_is_parallel else x_row, g_in)
        name = f"row_parallel_input={input_is_parallel}"
        pairs[f"{name}/y"] = (y, y_ref)
        pairs[f"{name}/x.grad"] = (x_grad, rows(x_grad_ref, -1) if input_is_parallel else x_grad_ref)
        pairs[f"{name}/weight.grad"] = (row.weight.grad, rows(reference_row.weight.grad, 1))
        pairs[f"{name}/bias.grad"] = (row.bias.grad, reference_row.bias.grad)
        exact[f"{name}/weight"] = (row.weight, rows(reference_row.weight.detach(), 1))
        exact[f"{name}/bias"] = (row.bias, reference_row.bias.detach())

    out["layouts"] = {
        "column.weight": (layout_of(column.weight).placements, tuple(layout_of(column.weight).global_shape)),
        "column.bias": (layout_of(column.bias).placements, tuple(layout_of(column.bias).global_shape)),
        "row.weight": (layout_of(row.weight).placements, tuple(layout_of(row.weight).global_shape)),
        "row.bias": (layout_of(row.bias).placements, tuple(layout_of(row.bias).global_shape)),
    }
    return out


def _check_linears(results, other_axes):
    for result in results:
        for name, (got, expected) in result["pairs"].items():
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=name)
        for name, tensors in result["exact"].items():
            for got, expected in zip(tensors[::2], tensors[1::2]):
                torch.testing.assert_close(got.detach(), expected.detach(), rtol=0, atol=0, msg=name)
        replicated = (Replicate(),) * other_axes
        assert result["layouts"] == {
            "column.weight": (replicated + (Shard(0),), (OUT, IN)),
            "column.bias": (replicated + (Shard(0),), (OUT,)),
            "row.weight": (replicated + (Shard(1),), (IN, OUT)),
            "row.bias": (replicated + (Replicate(),), (IN,)),
        }


def test_linears_equal_torch_on_tp2():
    _check_linears(run_distributed(_linears, {"tp": 2}, world_size=2), other_axes=0)


def test_linears_equal_torch_on_tp4():
    _check_linears(run_distributed(_linears, {"tp": 4}, world_size=4), other_axes=0)


def test_linears_on_a_2d_mesh_are_replicated_over_the_other_axis():
    _check_linears(run_distributed(_linears, {"dp": 2, "tp": 2}, world_size=4), other_axes=1)


def _mlp_block(batch, seq, hidden):
    mesh = Mesh(tp=2)
    torch.manual_seed(0)
    up, down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
    column = ColumnParallelLinear.from_linear(up, mesh=mesh)
    row = RowParallelLinear.from_linear(down, mesh=mesh)
    x, g = _data(batch, seq, hidden, seed=5), _data(batch, seq, hidden, seed=6)

    x_ref = x.clone().requires_grad_(True)
    y_ref = down(F.gelu(up(x_ref)))
    (y_ref * g).sum().backward()

    x_tp = x.clone().requires_grad_(True)
    with CommTracker() as forward:
        y = row(F.gelu(column(x_tp)))
    with CommTracker() as backward:
        (y * g).sum().backward()
    summary = lambda t: [(r.op, r.axis, r.bytes) for r in t.records]  # noqa: E731
    return {
        "y": (y.detach(), y_ref.detach()),
        "x.grad": (x_tp.grad, x_ref.grad),
        "up.weight.grad": (column.weight.grad, up.weight.grad.chunk(2)[mesh.rank("tp")]),
        "down.weight.grad": (row.weight.grad, down.weight.grad.chunk(2, dim=1)[mesh.rank("tp")]),
        "forward": summary(forward),
        "backward": summary(backward),
    }


def test_mlp_block_communicates_one_all_reduce_each_way():
    batch, seq, hidden, tp = 2, 3, 8, 2
    # Megatron: one all-reduce of the (b, s, h) activation in forward (after the row-parallel linear) and one of
    # its gradient in backward (before the column-parallel linear); ring volume 2 (n-1)/n of b*s*h*4 bytes
    all_reduce = [("all_reduce", "tp", 2 * (tp - 1) / tp * batch * seq * hidden * 4)]
    for result in run_distributed(_mlp_block, batch, seq, hidden, world_size=2):
        assert result["forward"] == all_reduce
        assert result["backward"] == all_reduce
        for name in ("y", "x.grad", "up.weight.grad", "down.weight.grad"):
            torch.testing.assert_close(*result[name], **TOLERANCE, msg=name)


def _layer_errors():
    mesh = Mesh(tp=4)
    errors = {}
    for name, call in {
        "out": lambda: ColumnParallelLinear(8, 10, mesh=mesh),
        "in": lambda: RowParallelLinear(6, 8, mesh=mesh),
        "axis": lambda: ColumnParallelLinear(8, 8, mesh=mesh, axis="mp"),
        "input": lambda: RowParallelLinear(8, 4, mesh=mesh)(torch.ones(2, 8)),
        "from": lambda: ColumnParallelLinear.from_linear(nn.Conv1d(1, 1, 1), mesh=mesh),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as error:
            errors[name] = str(error)
    return errors


def test_layer_errors_say_what_to_change():
    errors = run_distributed(_layer_errors, world_size=4)[0]
    assert "tp=4 does not divide out_features=10; choose tp in [1, 2, 5, 10] or change out_features" in errors["out"]
    assert "tp=4 does not divide in_features=6; choose tp in [1, 2, 3, 6]" in errors["in"]
    assert "the mesh has no axis 'mp'; its axes are ('tp',); pass axis=..." in errors["axis"]
    assert "the input has 8 features but this rank holds 2 of 8" in errors["input"]
    assert "expected a torch.nn.Linear, not Conv1d" in errors["from"]


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_meta_device_builds_without_initialising(cls):
    run_distributed(_meta, cls, world_size=2)


def _meta(cls):
    layer = cls(8, 8, mesh=Mesh(tp=2), device="meta")
    assert layer.weight.is_meta and layout_of(layer.weight) is not None
