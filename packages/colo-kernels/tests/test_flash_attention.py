"""Triton flash attention and its ring-attention block step match explicit-softmax attention, forward and backward.

The Triton kernels run in Triton's interpreter on CPU with 32 x 32 blocks, so the sequence lengths below (20 to
45) span one to two partial blocks.
"""

import pytest
import torch
import torch.nn.functional as F

from colo.kernels import UnsupportedKernelInput, use_backend
from colo.kernels.flash_attention import (
    attention_block_backward,
    attention_block_forward,
    flash_attention,
    flash_attention_reference,
)

BF16_ULP = 2**-7  # bf16 keeps 8 significant bits: one ulp is at most 2**-7 of the value

# (batch, seq_q, seq_k, heads_q, heads_kv, head_dim, causal)
CASES = {
    "full": (2, 37, 37, 2, 2, 16, False),
    "gqa-causal": (1, 37, 37, 4, 2, 32, True),
    "causal-q-shorter": (1, 20, 45, 4, 2, 16, True),
    "causal-q-longer": (1, 45, 20, 2, 1, 16, True),  # the first 25 queries see no key: output 0, zero gradient
    "head-dim-64": (1, 33, 33, 2, 2, 64, True),
}


def _qkv(batch, seq_q, seq_k, heads_q, heads_kv, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()

    q = make(batch, seq_q, heads_q, head_dim)
    k = make(batch, seq_k, heads_kv, head_dim)
    v = make(batch, seq_k, heads_kv, head_dim)
    dout = torch.randn(batch, seq_q, heads_q, head_dim, generator=generator).to(dtype)
    return q, k, v, dout


def _out_and_grads(fn, q, k, v, dout, **kwargs):
    out = fn(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference_fp32(case):
    batch, seq_q, seq_k, heads_q, heads_kv, head_dim, causal = CASES[case]
    q, k, v, dout = _qkv(batch, seq_q, seq_k, heads_q, heads_kv, head_dim, torch.float32)
    with use_backend("triton"):
        results = _out_and_grads(flash_attention, q, k, v, dout, causal=causal)
    expected = _out_and_grads(flash_attention_reference, q, k, v, dout, causal=causal)
    # fp32 both ways, but the kernel's softmax is online (rescaled per key block, exp2 of log2-scaled scores) and its
    # backward forms dS = P * (dP - rowsum(dO * O)), a difference of nearly equal terms, from recomputed P: errors
    # of a few 1e-7 relative to the largest entry are expected; 1e-5 leaves margin without hiding a masking bug.
    for name, actual, reference in zip(("out", "dq", "dk", "dv"), results, expected):
        assert torch.isfinite(actual).all(), name
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item(), msg=name)
    if case == "causal-q-longer":
        assert results[0][:, : seq_q - seq_k].eq(0).all() and results[1][:, : seq_q - seq_k].eq(0).all()


@pytest.mark.parametrize("case", ["gqa-causal", "causal-q-longer"])
def test_triton_matches_reference_bf16(case):
    batch, seq_q, seq_k, heads_q, heads_kv, head_dim, causal = CASES[case]
    q, k, v, dout = _qkv(batch, seq_q, seq_k, heads_q, heads_kv, head_dim, torch.bfloat16)
    results = _out_and_grads(flash_attention, q, k, v, dout, causal=causal, backend="triton")
    expected = _out_and_grads(flash_attention_reference, q, k, v, dout, causal=causal)
    # Both compute in fp32 from the same bf16 inputs and round the result to bf16 (torch to nearest, the
    # interpreter toward zero): one ulp apart. The kernel's backward also reads the bf16-rounded output in
    # rowsum(dO * O), where the reference uses the exact fp32 output: a relative error of 2**-8 in a term that
    # cancels against dP, so the gradients get an absolute error of about one ulp of their largest entries.
    for name, actual, reference in zip(("out", "dq", "dk", "dv"), results, expected):
        assert actual.dtype == torch.bfloat16, name
        reference = reference.float()
        torch.testing.assert_close(
            actual.float(), reference, rtol=BF16_ULP, atol=BF16_ULP * reference.abs().max().item(), msg=name
        )


@pytest.mark.parametrize("seq_q, seq_k", [(37, 37), (20, 45)])
def test_reference_and_triton_match_torch_sdpa(seq_q, seq_k):
    q, k, v, _ = _qkv(2, seq_q, seq_k, 4, 2, 16, torch.float32)
    # bottom-right aligned causal mask, spelled out (SDPA's is_causal is top-left aligned when seq_q != seq_k)
    mask = torch.ones(seq_q, seq_k, dtype=torch.bool).tril(diagonal=seq_k - seq_q)
    with torch.no_grad():
        sdpa = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)
        reference = flash_attention_reference(q, k, v, causal=True)
        triton_out = flash_attention(q, k, v, causal=True, backend="triton")
    torch.testing.assert_close(reference, sdpa, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(triton_out, sdpa, rtol=1e-5, atol=1e-5)


def _merge(block_results):
    """Merge per-block ``(out, lse)`` with the global logsumexp, as ring attention does."""
    lse = torch.logsumexp(torch.stack([lse_i for _, lse_i in block_results]), dim=0)
    out = sum(torch.exp(lse_i - lse).transpose(1, 2).unsqueeze(-1) * out_i for out_i, lse_i in block_results)
    return out, lse


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_step_merged_over_two_kv_blocks_equals_full_attention(backend, causal):
    """Ring attention for the second half of a sequence: keys in two blocks, the earlier one fully visible.

    Non-causal: the two key blocks are just split. Causal: the queries are positions 32..63 of a causal sequence
    of 64, so they see all of keys 0..31 (a non-causal block) and keys 32..63 causally (a square causal block);
    the full reference is causal attention of the 32 queries over all 64 keys (bottom-right aligned).
    """
    q, k, v, dout = _qkv(1, 32, 64, 4, 2, 16, torch.float32)
    blocks = [(slice(0, 32), False), (slice(32, 64), causal)]
    results = [attention_block_forward(q, k[:, s], v[:, s], causal=c, backend=backend) for s, c in blocks]
    out, lse = _merge(results)
    expected_out, *expected_grads = _out_and_grads(flash_attention_reference, q, k, v, dout, causal=causal)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)

    grads = [
        attention_block_backward(dout, q, k[:, s], v[:, s], out, lse, causal=c, backend=backend) for s, c in blocks
    ]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], dim=1)
    dv = torch.cat([grads[0][2], grads[1][2]], dim=1)
    # fp32; the block path merges two partial softmaxes and adds dq from two blocks: a different summation order
    for name, actual, reference in zip(("dq", "dk", "dv"), (dq, dk, dv), expected_grads):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item(), msg=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_block_rows_that_see_no_key_give_zero_output_and_minus_inf_lse(backend):
    q, k, v, dout = _qkv(1, 40, 8, 2, 2, 16, torch.float32)
    out, lse = attention_block_forward(q, k, v, causal=True, backend=backend)
    assert lse.shape == (1, 2, 40) and lse.dtype == torch.float32
    hidden_rows = 40 - 8  # query i sees keys j <= i - 32
    assert torch.isneginf(lse[:, :, :hidden_rows]).all() and torch.isfinite(lse[:, :, hidden_rows:]).all()
    assert out[:, :hidden_rows].eq(0).all()
    # merged with a block every row sees, the empty rows weigh exp(-inf - lse) = 0: no NaN, the other block wins
    other_out, other_lse = attention_block_forward(q, v, k, causal=False, backend=backend)
    merged_out, merged_lse = _merge([(out, lse), (other_out, other_lse)])
    torch.testing.assert_close(merged_out[:, :hidden_rows], other_out[:, :hidden_rows])
    torch.testing.assert_close(merged_lse[:, :, :hidden_rows], other_lse[:, :, :hidden_rows])
    dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, causal=True, backend=backend)
    assert all(torch.isfinite(grad).all() for grad in (dq, dk, dv))
    assert dq[:, :hidden_rows].eq(0).all()


