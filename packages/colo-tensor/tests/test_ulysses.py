"""Ulysses attention equals full attention, forward and backward, on sp=2 and sp=4; bad head counts fail early.

Each case draws the full q, k, v and output gradient, computes full attention and its gradients with
`colo.kernels.flash_attention_reference` in one process, and compares every rank's output and q/k/v gradients
with that rank's piece of the reference ones (`shard_sequence`: padded positions compare against zeros). Cases
cover causal and not, grouped-query attention with kv heads split over the ranks and with fewer kv heads than
ranks (repeated before the all-to-all), both sequence layouts, and lengths that need padding.

Tolerances: float32, rtol=1e-6, atol=1e-6 (measured: at most 1e-6 absolute). The all-to-alls move values without
arithmetic and the local attention is the reference itself, but on this rank's heads only, so its matmuls run
on other shapes and strides and block their sums differently; the kv-head repeat (fewer kv heads than ranks)
also sums its copies' gradients in another order than the reference's grouped-query sum.

Communication is asserted against the formula of `colo.tensor.ulysses`: forward one all-to-all each of q, k, v
(with kv heads repeated up to sp when there are fewer) and the output, each moving ``(sp - 1) / sp`` of the
tensor; the backward the same again.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.kernels import flash_attention_reference
from colo.tensor import shard_sequence, ulysses_attention

TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}
BATCH, HEAD_DIM = 2, 8

# (causal, num_heads, num_kv_heads, seq_len, layout)
CASES = {
    2: [
        (True, 4, 2, 16, "contiguous"),  # kv heads split
        (False, 4, 1, 11, "contiguous"),  # fewer kv heads than ranks; padded to 12
        (True, 4, 4, 13, "zigzag"),  # padded to 16
        (False, 2, 2, 8, "zigzag"),
    ],
    4: [
        (True, 8, 4, 16, "contiguous"),
        (False, 4, 2, 10, "contiguous"),  # kv heads repeated twice; padded to 12
        (True, 4, 1, 13, "zigzag"),  # kv head repeated four times; padded to 16
        (False, 4, 4, 24, "zigzag"),
    ],
}


def _inputs(case, seed):
    causal, num_heads, num_kv_heads, seq_len, layout = case
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq_len, num_heads, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, seq_len, num_kv_heads, HEAD_DIM, generator=generator) for _ in range(2))
    dout = torch.randn(BATCH, seq_len, num_heads, HEAD_DIM, generator=generator)
    return q, k, v, dout


def _check_against_full_attention(cases):
    mesh = Mesh(sp=torch.distributed.get_world_size())
    group, n, rank = mesh.group("sp"), mesh.size("sp"), mesh.rank("sp")
    mismatches = []
    for index, case in enumerate(cases):
        causal, num_heads, num_kv_heads, seq_len, layout = case
        q, k, v, dout = _inputs(case, seed=index)
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        reference_out = flash_attention_reference(*full, causal=causal)
        reference_out.backward(dout)
        expected = (reference_out.detach(), *(t.grad for t in full))

        def piece(t, layout=layout):
            return shard_sequence(t, num_shards=n, rank=rank, layout=layout)

        local = [piece(t).requires_grad_(True) for t in (q, k, v)]
        with CommTracker() as forward:
            out = ulysses_attention(
                *local,
                group=group,
                causal=causal,
                layout=layout,
                seq_len=seq_len,
                attention_fn=flash_attention_reference,
            )
        with CommTracker() as backward:
            out.backward(piece(dout))
        got = (out.detach(), *(t.grad for t in local))
        for name, value, reference in zip(("out", "dq", "dk", "dv"), got, expected):
            try:
                torch.testing.assert_close(value, piece(reference), **TOLERANCE)
            except AssertionError as error:
                mismatches.append(f"case {case} {name}: {error}")

        local_len = local[0].shape[1]
        moved_heads = 2 * num_heads + 2 * max(num_kv_heads, n)  # q, output, and k, v (repeated up to sp heads)
        volume = (n - 1) / n * BATCH * local_len * moved_heads * HEAD_DIM * 4
        for what, tracker in (("forward", forward), ("backward", backward)):
            measured = (tracker.calls("all_to_all", axis="sp"), tracker.bytes("all_to_all", axis="sp"))
            if measured != (4, volume) or tracker.calls() != 4:
                mismatches.append(f"case {case} {what}: measured {measured} of {tracker.calls()}, formula {volume}")
    return mismatches


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_matches_full_attention_forward_and_backward(sp):
    for rank, mismatches in enumerate(run_distributed(_check_against_full_attention, CASES[sp], world_size=sp)):
        assert mismatches == [], f"rank {rank}:\n" + "\n".join(mismatches[:5])


def _bad_heads():
    group = Mesh(sp=torch.distributed.get_world_size()).group("sp")
    errors = []
    with CommTracker() as tracker:
        for num_heads, num_kv_heads in ((6, 6), (6, 3)):
            q = torch.randn(1, 4, num_heads, 8)
            k = v = torch.randn(1, 4, num_kv_heads, 8)
            try:
                ulysses_attention(q, k, v, group=group)
            except ValueError as error:
                errors.append(str(error))
    return errors, tracker.calls()


def test_heads_not_divisible_by_sp_fail_before_any_all_to_all():
    for errors, calls in run_distributed(_bad_heads, world_size=4):
        assert calls == 0
        assert len(errors) == 2
        assert "num_heads=6 does not divide by sp=4" in errors[0] and "choose sp in [1, 2, 3, 6]" in errors[0]
        assert "num_heads=6 does not divide by sp=4" in errors[1]


def _bad_kv_heads():
    group = Mesh(sp=2).group("sp")
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 3, 8)
    with CommTracker() as tracker:
        try:
            ulysses_attention(q, k, k, group=group)
        except ValueError as error:
            return str(error), tracker.calls()
    return None, tracker.calls()


def test_kv_heads_that_span_two_ranks_fail_before_any_all_to_all():
    for error, calls in run_distributed(_bad_kv_heads, world_size=2):
        assert calls == 0
        assert (
            error is not None and "sp=2 neither divides num_kv_heads=3" in error and "choose sp in [1, 3, 6]" in error
        )
