"""Vocabulary-parallel embedding and cross-entropy equal ``nn.Embedding`` and ``F.cross_entropy`` on tp=2 and
tp=4 (a vocabulary of 10 over 4 ranks is padded to 12), forward and backward, and the cross-entropy never
gathers the logits: its only communication is two all-reduces of one and two numbers per token row.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import ColumnParallelLinear, Shard, VocabParallelEmbedding, layout_of, vocab_parallel_cross_entropy

VOCAB, DIM, PADDING_IDX = 10, 6, 4
# Cross-entropy: the max-shifted log-sum-exp is assembled from per-rank partial sums, torch fuses log_softmax;
# float32 rounding differs, hence rtol=1e-5 / atol=1e-6 there. Embedding lookups add exact zeros: compared exactly.
CE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _ids():
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    ids[0, :3] = torch.tensor([PADDING_IDX, VOCAB - 1, 0])  # the padding row, the last row, the first row
    return ids


def _embedding():
    mesh = Mesh(tp=torch.distributed.get_world_size())
    n, r = mesh.size("tp"), mesh.rank("tp")
    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, DIM, padding_idx=PADDING_IDX)
    torch.manual_seed(0)
    seeded = VocabParallelEmbedding(VOCAB, DIM, mesh=mesh, padding_idx=PADDING_IDX)
    layer = VocabParallelEmbedding.from_embedding(reference, mesh=mesh)

    rows = -(-VOCAB // n)  # rows per rank, the vocabulary padded to n * rows with zero rows
    padded = torch.cat([reference.weight.detach(), torch.zeros(n * rows - VOCAB, DIM)])
    g = torch.randn(3, 7, DIM, generator=torch.Generator().manual_seed(1))
    (reference(_ids()) * g).sum().backward()
    with CommTracker() as forward:
        y = layer(_ids())
    with CommTracker() as backward:
        (y * g).sum().backward()
    padded_grad = torch.cat([reference.weight.grad, torch.zeros(n * rows - VOCAB, DIM)])
    return {
        "seeded": (seeded.weight.detach(), padded[r * rows : (r + 1) * rows]),
        "weight": (layer.weight.detach(), padded[r * rows : (r + 1) * rows]),
        "y": (y.detach(), reference(_ids()).detach()),
        "weight.grad": (layer.weight.grad, padded_grad[r * rows : (r + 1) * rows]),
        "layout": (layout_of(layer.weight).placements, tuple(layout_of(layer.weight).global_shape)),
        "comm": ([(rec.op, rec.bytes) for rec in forward.records], backward.calls()),
        "repr": repr(layer),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_embedding_equals_nn_embedding(world_size):
    rows = -(-VOCAB // world_size)
    for result in run_distributed(_embedding, world_size=world_size):
        for name in ("seeded", "weight", "y"):
            torch.testing.assert_close(*result[name], rtol=0, atol=0, msg=name)
        # each row's gradient sums the same positions in the same order; padding rows get none
        torch.testing.assert_close(*result["weight.grad"], rtol=1e-6, atol=1e-6, msg="weight.grad")
        assert result["layout"] == ((Shard(0),), (world_size * rows, DIM))
        n = world_size
        assert result["comm"] == ([("all_reduce", 2 * (n - 1) / n * 3 * 7 * DIM * 4)], 0)
    if world_size == 4:
        assert "10 (padded to 12), 6, padding_idx=4" in result["repr"]


def _cross_entropy(vocab_size_padded, ignore_index):
    mesh = Mesh(tp=torch.distributed.get_world_size())
    group, n, r = mesh.group("tp"), mesh.size("tp"), mesh.rank("tp")
    generator = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(4, 5, vocab_size_padded, generator=generator)
    target = torch.randint(0, VOCAB, (4, 5), generator=generator)
    target[0, :2] = ignore_index
    target[1, 0] = VOCAB - 1
    out = {}
    for reduction in ("mean", "sum", "none"):
        full = logits[..., :VOCAB].clone().requires_grad_(True)
        expected = F.cross_entropy(full.transpose(1, 2), target, ignore_index=ignore_index, reduction=reduction)
        weights = torch.arange(expected.numel(), dtype=torch.float32).view(expected.shape) + 1
        (expected * weights).sum().backward()
        padded_grad = torch.cat([full.grad, torch.zeros(4, 5, vocab_size_padded - VOCAB)], dim=-1)

        local = logits.chunk(n, dim=-1)[r].clone().requires_grad_(True)
        with CommTracker() as forward:
            loss = vocab_parallel_cross_entropy(
                local, target, group=group, ignore_index=ignore_index, vocab_size=VOCAB, reduction=reduction
            )
        with CommTracker() as backward:
            (loss * weights).sum().backward()
        out[reduction] = {
            "loss": (loss.detach(), expected.detach()),
            "grad": (local.grad, padded_grad.chunk(n, dim=-1)[r]),
            "forward": [(rec.op, rec.bytes) for rec in forward.records],
            "backward": backward.calls(),
        }
    return out


@pytest.mark.parametrize(
    "world_size, vocab_size_padded, ignore_index",
    [(2, 10, -100), (4, 12, -100), (2, 10, 3)],
    ids=["tp2", "tp4-padded-vocab", "tp2-ignore-a-real-class"],
)
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(world_size, vocab_size_padded, ignore_index):
    n, rows = world_size, 4 * 5
    # never the logits: an all-reduce (max) of one float per row, then an all-reduce (sum) of two per row
    communication = [("all_reduce", 2 * (n - 1) / n * rows * 4), ("all_reduce", 2 * (n - 1) / n * 2 * rows * 4)]
    for result in run_distributed(_cross_entropy, vocab_size_padded, ignore_index, world_size=world_size):
        for reduction, checks in result.items():
            torch.testing.assert_close(*checks["loss"], **CE_TOLERANCE, msg=f"{reduction} loss")
            torch.testing.assert_close(*checks["grad"], **CE_TOLERANCE, msg=f"{reduction} grad")
            assert checks["forward"] == communication and checks["backward"] == 0


def _lm_head():
    mesh = Mesh(tp=2)
    torch.manual_seed(0)
    head = nn.Linear(DIM, VOCAB, bias=False)
    hidden = torch.randn(2, 3, DIM, generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(4))
    F.cross_entropy(head(hidden).view(-1, VOCAB), target.view(-1)).backward()
    parallel = ColumnParallelLinear.from_linear(head, mesh=mesh)
    loss = vocab_parallel_cross_entropy(parallel(hidden), target, group=mesh.group("tp"))
    loss.backward()
    expected_loss = F.cross_entropy(head(hidden).view(-1, VOCAB), target.view(-1))
    return loss.detach(), expected_loss.detach(), parallel.weight.grad, head.weight.grad.chunk(2)[mesh.rank("tp")]


def test_column_parallel_head_with_vocab_parallel_loss_equals_the_unsharded_head():
    for loss, expected, grad, expected_grad in run_distributed(_lm_head, world_size=2):
        torch.testing.assert_close(loss, expected, **CE_TOLERANCE)
        torch.testing.assert_close(grad, expected_grad, **CE_TOLERANCE)
