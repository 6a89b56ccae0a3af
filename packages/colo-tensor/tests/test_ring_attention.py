"""Ring attention equals full attention, forward and backward, on sp=2 and sp=4; zigzag balances the work.

Each case draws the full q, k, v and output gradient, computes full attention and its gradients with
`colo.kernels.flash_attention_reference` in one process, and compares every rank's output and q/k/v gradients
with that rank's piece of the reference ones (`shard_sequence`: padded positions compare against zeros). Cases
cover causal and not, grouped-query attention (kv heads shared by 2 and 4 query heads), the zigzag and the
contiguous layout, and sequence lengths that are and are not multiples of the number of chunks (the sequence is
padded at its end and ``seq_len`` masks the padding).

Tolerances: float32, rtol=1e-5, atol=2e-6. Not bit-identical: the reference takes one softmax over all keys;
ring attention takes one per block and merges them with the log-sum-exp (exp(lse_i - lse) rescaling), and sums
dq and dK/dV over blocks, so the same sums are rounded in another order (measured: at most 1e-6 absolute, on
values of order 1).

Communication is asserted against the formula of `colo.tensor.ring_attention`, with each block's travel taken from
the full attention mask (`expected_ring_volume`, independent of the plan ring attention makes): a block goes as far
around the ring as the farthest rank whose queries see one of its keys (causal contiguous: the last rank's block
stays home; chunks of padding only: nowhere); its dK/dV accumulator follows it and comes back from its last holder.
Unmasked, that is ``n - 1`` sends of this rank's k and v forward, ``n - 1`` again plus ``n`` fp32 accumulators
backward.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.kernels import flash_attention_reference
from colo.tensor import (
    gather_sequence,
    padded_seq_len,
    ring_attention,
    ring_attention_calls,
    shard_positions,
    shard_sequence,
)

ring_module = importlib.import_module("colo.tensor.ring_attention")  # the package's `ring_attention` is the function
TOLERANCE = {"rtol": 1e-5, "atol": 2e-6}
BATCH, HEAD_DIM = 2, 8

# (causal, num_heads, num_kv_heads, seq_len, layout)
CASES = {
    2: [
        (True, 4, 2, 16, "zigzag"),  # multiple of 2 * sp
        (True, 4, 1, 13, "zigzag"),  # padded to 16
        (False, 4, 4, 12, "zigzag"),
        (False, 4, 2, 11, "zigzag"),  # padded keys must be masked
        (True, 4, 4, 10, "contiguous"),
        (False, 2, 1, 9, "contiguous"),  # padded to 10
    ],
    4: [
        (True, 4, 2, 16, "zigzag"),
        (True, 4, 1, 13, "zigzag"),  # padded to 16: the last chunk holds one real token
        (False, 4, 4, 19, "zigzag"),  # padded to 24
        (True, 2, 2, 5, "zigzag"),  # padded to 8: chunks 5, 6, 7 are all padding
        (False, 4, 1, 8, "contiguous"),
        (True, 4, 2, 30, "zigzag", "short"),  # packed documents of 1-6 tokens
        (True, 2, 2, 32, "contiguous", "short"),  # a block goes only where its documents reach
    ],
}


def _documents(case):
    """Document ids of the whole sequence for a case that packs documents (``None``: one per row): row 0 packs
    documents of 1-6 tokens, row 1 of 2-5 (each row's documents differ, so a block step runs where either meets)."""
    if len(case) < 6:
        return None
    seq_len = case[3]
    rows = []
    for lengths in ((3, 6, 1, 4, 2, 5), (2, 5, 3, 4)):
        rows.append(torch.cat([torch.full((length,), index) for index, length in enumerate(lengths * 8)])[:seq_len])
    return torch.stack(rows)


def _inputs(case, seed):
    causal, num_heads, num_kv_heads, seq_len, layout = case[:5]
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq_len, num_heads, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, seq_len, num_kv_heads, HEAD_DIM, generator=generator) for _ in range(2))
    dout = torch.randn(BATCH, seq_len, num_heads, HEAD_DIM, generator=generator)
    return q, k, v, dout


