"""The communication cost model (`colo.tensor.tp_cost`) equals what `CommTracker` measures, bytes and calls, layer by
layer (forward + backward) for 1D (4 ranks), 2D (4 ranks) and 2.5D with d=2 (8 ranks); and the model's shape: 2D
moves fewer bytes than 1D on a Llama block as P grows."""

from __future__ import annotations

import pytest
import torch

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_cost,
    vocab_parallel_cross_entropy,
)
from colo.tensor.tp2d import (
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    RMSNorm2D,
    VocabParallelEmbedding2D,
    cross_entropy_2d,
    shard_batch,
)
from colo.tensor.tp_grid import grid_mesh

BATCH, SEQ, HIDDEN, OUT, VOCAB = 4, 3, 8, 12, 16


def _measure(step):
    """(bytes, calls) of ``step()`` (forward and backward) on this rank."""
    with CommTracker() as tracker:
        step()
    return tracker.bytes(), tracker.calls()


def _x(mesh):
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0))
    return shard_batch(x, mesh, hidden_split=True).requires_grad_(True)


def measured_2d(mode, tp, depth):
    mesh = grid_mesh(mode, tp, depth=depth)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    layers = {
        "linear": lambda: Linear2D(HIDDEN, OUT, mesh=mesh)(_x(mesh)).sum().backward(),
        "linear_nobias": lambda: Linear2D(HIDDEN, OUT, mesh=mesh, bias=False)(_x(mesh)).sum().backward(),
        "layernorm": lambda: LayerNorm2D(HIDDEN, mesh=mesh)(_x(mesh)).pow(2).sum().backward(),
        "rmsnorm": lambda: RMSNorm2D(HIDDEN, mesh=mesh)(_x(mesh)).pow(2).sum().backward(),
        "embedding": lambda: Embedding2D(VOCAB, HIDDEN, mesh=mesh)(ids).sum().backward(),
        "vocab_embedding": lambda: VocabParallelEmbedding2D(VOCAB, HIDDEN, mesh=mesh)(ids).sum().backward(),
        "cross_entropy": lambda: cross_entropy_2d(
            _x(mesh)[..., : HIDDEN // mesh.size("tp_col")], shard_batch(ids % HIDDEN, mesh), mesh=mesh
        ).backward(),
    }
    results = {}
    for name, step in layers.items():
        results[name] = _measure(step)
    return results


def _expected_2d(tp, depth):
    q, d, tokens = round((tp // depth) ** 0.5), depth, BATCH * SEQ
    return {
        "linear": tp_cost.linear_2d(tokens, HIDDEN, OUT, q, d),
        "linear_nobias": tp_cost.linear_2d(tokens, HIDDEN, OUT, q, d, bias=False),
        "layernorm": tp_cost.norm_2d(tokens, HIDDEN, q, d, kind="layernorm"),
        "rmsnorm": tp_cost.norm_2d(tokens, HIDDEN, q, d, kind="rmsnorm"),
        "embedding": tp_cost.embedding_2d(VOCAB, HIDDEN, q, d),
        "vocab_embedding": tp_cost.vocab_embedding_2d(tokens, HIDDEN, q, d),
        "cross_entropy": tp_cost.cross_entropy_2d(tokens, q, d),
    }


def _check(results, expected):
    for result in results:
        for name, cost in expected.items():
            assert result[name] == (cost.bytes, cost.messages), name


def test_2d_model_equals_measured_on_4_ranks():
    _check(run_distributed(measured_2d, "2d", 4, 1, world_size=4), _expected_2d(4, 1))


def test_2p5d_model_equals_measured_on_8_ranks():
    _check(run_distributed(measured_2d, "2.5d", 8, 2, world_size=8), _expected_2d(8, 2))


def measured_1d():
    mesh = Mesh(tp=4)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    column, row = ColumnParallelLinear(HIDDEN, OUT, mesh=mesh), RowParallelLinear(HIDDEN, OUT, mesh=mesh)
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, mesh=mesh)
    return {
        "column": _measure(lambda: column(x).sum().backward()),
        "row": _measure(lambda: row(x[..., :2]).sum().backward()),
        "vocab_embedding": _measure(lambda: embedding(ids).sum().backward()),
        "cross_entropy": _measure(
            lambda: vocab_parallel_cross_entropy(x[..., :4], ids, group=mesh.group("tp")).backward()
        ),
    }


def test_1d_model_equals_measured_on_4_ranks():
    tokens = BATCH * SEQ
    expected = {
        "column": tp_cost.linear_1d(tokens, HIDDEN, OUT, 4, kind="column"),
        "row": tp_cost.linear_1d(tokens, HIDDEN, OUT, 4, kind="row"),
        "vocab_embedding": tp_cost.vocab_embedding_1d(tokens, HIDDEN, 4),
        "cross_entropy": tp_cost.vocab_cross_entropy_1d(tokens, 4),
    }
    _check(run_distributed(measured_1d, world_size=4), expected)


@pytest.mark.parametrize(("p", "fewest_bytes"), [(4, "1d"), (16, "1d"), (64, "2d"), (256, "2d")])
def test_2d_overtakes_1d_on_a_70b_llama_block_as_p_grows(p, fewest_bytes):
    # 1D's all-reduces stay near 8 * tokens * hidden per rank whatever P; 2D's activation traffic falls as 1/q but
    # SUMMA also moves weight blocks (N K / q per linear and direction), which is why it loses at small P here.
    shape = dict(tokens=8 * 4096, hidden=8192, intermediate=28672, num_heads=64, num_kv_heads=8)
    one_d = tp_cost.llama_block("1d", p=p, **shape)
    two_d = tp_cost.llama_block("2d", p=p, **shape)
    assert (one_d.bytes < two_d.bytes) == (fewest_bytes == "1d")
    assert two_d.messages > one_d.messages  # the price: 2q broadcasts per linear and direction
