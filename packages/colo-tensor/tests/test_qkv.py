"""The fused column-parallel q/k/v projection with grouped-query attention equals the unsharded ``nn.Linear`` on
tp=2 and tp=4, for kv heads sharded (num_kv_heads divisible by tp) and replicated (fewer kv heads than ranks):
each rank's output is its q heads and the kv heads they attend with, weights are the matching rows, gradients
are the matching rows of the reference gradients (for replicated kv weights: the whole reference gradient, summed
over the axis), and the backward communicates exactly the all-reduces that implies.

Tolerances: float32, rtol=1e-5, atol=1e-6: the input gradient is summed over the ranks' partial products (a
different reduction order from the unsharded matmul); weights are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import QKVParallelLinear, Replicate, Shard, layout_of, valid_tp_sizes

DIM, HEAD_DIM, BATCH, SEQ = 8, 2, 2, 3
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _heads_of(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Rows (dim 0) or features (last dim) of heads ``[first, first + count)``."""
    return t.narrow(-1 if t.dim() > 2 else 0, first * HEAD_DIM, count * HEAD_DIM)


def _qkv(num_heads, num_kv_heads):
    mesh = Mesh(tp=torch.distributed.get_world_size())
    tp, rank = mesh.size("tp"), mesh.rank("tp")
    torch.manual_seed(0)
    reference = nn.Linear(DIM, (num_heads + 2 * num_kv_heads) * HEAD_DIM)
    torch.manual_seed(0)
    seeded = QKVParallelLinear(DIM, num_heads, num_kv_heads, HEAD_DIM, mesh=mesh)
    layer = QKVParallelLinear.from_linear(reference, num_heads=num_heads, num_kv_heads=num_kv_heads, mesh=mesh)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    q_heads = num_heads // tp
    sizes = [num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM]

    def kv_heads_of(r):  # the kv heads rank r's q heads attend with: (first, count)
        return (r * num_kv_heads // tp, num_kv_heads // tp) if num_kv_heads >= tp else (r // (tp // num_kv_heads), 1)

    def local(full, r):  # rank r's part of full (..., q | k | v) or rows q | k | v
        dim = -1 if full.dim() > 2 else 0
        q, k, v = full.split(sizes, dim=dim)
        first, count = kv_heads_of(r)
        return torch.cat(
            [_heads_of(q, r * q_heads, q_heads), _heads_of(k, first, count), _heads_of(v, first, count)], dim
        )

    # Each rank's output gets its own gradient (as attention gives it). A kv head shared by several ranks gets the
    # sum of their gradients in the unsharded reference: the ranks' losses add up to the reference loss.
    positions = torch.arange(reference.out_features)
    grad_local = [
        torch.randn(BATCH, SEQ, local(positions, r).numel(), generator=torch.Generator().manual_seed(10 + r))
        for r in range(tp)
    ]
    grad_out = torch.zeros(BATCH, SEQ, reference.out_features)
    for r in range(tp):
        grad_out.index_add_(-1, local(positions, r), grad_local[r])

    x_ref = x.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    (y_ref * grad_out).sum().backward()
    kv_first, kv_count = kv_heads_of(rank)

    x_tp = x.clone().requires_grad_(True)
    with CommTracker() as forward:
        y = layer(x_tp)
    with CommTracker() as backward:
        (y * grad_local[rank]).sum().backward()

    q_ref, k_ref, v_ref = reference.weight.grad.split(sizes)
    kb_ref = reference.bias.grad.split(sizes)
    q_rows = slice(rank * q_heads * HEAD_DIM, (rank + 1) * q_heads * HEAD_DIM)
    kv_rows = slice(None) if layer.kv_replicated else slice(kv_first * HEAD_DIM, (kv_first + kv_count) * HEAD_DIM)
    w_ref = reference.weight.detach().split(sizes)
    return {
        "close": {
            "y": (y.detach(), local(y_ref.detach(), rank)),
            "x.grad": (x_tp.grad, x_ref.grad),
            "q_weight.grad": (layer.q_weight.grad, q_ref[q_rows]),
            "k_weight.grad": (layer.k_weight.grad, k_ref[kv_rows]),
            "v_weight.grad": (layer.v_weight.grad, v_ref[kv_rows]),
            "q_bias.grad": (layer.q_bias.grad, kb_ref[0][q_rows]),
            "k_bias.grad": (layer.k_bias.grad, kb_ref[1][kv_rows]),
            "v_bias.grad": (layer.v_bias.grad, kb_ref[2][kv_rows]),
        },
        "exact": {
            "q_weight": (layer.q_weight.detach(), w_ref[0][q_rows]),
            "k_weight": (layer.k_weight.detach(), w_ref[1][kv_rows]),
            "v_weight": (layer.v_weight.detach(), w_ref[2][kv_rows]),
            "seeded": (
                torch.cat([p.detach().flatten() for p in seeded.parameters()]),
                torch.cat([p.detach().flatten() for p in layer.parameters()]),
            ),
        },
        "layouts": {
            name: (layout_of(p).placements, tuple(layout_of(p).global_shape)) for name, p in layer.named_parameters()
        },
        "local_heads": (layer.local_num_heads, layer.local_num_kv_heads, layer.split_sizes),
        "forward": [(r.op, r.axis, r.bytes) for r in forward.records],
        "backward": [(r.op, r.axis, r.bytes) for r in backward.records],
    }


CASES = [(2, 4, 4), (2, 4, 2), (2, 4, 1), (4, 4, 4), (4, 4, 2), (4, 8, 1)]


@pytest.mark.parametrize(("tp", "num_heads", "num_kv_heads"), CASES, ids=[f"tp{t}-heads{h}-kv{k}" for t, h, k in CASES])
def test_fused_qkv_equals_nn_linear(tp, num_heads, num_kv_heads):
    replicated = num_kv_heads < tp
    for result in run_distributed(_qkv, num_heads, num_kv_heads, world_size=tp):
        for name, (got, expected) in result["close"].items():
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=name)
        for name, (got, expected) in result["exact"].items():
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
        kv_placement = (Replicate(),) if replicated else (Shard(0),)
        q_rows, kv_rows = num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
        assert result["layouts"] == {
            "q_weight": ((Shard(0),), (q_rows, DIM)),
            "k_weight": (kv_placement, (kv_rows, DIM)),
            "v_weight": (kv_placement, (kv_rows, DIM)),
            "q_bias": ((Shard(0),), (q_rows,)),
            "k_bias": (kv_placement, (kv_rows,)),
            "v_bias": (kv_placement, (kv_rows,)),
        }
        local_kv = 1 if replicated else num_kv_heads // tp
        assert result["local_heads"] == (
            num_heads // tp,
            local_kv,
            (num_heads // tp * HEAD_DIM, local_kv * HEAD_DIM, local_kv * HEAD_DIM),
        )
        # Forward: no communication (the input is replicated). Backward: one all-reduce of the input gradient
        # (b*s*h), plus, for replicated kv weights, one all-reduce each of the k and v weight and bias gradients.
        ring = 2 * (tp - 1) / tp * 4  # bytes per float32 element of an all-reduce
        expected = [("all_reduce", "tp", ring * BATCH * SEQ * DIM)]
        if replicated:
            expected += [("all_reduce", "tp", ring * n) for n in (kv_rows, kv_rows * DIM, kv_rows, kv_rows * DIM)]
        assert result["forward"] == []
        assert sorted(result["backward"]) == sorted(expected)


def test_valid_tp_sizes_keep_each_ranks_q_heads_in_one_kv_group():
    assert valid_tp_sizes(8, 8) == [1, 2, 4, 8]
    assert valid_tp_sizes(8, 2) == [1, 2, 4, 8]
    assert valid_tp_sizes(12, 3) == [1, 3, 6, 12]
    assert valid_tp_sizes(6, 3) == [1, 3, 6]


def _errors():
    mesh = Mesh(tp=2)
    errors = {}
    for name, call in {
        "heads": lambda: QKVParallelLinear(8, 3, 3, 2, mesh=mesh),
        "kv": lambda: QKVParallelLinear(8, 12, 3, 2, mesh=mesh),
        "groups": lambda: QKVParallelLinear(8, 4, 3, 2, mesh=mesh),
        "width": lambda: QKVParallelLinear.from_linear(nn.Linear(8, 13), num_heads=4, num_kv_heads=2, mesh=mesh),
    }.items():
        try:
            call()
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_errors_list_the_valid_tp_sizes():
    errors = run_distributed(_errors, world_size=2)[0]
    assert "tp=2 does not divide num_heads=3; choose tp in [1, 3]" in errors["heads"]
    assert "tp=2 neither divides num_kv_heads=3 nor is a multiple of it" in errors["kv"]
    assert "choose tp in [1, 3, 6, 12]" in errors["kv"]
    assert "num_kv_heads=3 must be at least 1 and divide num_heads=4" in errors["groups"]
    assert "out_features=13 is not (num_heads + 2 * num_kv_heads) * head_dim" in errors["width"]