def _reference(q, k, v, dout, causal, document_ids=None):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attention_reference(q, k, v, causal=causal, document_ids=document_ids)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def expected_ring_volume(n, rank, layout, seq_len, causal, document_ids=None) -> dict[str, tuple[int, int]]:
    """``{"forward": (sends, receives), "kv": ..., "dkv": ...}`` of ``rank``'s blocks (counts), from the full mask:
    block ``s`` travels ``d(s)`` hops, the ring distance to the farthest rank with a query that sees one of its
    keys; rank ``r`` passes on the block it holds at step ``t`` while ``t < d(r - t)``; backward, each holder sends
    the block's accumulator on, the last one (``d > 0``) home."""
    padded = padded_seq_len(seq_len, n, layout)
    i = torch.arange(padded)
    mask = (i[:, None] < seq_len) & (i[None, :] < seq_len)
    if causal:
        mask = mask & (i[None, :] <= i[:, None])
    if document_ids is None:
        masks = mask[None]
    else:
        ids = torch.nn.functional.pad(document_ids, (0, padded - document_ids.shape[1]), mode="replicate")
        masks = mask & (ids[:, :, None] == ids[:, None, :])
    held = [shard_positions(seq_len, n, r, layout) for r in range(n)]
    travel = [
        max(((r - s) % n for r in range(n) if masks[:, held[r]][:, :, held[s]].any()), default=0) for s in range(n)
    ]
    kv = (
        sum(t < travel[(rank - t) % n] for t in range(n)),
        sum(t < travel[(rank - 1 - t) % n] for t in range(n)),
    )
    dkv = (
        sum(t <= travel[(rank - t) % n] and travel[(rank - t) % n] > 0 for t in range(n)),
        sum(t < travel[(rank - 1 - t) % n] for t in range(n)) + (travel[rank] > 0),
    )
    return {"forward": kv, "kv": kv, "dkv": dkv}


def _check_volumes(forward, backward, kv_bytes, expected, name, mismatches):
    """Compare the trackers' p2p counts and bytes with `expected_ring_volume` (fp32: an accumulator is kv_bytes)."""
    wanted = {
        "forward": [expected["forward"][0], expected["forward"][1]],
        "backward": [expected["kv"][0] + expected["dkv"][0], expected["kv"][1] + expected["dkv"][1]],
    }
    for what, tracker in (("forward", forward), ("backward", backward)):
        for op, count in zip(("send", "recv"), wanted[what], strict=True):
            measured = (tracker.calls(op, axis="sp"), tracker.bytes(op, axis="sp"))
            if measured != (count, count * kv_bytes):
                mismatches.append(f"{name} {what} {op}: measured {measured}, expected {(count, count * kv_bytes)}")
        if tracker.calls() != sum(wanted[what]):
            mismatches.append(f"{name} {what}: {tracker.calls()} calls in all, expected {sum(wanted[what])}")


def _check_against_full_attention(cases):
    mesh = Mesh(sp=torch.distributed.get_world_size())
    group, n, rank = mesh.group("sp"), mesh.size("sp"), mesh.rank("sp")
    mismatches = []
    for index, case in enumerate(cases):
        causal, _, _, seq_len, layout = case[:5]
        ids = _documents(case)
        q, k, v, dout = _inputs(case, seed=index)
        expected = _reference(q, k, v, dout, causal, ids)

        def piece(t, layout=layout):
            return shard_sequence(t, num_shards=n, rank=rank, layout=layout)

        local = [piece(t).requires_grad_(True) for t in (q, k, v)]
        with CommTracker() as forward:
            out = ring_attention(*local, group=group, causal=causal, layout=layout, seq_len=seq_len, document_ids=ids)
        with CommTracker() as backward:
            out.backward(piece(dout))
        got = (out.detach(), *(t.grad for t in local))
        for name, value, reference in zip(("out", "dq", "dk", "dv"), got, expected):
            try:
                torch.testing.assert_close(value, piece(reference), **TOLERANCE)
            except AssertionError as error:
                mismatches.append(f"case {case} {name}: {error}")

        kv_bytes = 2 * local[1].numel() * 4  # k and v, fp32; the dK/dV accumulators are fp32 too
        expected_volume = expected_ring_volume(n, rank, layout, seq_len, causal, ids)
        if ids is not None:  # short documents: fewer sends around the ring than unmasked (n - 1 per rank forward)
            sends = sum(expected_ring_volume(n, r, layout, seq_len, causal, ids)["forward"][0] for r in range(n))
            # contiguous: rank 0's block alone travels (one hop): in both rows a document crosses position 8, while
            # 16 and 24 start documents. zigzag: 9 of 12 (rank r's chunk 2n-1-r meets 2n-2-r, held n-1 hops on)
            assert sends == (1 if layout == "contiguous" else 9), sends
        elif seq_len == padded_seq_len(seq_len, n, layout) and not (causal and layout == "contiguous"):
            assert expected_volume == {"forward": (n - 1, n - 1), "kv": (n - 1, n - 1), "dkv": (n, n)}  # unmasked
        _check_volumes(forward, backward, kv_bytes, expected_volume, f"case {case}", mismatches)
        gathered = gather_sequence(out.detach(), group=group, layout=layout, seq_len=seq_len)
        if not torch.equal(piece(gathered), out.detach()):
            mismatches.append(f"case {case}: gather_sequence does not invert shard_sequence")
    return mismatches


