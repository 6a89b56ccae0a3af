"""Ring attention and Ulysses on packed rows equal document-masked attention in one process, forward and backward.

Row 0 packs documents of 1, 7, 10 and 6 tokens; row 1 is left-padded (5 padding tokens, an id of their own) and
packs documents of 12 and 7. Every rank gets the whole sequence's document ids; the zigzag and contiguous splits cut
the tokens (and, inside ring attention, the ids) into chunks, so a rank's query chunk meets key chunks of the same
documents only where the single process's mask allows. Sequence lengths 24 (a multiple of the 4 zigzag chunks)
and 22 (padded to 24 at the end, ``seq_len`` masking the padding).

Ring attention leaves out the key chunks whose documents cannot meet the query chunk's (`ring_plan`): the result
equals the unskipped computation (rtol 1e-5, atol 1e-6: the unskipped steps reduce over more, zero, terms) and the
single process, and the query x key pairs computed fall as the documents allow (counted by wrapping the block
kernel).

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


def _skipping_case():
    """Ring attention on rows whose documents fill whole zigzag chunks or span them, with and without skipping the
    key chunks that cannot meet the queries' documents; the key tokens each rank computes over, counted."""
    import importlib

    ring_module = importlib.import_module("colo.tensor.ring_attention")  # the module (the package exports the function)

    mesh = Mesh(sp=torch.distributed.get_world_size())
    group, n, rank = mesh.group("sp"), mesh.size("sp"), mesh.rank("sp")
    q, k, v, dout = _inputs(24, seed=3)
    # row 0: a document per 6-token chunk (only the diagonal blocks meet); row 1: 8 / 16 tokens (spans chunks)
    ids = torch.stack([torch.arange(24) // 6, (torch.arange(24) >= 8).long()])
    single_document_rows = torch.zeros_like(ids)

    def piece(t):
        return shard_sequence(t, num_shards=n, rank=rank, layout="zigzag")

    counted = {"keys": 0}
    block_forward = ring_module.attention_block_forward

    def counting(q_block, keys, *args, **kwargs):
        counted["keys"] += q_block.shape[1] * keys.shape[1]
        return block_forward(q_block, keys, *args, **kwargs)

    results = {}
    ring_module.attention_block_forward = counting
    plan = ring_module.ring_plan
    try:
        for label, row_ids, skip in (
            ("skipped", ids[:1], True),
            ("unskipped", ids[:1], False),
            ("both rows", ids, True),
            ("one document", single_document_rows, True),
        ):
            if not skip:  # the plan of one document per row: every key chunk, the whole ring
                ring_module.ring_plan = lambda *args, **kwargs: plan(*args, **{**kwargs, "document_ids": None})
            rows = row_ids.shape[0]
            local = [piece(t[:rows]).requires_grad_(True) for t in (q, k, v)]
            counted["keys"] = 0
            out = ring_attention(*local, group=group, causal=True, layout="zigzag", document_ids=row_ids)
            out.backward(piece(dout[:rows]))
            ring_module.ring_plan = plan
            expected = [piece(t) for t in _reference(q[:rows], k[:rows], v[:rows], dout[:rows], row_ids)]
            results[label] = {
                "values": [out.detach(), *(t.grad for t in local)],
                "expected": expected,
                "query_key_pairs": counted["keys"],
            }
    finally:
        ring_module.attention_block_forward = block_forward
        ring_module.ring_plan = plan
    return results


def test_ring_attention_skips_key_chunks_of_other_documents_and_stays_equal():
    for rank, results in enumerate(run_distributed(_skipping_case, world_size=2)):
        for label, case in results.items():
            for name, value, reference in zip(("out", "dq", "dk", "dv"), case["values"], case["expected"]):
                torch.testing.assert_close(value, reference, **TOLERANCE, msg=f"rank {rank} {label} {name}")
        skipped, unskipped = results["skipped"], results["unskipped"]
        for value, reference in zip(skipped["values"], unskipped["values"]):
            # the masked keys added nothing but rounding: the unskipped steps reduce over more (zero) terms
            torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
        # zigzag over 2 ranks: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (6 tokens each). Unskipped, rank 0
        # computes q0-k0 (6x6), q3-k0,k3 (6x12), q3-k1,k2 (6x12); rank 1 q1-k1, q2-k1,k2, q1-k0, q2-k0: 180 pairs
        # each. A document per chunk leaves only the diagonals: 2 x 6x6
        assert unskipped["query_key_pairs"] == 180
        assert skipped["query_key_pairs"] == 72
        # with row 1 (documents 0-7, 8-23) beside it, a chunk is left out only where neither row meets it: rank 0
        # drops k0 for q3, rank 1 drops k0 for q2
        assert results["both rows"]["query_key_pairs"] == 144
        assert results["one document"]["query_key_pairs"] == 180  # nothing to skip
