"""Document-masked (varlen) attention equals attention run on each document alone, forward and backward.

A packed row holds documents of lengths 1, 7, 64 and 100 back to back; a second row is left-padded (the padding is
a document of its own). Both the torch reference and the Triton kernels (in the interpreter on CPU, fp32, blocks
of 32) are compared with `flash_attention_reference` run on every document separately, and the Triton kernels are
shown to skip the key blocks a query block cannot see.
"""

import pytest
import torch

from colo.kernels import count_attention_blocks, document_ids_from_position_ids, flash_attention
from colo.kernels.flash_attention import attention_block_backward, attention_block_forward, flash_attention_reference

LENGTHS = (1, 7, 64, 100)
PADDING = 22  # row 1: 22 padding tokens, then documents of 50 and 100 tokens
SEQ = sum(LENGTHS)


def _ids(lengths, first=0):
    return torch.cat([torch.full((n,), first + i) for i, n in enumerate(lengths)])


def _packed_batch(heads_q=4, heads_kv=2, head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    q, k, v = make(2, SEQ, heads_q, head_dim), make(2, SEQ, heads_kv, head_dim), make(2, SEQ, heads_kv, head_dim)
    dout = torch.randn(2, SEQ, heads_q, head_dim, generator=generator)
    ids = torch.stack([_ids(LENGTHS), torch.cat([torch.full((PADDING,), -1), _ids((50, 100))])])
    dout[1, :PADDING] = 0  # a loss ignores padding: its outputs get no gradient
    return q, k, v, dout, ids


def _spans(ids_row):
    """``(start, end)`` of every document of a row."""
    changes = [0] + [i for i in range(1, len(ids_row)) if ids_row[i] != ids_row[i - 1]] + [len(ids_row)]
    return list(zip(changes[:-1], changes[1:]))


def _grads(out, q, k, v, dout):
    return torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_and_padded_rows_equal_each_document_alone(backend):
    q, k, v, dout, ids = _packed_batch()
    out = flash_attention(q, k, v, causal=True, document_ids=ids, backend=backend)
    dq, dk, dv = _grads(out, q, k, v, dout)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    for row in range(2):
        for start, end in _spans(ids[row].tolist()):
            if ids[row, start] < 0:  # padding: attends to itself only, so real tokens get nothing from it
                assert dk[row, start:end].eq(0).all() and dv[row, start:end].eq(0).all()
                continue
            piece = [t[row : row + 1, start:end].detach().requires_grad_() for t in (q, k, v)]
            expected = flash_attention_reference(*piece, causal=True)
            expected_grads = _grads(expected, *piece, dout[row : row + 1, start:end])
            actual = (out, dq, dk, dv)
            # fp32 both ways; the kernel's online softmax and recomputed backward differ in rounding only (a few
            # 1e-7 relative), the reference over the whole row adds exact zeros for the masked keys
            for name, a, e in zip(("out", "dq", "dk", "dv"), actual, (expected, *expected_grads)):
                torch.testing.assert_close(
                    a[row : row + 1, start:end], e, rtol=1e-5, atol=1e-5, msg=f"{name} row {row} [{start}:{end})"
                )


def test_triton_skips_fully_masked_blocks():
    q, k, v, dout, ids = _packed_batch()
    ids = ids[:1]
    q, k, v, dout = (t[:1].detach().requires_grad_() if t.requires_grad else t[:1] for t in (q, k, v, dout))
    with count_attention_blocks() as counts:
        out = flash_attention(q, k, v, causal=True, document_ids=ids, backend="triton")
        out.backward(dout)
    with count_attention_blocks() as causal_counts:
        flash_attention(q, k, v, causal=True, backend="triton").backward(dout)
    # the tiles (32 x 32) holding at least one visible (query, key) pair, from the dense mask
    visible = (ids[0][:, None] == ids[0][None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    blocks = -(-SEQ // 32)
    needed = sum(
        bool(visible[i * 32 : (i + 1) * 32, j * 32 : (j + 1) * 32].any()) for i in range(blocks) for j in range(blocks)
    )
    heads_q = q.shape[2]
    assert counts == {"forward": needed * heads_q, "backward_dkdv": needed * heads_q, "backward_dq": needed * heads_q}
    assert causal_counts["forward"] == blocks * (blocks + 1) // 2 * heads_q
    assert (needed, blocks * (blocks + 1) // 2) == (15, 21)  # 6 tiles skipped: documents 64 and 100 never meet


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_offsets_place_queries_of_left_padded_rows_in_a_kv_cache(backend):
    """Decoding 3 new tokens per row over a 40-slot cache: row 0 holds 10 padding slots then 27 tokens (queries at
    37..39), row 1 holds 20 tokens (queries at 20..22; later slots are empty and causally invisible)."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 16, generator=generator).requires_grad_()
    k, v = (torch.randn(2, 40, 2, 16, generator=generator).requires_grad_() for _ in range(2))
    dout = torch.randn(2, 3, 4, 16, generator=generator)
    ids = torch.stack([torch.cat([torch.full((10,), -1), torch.zeros(30, dtype=torch.long)]), torch.zeros(40).long()])
    offsets = torch.tensor([37, 20])
    out = flash_attention(q, k, v, causal=True, document_ids=ids, kv_offsets=offsets, backend=backend)
    dq, dk, dv = _grads(out, q, k, v, dout)
    for row, (first, last) in enumerate([(10, 40), (0, 23)]):  # the keys each row's queries may see
        piece = [q[row : row + 1].detach().requires_grad_()] + [
            t[row : row + 1, first:last].detach().requires_grad_() for t in (k, v)
        ]
        expected = flash_attention_reference(*piece, causal=True)  # bottom-right: query i sees keys <= last - 3 + i
        expected_grads = _grads(expected, *piece, dout[row : row + 1])
        torch.testing.assert_close(out[row : row + 1], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dq[row : row + 1], expected_grads[0], rtol=1e-5, atol=1e-5)
        for name, grad, e in (("dk", dk, expected_grads[1]), ("dv", dv, expected_grads[2])):
            torch.testing.assert_close(grad[row : row + 1, first:last], e, rtol=1e-5, atol=1e-5, msg=name)
            assert grad[row, :first].eq(0).all() and grad[row, last:].eq(0).all(), name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fully_masked_rows_give_zero_output_and_gradients_without_nan(backend):
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=generator).requires_grad_() for _ in range(3))
    keys = torch.zeros(1, 40, dtype=torch.long)
    queries = torch.cat([torch.full((1, 8), -5), torch.zeros(1, 32, dtype=torch.long)], dim=1)  # -5: no such key
    out = flash_attention(q, k, v, causal=True, document_ids=keys, query_document_ids=queries, backend=backend)
    grads = _grads(out, q, k, v, torch.ones_like(out))
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    assert out[:, :8].eq(0).all() and grads[0][:, :8].eq(0).all()
    block_out, lse = attention_block_forward(
        q, k, v, causal=True, document_ids=keys, query_document_ids=queries, backend=backend
    )
    assert torch.isneginf(lse[:, :, :8]).all() and block_out[:, :8].eq(0).all()
    # an offset that puts every query before the first key: nothing visible anywhere
    out = flash_attention(q, k, v, causal=True, kv_offsets=-40, backend=backend)
    grads = _grads(out, q, k, v, torch.ones_like(out))
    assert out.eq(0).all() and all(g.eq(0).all() for g in grads)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_steps_with_document_ids_merge_to_the_masked_attention(backend):
    """Ring attention's use: queries 32..63 of a packed row over keys 0..31 (non-causal block) and 32..63 (causal
    diagonal block), with the ids of the query chunk and of each key block."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 32, 4, 16, generator=generator)
    k, v = (torch.randn(1, 64, 2, 16, generator=generator) for _ in range(2))
    dout = torch.randn(1, 32, 4, 16, generator=generator)
    ids = _ids((20, 30, 14)).unsqueeze(0)  # documents [0, 20), [20, 50), [50, 64)
    query_ids = ids[:, 32:]
    blocks = [(slice(0, 32), False), (slice(32, 64), True)]
    results = [
        attention_block_forward(
            q, k[:, s], v[:, s], causal=c, document_ids=ids[:, s], query_document_ids=query_ids, backend=backend
        )
        for s, c in blocks
    ]
    lse = torch.logsumexp(torch.stack([r[1] for r in results]), dim=0)
    out = sum(torch.exp(r[1] - lse).transpose(1, 2).unsqueeze(-1) * r[0] for r in results)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    expected = flash_attention_reference(q_, k_, v_, causal=True, document_ids=ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    expected_grads = _grads(expected, q_, k_, v_, dout)
    grads = [
        attention_block_backward(
            dout, q, k[:, s], v[:, s], out, lse, causal=c, document_ids=ids[:, s], query_document_ids=query_ids,
            backend=backend,
        )
        for s, c in blocks
    ]  # fmt: skip
    dq = grads[0][0] + grads[1][0]
    dk, dv = (torch.cat([g[i] for g in grads], dim=1) for i in (1, 2))
    for name, actual, reference in zip(("dq", "dk", "dv"), (dq, dk, dv), expected_grads):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5, msg=name)


def test_document_ids_from_position_ids_start_a_document_where_positions_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [5, 6, 7, 8, 9, 10, 11, 12]])
    assert document_ids_from_position_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 4], [0] * 8]