def test_block_step_matches_between_backends():
    q, k, v, dout = _qkv(2, 37, 45, 4, 1, 32, torch.float32)
    out, lse = attention_block_forward(q, k, v, causal=True, scale=0.3, backend="triton")
    expected_out, expected_lse = attention_block_forward(q, k, v, causal=True, scale=0.3, backend="torch")
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    grads = attention_block_backward(dout, q, k, v, out, lse, causal=True, scale=0.3, backend="triton")
    expected = attention_block_backward(dout, q, k, v, out, lse, causal=True, scale=0.3, backend="torch")
    for actual, reference in zip(grads, expected):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_rejects_unsupported_inputs():
    q, k, v, _ = _qkv(1, 8, 8, 4, 2, 24, torch.float32)
    with pytest.raises(UnsupportedKernelInput, match="head_dim=24"):
        flash_attention(q, k, v, backend="triton")
    q, k, v, _ = _qkv(1, 8, 8, 3, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="heads_q=3 is not a multiple of heads_kv=2"):
        flash_attention(q, k, v, backend="torch")
    q, k, v, _ = _qkv(1, 8, 8, 2, 2, 16, torch.float64)
    with pytest.raises(UnsupportedKernelInput, match="q is torch.float64"):
        flash_attention(q, k, v, backend="triton")