@pytest.mark.parametrize("sp", [2, 4])
def test_ring_attention_matches_full_attention_forward_and_backward(sp):
    for rank, mismatches in enumerate(run_distributed(_check_against_full_attention, CASES[sp], world_size=sp)):
        assert mismatches == [], f"rank {rank}:\n" + "\n".join(mismatches[:5])


def _visible(q_len, k_len, causal):
    """Score entries a block step computes: all of them, or those under the bottom-right aligned causal mask."""
    if not causal:
        return q_len * k_len
    return sum(min(k_len, max(0, i + 1 + k_len - q_len)) for i in range(q_len))


def _count_work(layout, seq_len):
    """Run causal ring attention forward and backward, counting the block steps this rank computes."""
    mesh = Mesh(sp=torch.distributed.get_world_size())
    group, n, rank = mesh.group("sp"), mesh.size("sp"), mesh.rank("sp")
    counted = {"forward": [], "backward": []}
    forward_step, backward_step = ring_module.attention_block_forward, ring_module.attention_block_backward

    def forward_counting(q, k, v, **kwargs):
        counted["forward"].append((q.shape[1], k.shape[1], kwargs["causal"]))
        return forward_step(q, k, v, **kwargs)

    def backward_counting(dout, q, k, v, out, lse, **kwargs):
        counted["backward"].append((q.shape[1], k.shape[1], kwargs["causal"]))
        return backward_step(dout, q, k, v, out, lse, **kwargs)

    ring_module.attention_block_forward, ring_module.attention_block_backward = forward_counting, backward_counting
    try:
        q, k, v, dout = _inputs((True, 2, 1, seq_len, layout), seed=0)
        local = [shard_sequence(t, num_shards=n, rank=rank, layout=layout).requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*local, group=group, causal=True, layout=layout)
        out.backward(shard_sequence(dout, num_shards=n, rank=rank, layout=layout))
    finally:
        ring_module.attention_block_forward, ring_module.attention_block_backward = forward_step, backward_step
    chunk = seq_len // (2 * n if layout == "zigzag" else n)
    return {
        what: {
            "chunk_pairs": sum(k_len for _, k_len, _ in calls) / chunk,  # (query chunk, key chunk) pairs computed
            "diagonal_pairs": sum(causal for _, _, causal in calls),
            "visible_scores": sum(_visible(*call) for call in calls),
        }
        for what, calls in counted.items()
    }


@pytest.mark.parametrize("sp", [2, 4])
def test_zigzag_gives_every_rank_equal_attention_work(sp):
    seq_len = 8 * sp
    zigzag = run_distributed(_count_work, "zigzag", seq_len, world_size=sp)
    chunk = seq_len // (2 * sp)
    # every rank: 2 sp - 1 full (query chunk, key chunk) pairs and 2 diagonal ones, forward and backward alike
    expected_pairs = {"chunk_pairs": 2 * sp + 1, "diagonal_pairs": 2}
    for rank, work in enumerate(zigzag):
        assert work["forward"] == work["backward"]
        assert {key: work["forward"][key] for key in expected_pairs} == expected_pairs, f"rank {rank}: {work}"
        assert work["forward"]["visible_scores"] == (2 * sp - 1) * chunk * chunk + 2 * chunk * (chunk + 1) // 2
    # the contiguous split is what zigzag fixes: rank r computes r full pairs and one diagonal pair
    contiguous = run_distributed(_count_work, "contiguous", seq_len, world_size=sp)
    assert [work["forward"]["chunk_pairs"] for work in contiguous] == [r + 1 for r in range(sp)]


