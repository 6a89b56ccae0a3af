"""Ring attention and Ulysses on packed rows equal document-masked attention in one process, forward and backward.

Row 0 packs documents of 1, 7, 10 and 6 tokens; row 1 is left-padded (5 padding tokens, an id of their own) and
packs documents of 12 and 7. Every rank gets the whole sequence's document ids; the zigzag and contiguous splits cut
the tokens (and, inside ring attention, the ids) into chunks, so a rank's query chunk meets key chunks of the same
documents only where the single process's mask allows. Sequence lengths 24 (a multiple of the 4 zigzag chunks)
and 22 (padded to 24 at the end, ``seq_len`` masking the padding).

Tolerances: fp32, rtol=1e-5, atol=2e-6, as test_ring_attention.py: ring attention merges per-block softmaxes with
the log-sum-exp and sums gradients over blocks (another rounding order); Ulysses runs the same kernel on a head
split (bit-identical in practice).
"""

from __future__ import annotations

import torch

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.kernels import flash_attention_reference
from colo.tensor import ring_attention, shard_sequence, ulysses_attention

TOLERANCE = {"rtol": 1e-5, "atol": 2e-6}


def _document_ids(seq_len):
    row0 = torch.cat([torch.full((n,), i) for i, n in enumerate((1, 7, 10, 6))])
    row1 = torch.cat([torch.full((5,), -1), torch.zeros(12, dtype=torch.long), torch.ones(7, dtype=torch.long)])
    return torch.stack([row0, row1])[:, :seq_len]


def _inputs(seq_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq_len, 4, 16, generator=generator)
    k, v = (torch.randn(2, seq_len, 2, 16, generator=generator) for _ in range(2))
    return q, k, v, torch.randn(2, seq_len, 4, 16, generator=generator)


def _reference(q, k, v, dout, ids):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attention_reference(q, k, v, causal=True, document_ids=ids)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _packed_rows_match_one_process():
    mesh = Mesh(sp=torch.distributed.get_world_size())
    group, n, rank = mesh.group("sp"), mesh.size("sp"), mesh.rank("sp")
    mismatches = []
    cases = [
        ("ring", "zigzag", 24, "torch"),
        ("ring", "zigzag", 22, "torch"),
        ("ring", "contiguous", 24, "torch"),
        ("ring", "zigzag", 24, "triton"),  # the block kernels in the interpreter
        ("ulysses", "zigzag", 22, None),
        ("ulysses", "contiguous", 24, None),
    ]
    for kind, layout, seq_len, backend in cases:
        q, k, v, dout = _inputs(seq_len)
        ids = _document_ids(seq_len)
        expected = _reference(q, k, v, dout, ids)

        def piece(t, layout=layout):
            return shard_sequence(t, num_shards=n, rank=rank, layout=layout)

        local = [piece(t).requires_grad_(True) for t in (q, k, v)]
        if kind == "ring":
            out = ring_attention(
                *local, group=group, causal=True, layout=layout, seq_len=seq_len, backend=backend, document_ids=ids
            )
        else:
            out = ulysses_attention(*local, group=group, causal=True, layout=layout, seq_len=seq_len, document_ids=ids)
        out.backward(piece(dout))
        for name, value, reference in zip(
            ("out", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in local)), expected
        ):
            try:
                torch.testing.assert_close(value, piece(reference), **TOLERANCE)
            except AssertionError as error:
                mismatches.append(f"{kind} {layout} seq_len={seq_len} {backend} {name}: {error}")
    # bad ids fail on every rank before any communication, naming the problem
    q, k, v, _ = _inputs(24)
    local = [piece(t, "zigzag") for t in (q, k, v)]
    bad = _document_ids(24)
    bad[0, 3] = 5
    errors = []
    for call in (ring_attention, ulysses_attention):
        for ids in (bad, bad[:, :20]):
            try:
                call(*local, group=group, causal=True, layout="zigzag", document_ids=ids)
            except ValueError as error:
                errors.append(str(error))
    return mismatches, errors


def test_ring_and_ulysses_on_packed_rows_equal_the_single_process():
    for rank, (mismatches, errors) in enumerate(run_distributed(_packed_rows_match_one_process, world_size=2)):
        assert mismatches == [], f"rank {rank}:\n" + "\n".join(mismatches[:5])
        assert len(errors) == 4
        assert "non-decreasing" in errors[0] and "row 0 goes from 5 to 1 at position 4" in errors[0]
        assert "has shape (2, 20), but q/k/v need (batch, seq) = (2, 24)" in errors[1]
        assert "ulysses_attention" in errors[2] and "non-decreasing" in errors[2]
