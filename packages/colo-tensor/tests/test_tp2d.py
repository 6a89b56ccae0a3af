"""2D (SUMMA) and 2.5D (Tesseract) layers equal their torch.nn counterparts forward and backward: outputs and input
gradients against this rank's block of the reference, weight gradients gathered through their layouts against
the whole reference gradient, at 2D (4 ranks), 2.5D with d=1 (4 ranks) and d=2 (8 ranks), with an odd batch
where the scheme allows it (everything but the vocabulary-parallel embedding, whose reduce-scatter needs equal
batch parts).

Tolerances: float32, rtol=1e-5, atol=1e-5. SUMMA sums the matmul over q blocks of the reduction dimension in
another order, the norms all-reduce partial statistics over the grid row, and weight gradients are summed over
the batch axes after the local sums, so results differ from torch by rounding only; the seeded weights are
compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import CommTracker
from colo.comm.testing import run_distributed
from colo.tensor import gather, layout_of, set_layout
from colo.tensor.tp2d import (
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    RMSNorm2D,
    VocabParallelEmbedding2D,
    cross_entropy_2d,
    shard_batch,
)
from colo.tensor.tp_grid import check_tp_size, grid_mesh

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
HIDDEN, OUT, VOCAB, SEQ = 8, 12, 16, 3


def _data(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _gathered_grad(param):
    """The whole gradient of a sharded parameter, gathered through the parameter's layout."""
    return gather(set_layout(param.grad.clone(), layout_of(param)))


def _run(module, x, grad_output):
    x = x.clone().requires_grad_(x.is_floating_point())
    y = module(x)
    (y * grad_output).sum().backward()
    return y.detach(), x.grad