def test_bad_document_ids_raise_clear_errors():
    q, k, v = (torch.randn(2, 8, 2, 16) for _ in range(3))
    ids = torch.zeros(2, 8, dtype=torch.long)
    decreasing = ids.clone()
    decreasing[1, 5] = -1
    with pytest.raises(ValueError, match=r"non-decreasing.*row 1 goes from 0 to -1 at position 5"):
        flash_attention(q, k, v, causal=True, document_ids=decreasing)
    with pytest.raises(ValueError, match=r"document_ids has shape \(2, 7\), but q/k/v need \(batch, seq\) = \(2, 8\)"):
        flash_attention(q, k, v, causal=True, document_ids=ids[:, :7])
    with pytest.raises(ValueError, match="integer tensor"):
        flash_attention(q, k, v, causal=True, document_ids=ids.float())
    with pytest.raises(ValueError, match="query_document_ids has shape"):
        attention_block_forward(q, k, v, document_ids=ids, query_document_ids=ids[:1])
    with pytest.raises(ValueError, match=r"kv_offsets \[0, 3\] put the 8 queries"):
        flash_attention(q, k, v, causal=True, document_ids=ids, kv_offsets=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"kv_offsets must be an int or an integer tensor of shape \(batch,\)"):
        flash_attention(q, k, v, causal=True, kv_offsets=torch.tensor([0]))