@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
def test_zigzag_plan_is_balanced_for_any_ring_size(sp):
    """The plan of block steps alone (no ranks): every rank sees every chunk once, with equal causal work."""
    work = []
    for rank in range(sp):
        calls = [
            call
            for source in range(sp)
            for call in ring_attention_calls(sp, rank, source, causal=True, layout="zigzag")
        ]
        work.append((sum(len(keys) for _, keys, _ in calls), sum(causal for _, _, causal in calls)))
        every_pair = [
            len(keys)
            for source in range(sp)
            for _, keys, _ in ring_attention_calls(sp, rank, source, causal=False, layout="zigzag")
        ]
        assert sum(every_pair) == 2 * (2 * sp)  # non-causal: both query chunks see all 2 sp key chunks
    assert work == [(2 * sp + 1, 2)] * sp


def test_shard_sequence_pads_and_splits_zigzag():
    x = torch.arange(10).reshape(1, 10)
    assert padded_seq_len(10, 2, "zigzag") == 12
    pieces = [shard_sequence(x, num_shards=2, rank=r, layout="zigzag").tolist() for r in range(2)]
    # 12 positions in 4 chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; 10 and 11 are padding
    assert pieces == [[[0, 1, 2, 9, 0, 0]], [[3, 4, 5, 6, 7, 8]]]
    assert shard_sequence(x, num_shards=4, rank=3, layout="contiguous").tolist() == [[9, 0, 0]]


def _bad_inputs():
    group = Mesh(sp=2).group("sp")
    q, k, v = (torch.randn(1, 3, 2, 4) for _ in range(3))
    errors = []
    with CommTracker() as tracker:
        for kwargs in (
            {"layout": "zigzag"},  # 3 local positions cannot be two zigzag chunks
            {"layout": "contiguous", "seq_len": 9},  # 2 shards of 3 hold 6 positions, not 9
            {"layout": "diagonal"},
        ):
            try:
                ring_attention(q, k, v, group=group, **kwargs)
            except ValueError as error:
                errors.append(str(error))
        try:
            ring_attention(q, k[:, :2], v[:, :2], group=group, layout="contiguous")
        except ValueError as error:
            errors.append(str(error))
    return errors, tracker.calls()


def test_ring_attention_rejects_bad_input_before_communicating():
    for errors, calls in run_distributed(_bad_inputs, world_size=2):
        assert calls == 0
        assert len(errors) == 4
        assert "pad the global sequence to a multiple of 2 * sp" in errors[0]
        assert "seq_len=9" in errors[1]
        assert "layout='diagonal'" in errors[2]
        assert "must agree on batch, local sequence" in errors[3]


def _gather_gradients(layout: str) -> list[str]:
    """gather_sequence's two backwards against autograd of one process over every rank's loss: ``sum_grad`` sums
    the ranks' gradients of the whole sequence (each rank's loss a term of a sum over the group), the default keeps
    this rank's part of its own."""
    mesh = Mesh(sp=torch.distributed.get_world_size())
    group, n, rank = mesh.group("sp"), mesh.size("sp"), mesh.rank("sp")
    seq_len = 11  # padded to 12 (zigzag: 4 chunks of 3) or 12 (contiguous: 2 of 6)
    generator = torch.Generator().manual_seed(5)
    whole = torch.randn(3, seq_len, generator=generator)
    weights = torch.randn(n, 3, seq_len, generator=generator)  # rank r's loss: sum(weights[r] * gathered)
    mismatches = []
    for sum_grad in (False, True):
        local = shard_sequence(whole, num_shards=n, rank=rank, layout=layout).requires_grad_(True)
        gathered = gather_sequence(local, group=group, layout=layout, seq_len=seq_len, sum_grad=sum_grad)
        if not torch.equal(gathered.detach(), whole):
            mismatches.append(f"sum_grad={sum_grad}: the gathered sequence differs")
        (weights[rank] * gathered).sum().backward()
        grad = weights.sum(0) if sum_grad else weights[rank]
        expected = shard_sequence(grad, num_shards=n, rank=rank, layout=layout)
        if not torch.allclose(local.grad, expected, rtol=1e-6, atol=1e-6):
            mismatches.append(f"sum_grad={sum_grad}: gradient {local.grad} vs {expected}")
    return mismatches


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_gather_sequence_backward_keeps_or_sums_the_ranks_gradients(layout):
    for rank, mismatches in enumerate(run_distributed(_gather_gradients, layout, world_size=2)):
        assert mismatches == [], f"rank {rank}: {mismatches}"