def _rms_reference(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class _RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(1 + 0.1 * _data(hidden, seed=9)), eps

    def forward(self, x):
        return _rms_reference(x, self.weight, self.eps)


def layer_cases(mode: str, tp: int, depth: int, batch: int) -> dict:
    """Every 2D / 2.5D layer against torch on one mesh; pairs (got, expected) and exact pairs."""
    mesh = grid_mesh(mode, tp, depth=depth)
    local = lambda t: shard_batch(t, mesh, hidden_split=True)  # noqa: E731
    rows = lambda t: shard_batch(t, mesh)  # noqa: E731
    pairs, exact = {}, {}
    x, g_hidden, g_out = (
        _data(batch, SEQ, HIDDEN, seed=1),
        _data(batch, SEQ, HIDDEN, seed=2),
        _data(batch, SEQ, OUT, seed=3),
    )

    torch.manual_seed(0)
    reference = nn.Linear(HIDDEN, OUT)
    torch.manual_seed(0)
    seeded = Linear2D(HIDDEN, OUT, mesh=mesh)
    exact["linear/seeded weight"] = (seeded.weight, layout_of(seeded.weight).local_slice(reference.weight.detach()))
    exact["linear/seeded bias"] = (seeded.bias, layout_of(seeded.bias).local_slice(reference.bias.detach()))
    y_ref, x_grad_ref = _run(reference, x, g_out)
    layer = Linear2D.from_linear(reference, mesh=mesh)
    y, x_grad = _run(layer, local(x), local(g_out))
    pairs["linear/y"] = (y, local(y_ref))
    pairs["linear/x.grad"] = (x_grad, local(x_grad_ref))
    pairs["linear/weight.grad"] = (_gathered_grad(layer.weight), reference.weight.grad)
    pairs["linear/bias.grad"] = (_gathered_grad(layer.bias), reference.bias.grad)

    norm = nn.LayerNorm(HIDDEN)
    with torch.no_grad():
        norm.weight.add_(0.1 * _data(HIDDEN, seed=4))
        norm.bias.add_(0.1 * _data(HIDDEN, seed=5))
    y_ref, x_grad_ref = _run(norm, x, g_hidden)
    layer = LayerNorm2D.from_layer_norm(norm, mesh=mesh)
    y, x_grad = _run(layer, local(x), local(g_hidden))
    pairs["layernorm/y"], pairs["layernorm/x.grad"] = (y, local(y_ref)), (x_grad, local(x_grad_ref))
    pairs["layernorm/weight.grad"] = (_gathered_grad(layer.weight), norm.weight.grad)
    pairs["layernorm/bias.grad"] = (_gathered_grad(layer.bias), norm.bias.grad)

    rms = _RMSNorm(HIDDEN)
    y_ref, x_grad_ref = _run(rms, x, g_hidden)
    layer = RMSNorm2D(HIDDEN, mesh=mesh)
    layer.load_full(rms.weight.detach())
    y, x_grad = _run(layer, local(x), local(g_hidden))
    pairs["rmsnorm/y"], pairs["rmsnorm/x.grad"] = (y, local(y_ref)), (x_grad, local(x_grad_ref))
    pairs["rmsnorm/weight.grad"] = (_gathered_grad(layer.weight), rms.weight.grad)

    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(6))
    embedding = nn.Embedding(VOCAB, HIDDEN)
    (embedding(ids) * g_hidden).sum().backward()
    layer = Embedding2D(VOCAB, HIDDEN, mesh=mesh)
    layer.load_full(embedding.weight.detach())
    y = layer(ids)
    (y * local(g_hidden)).sum().backward()
    pairs["embedding/y"] = (y.detach(), local(embedding(ids).detach()))
    pairs["embedding/weight.grad"] = (_gathered_grad(layer.weight), embedding.weight.grad)

    # The vocabulary-parallel embedding needs the batch to divide by the batch axes' size.
    even = mesh.size("tp_row") * (mesh.size("tp_dep") if "tp_dep" in mesh.axis_names else 1)
    ids_even = torch.randint(0, VOCAB, (even, SEQ), generator=torch.Generator().manual_seed(7))
    g_even = _data(even, SEQ, HIDDEN, seed=8)
    embedding.zero_grad()
    (embedding(ids_even) * g_even).sum().backward()
    layer = VocabParallelEmbedding2D(VOCAB, HIDDEN, mesh=mesh)
    layer.load_full(embedding.weight.detach())
    y = layer(ids_even)
    (y * local(g_even)).sum().backward()
    pairs["vocab_embedding/y"] = (y.detach(), local(embedding(ids_even).detach()))
    pairs["vocab_embedding/weight.grad"] = (_gathered_grad(layer.weight), embedding.weight.grad)

    # LM head + vocabulary-parallel cross-entropy, with one ignored target.
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    target = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(10))
    target[0, 0] = -100
    x_ref = x.clone().requires_grad_(True)
    loss_ref = F.cross_entropy(head(x_ref).flatten(0, 1), target.flatten())
    loss_ref.backward()
    layer = Linear2D.from_linear(head, mesh=mesh)
    x_local = local(x).requires_grad_(True)
    loss = cross_entropy_2d(layer(x_local), rows(target), mesh=mesh)
    loss.backward()
    pairs["lm_head/loss"] = (loss.detach(), loss_ref.detach())
    pairs["lm_head/x.grad"] = (x_local.grad, local(x_ref.grad))
    pairs["lm_head/weight.grad"] = (_gathered_grad(layer.weight), head.weight.grad)
    return {"pairs": pairs, "exact": exact}


def _check(results):
    for result in results:
        for name, (got, expected) in result["pairs"].items():
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=name)
        for name, (got, expected) in result["exact"].items():
            torch.testing.assert_close(got.detach(), expected, rtol=0, atol=0, msg=name)


def _four_rank_cases():
    return {"2d": layer_cases("2d", 4, 1, batch=5), "2.5d d=1": layer_cases("2.5d", 4, 1, batch=3)}


def test_2d_and_2p5d_depth1_layers_equal_torch_on_4_ranks():
    results = run_distributed(_four_rank_cases, world_size=4)
    for scheme in ("2d", "2.5d d=1"):
        _check([result[scheme] for result in results])