def test_a_built_mask_is_checked_once_and_its_block_ranges_computed_once_for_every_layer(monkeypatch):
    # two "layers" attend with one DocumentMask: the ids are read once (when it is built), each kind of block range
    # is computed once (forward: query blocks; backward: key blocks, and query blocks again only if the backward's
    # block sizes differ), and the results are bit-equal to passing the ids to every call (same kernels, same ranges)
    from colo.kernels import build_document_mask
    from colo.kernels import document_mask as documents

    calls = []
    for name in ("_query_block_ranges", "_key_block_ranges"):
        compute = getattr(documents, name)
        monkeypatch.setattr(documents, name, lambda *args, _c=compute, _n=name: calls.append(_n) or _c(*args))
    check = documents.check_document_ids

    def counting_check(*args, check_values=True, **kwargs):
        calls.extend(["checked values"] if check_values else [])  # the host sync
        return check(*args, check_values=check_values, **kwargs)

    monkeypatch.setattr(documents, "check_document_ids", counting_check)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 2, 16, generator=generator).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 64, 2, 16, generator=generator)
    ids = torch.stack([_ids((5, 40, 19)), _ids((64,))])  # blocks of 32: two query blocks, two key blocks per row

    def two_layers(document_ids):
        out = flash_attention(q, k, v, causal=True, backend="triton", document_ids=document_ids)
        out = flash_attention(out, k, v, causal=True, backend="triton", document_ids=document_ids)
        return (out, *_grads(out, q, k, v, dout))

    per_call = two_layers(ids)
    assert calls.count("checked values") == 2 and calls.count("_query_block_ranges") == 4  # per call, fwd and bwd
    calls.clear()
    mask = build_document_mask(ids)
    assert calls == ["checked values"]
    shared = two_layers(mask)
    assert "checked values" not in calls[1:]
    assert sorted(set(calls[1:])) == ["_key_block_ranges", "_query_block_ranges"]
    assert len(calls[1:]) == len(mask.block_ranges) <= 3  # each (kind, causal, seq_q, seq_k, blocks) once
    for actual, expected in zip(shared, per_call):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_a_built_mask_of_other_shapes_or_with_separate_offsets_is_refused():
    from colo.kernels import build_document_mask

    q, k, v = (torch.randn(2, 8, 2, 16) for _ in range(3))
    mask = build_document_mask(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="query_document_ids / kv_offsets|holds the query ids and offsets"):
        flash_attention(q, k, v, causal=True, document_ids=mask, kv_offsets=0)
    with pytest.raises(ValueError, match=r"the DocumentMask is for keys of shape \(batch, seq_k\) = \(2, 8\)"):
        flash_attention(q[:, :4], k[:, :4], v[:, :4], causal=True, document_ids=mask)
    with pytest.raises(ValueError, match="build it with seq_q=4"):
        flash_attention(q[:, :4], k, v, causal=True, document_ids=mask)
    decreasing = torch.tensor([[0, 1, 0, 1]])
    with pytest.raises(ValueError, match="build_document_mask: document_ids must be non-decreasing"):
        build_document_mask(decreasing)