def test_2p5d_depth2_layers_equal_torch_on_8_ranks():
    _check(run_distributed(layer_cases, "2.5d", 8, 2, 5, world_size=8))


def _summa_traffic(batch):
    mesh = grid_mesh("2d", 4)
    layer = Linear2D(HIDDEN, OUT, mesh=mesh)
    x = shard_batch(_data(batch, SEQ, HIDDEN, seed=1), mesh, hidden_split=True).requires_grad_(True)
    with CommTracker() as forward:
        y = layer(x)
    with CommTracker() as backward:
        y.sum().backward()
    return [(r.op, r.axis, r.bytes) for r in forward.records], [(r.op, r.axis, r.bytes) for r in backward.records]


def test_summa_forward_is_q_broadcasts_per_axis_and_backward_adds_two_reduce_scatters():
    q, batch = 2, 4
    rows, width, out_width = batch // q * SEQ, HIDDEN // q, OUT // q
    x_block, w_block = rows * width * 4, out_width * width * 4
    steps = [("broadcast", "tp_col", x_block), ("broadcast", "tp_row", w_block)] * q
    for forward, backward in run_distributed(_summa_traffic, batch, world_size=4):
        assert forward == steps
        # autograd may run the bias's all-reduce before or after the SUMMA backward: compare as multisets
        assert sorted(backward) == sorted(
            [
                ("all_reduce", "tp_row", 2 * (q - 1) / q * out_width * 4),  # bias gradient over the batch axis
                *steps,
                ("reduce_scatter", "tp_col", (q - 1) / q * rows * HIDDEN * 4),  # input gradient, grid row
                ("reduce_scatter", "tp_row", (q - 1) / q * out_width * HIDDEN * 4),  # weight gradient, grid column
            ]
        )


@pytest.mark.parametrize(
    ("mode", "tp", "depth", "message"),
    [
        ("2d", 8, 1, "tp_mode='2d' needs tp = q^2 (a q x q grid) but tp=8; choose tp in {1, 4, 9, 16, 25, 36, 49, 64"),
        ("2.5d", 12, 2, "with tp_depth=2 choose tp in {2, 8, 18, 32, 50, ...}"),
        ("3d", 9, 1, "tp_mode='3d' needs tp = q^3 (a q x q x q cube) but tp=9; choose tp in {1, 8, 27, 64, ...}"),
        ("2d", 4, 2, "tp_depth=2 applies to tp_mode='2.5d' only"),
        ("4d", 4, 1, "tp_mode='4d' is not a tensor-parallel scheme"),
    ],
)
def test_invalid_grid_sizes_list_the_valid_ones(mode, tp, depth, message):
    with pytest.raises(ValueError) as error:
        check_tp_size(mode, tp, depth)
    assert message in str(error.value)


def _divisibility_errors():
    mesh = grid_mesh("2d", 4)
    errors = {}
    for name, call in {
        "linear": lambda: Linear2D(6, 9, mesh=mesh),
        "norm": lambda: LayerNorm2D(5, mesh=mesh),
        "vocab": lambda: VocabParallelEmbedding2D(7, 8, mesh=mesh),
        "batch": lambda: VocabParallelEmbedding2D(8, 8, mesh=mesh)(torch.zeros(3, 2, dtype=torch.long)),
        "input": lambda: Linear2D(8, 8, mesh=mesh)(torch.ones(2, 8)),
    }.items():
        try:
            call()
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_sizes_that_do_not_divide_say_what_to_change():
    errors = run_distributed(_divisibility_errors, world_size=4)[0]
    assert "Linear2D: out_features=9 does not divide by 2 (the 2D grid side)" in errors["linear"]
    assert "LayerNorm2D: hidden_size=5 does not divide by 2" in errors["norm"]
    assert "num_embeddings=7 does not divide by 2" in errors["vocab"]
    assert "batch=3 does not divide by the 2 ranks of the batch axes" in errors["batch"]
    assert "the input has 8 features but this rank holds 4 of in_features=8" in errors["input"]
