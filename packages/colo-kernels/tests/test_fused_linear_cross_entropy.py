"""Chunked linear + cross-entropy equals the naive full-logits loss and gradients, without holding the full logits.

Both backends are the chunked algorithm (the Triton one runs the cross-entropy kernel per chunk in Triton's
interpreter on CPU); the reference computes ``hidden @ weight.T`` in one piece.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colo.kernels import UnsupportedKernelInput
from colo.kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)

NUM_TOKENS, HIDDEN, VOCAB = 40, 32, 257  # 40 tokens in chunks of 16: the last chunk is partial
BF16_ULP = 2**-7  # bf16 keeps 8 significant bits: one ulp is at most 2**-7 of the value


def _inputs(dtype, *, bias=True, seed=0, ignored=(0, 5, 17, 39)):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5
    bias_ = torch.randn(VOCAB, generator=generator) if bias else None
    target = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=generator)
    target[list(ignored)] = -100
    params = [t.to(dtype).requires_grad_() for t in (hidden, weight, bias_) if t is not None]
    return params, target


def _loss_and_grads(fn, params, target, **kwargs):
    hidden, weight, *bias = params
    loss = fn(hidden, weight, target, bias=bias[0] if bias else None, **kwargs)
    grads = torch.autograd.grad(loss * 3.0, params)  # grad_output 3: the stored gradients are scaled
    return loss, grads


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bias, z_loss", [(True, 1e-3), (False, 0.0)])
def test_matches_reference_fp32(backend, bias, z_loss):
    params, target = _inputs(torch.float32, bias=bias)
    loss, grads = _loss_and_grads(
        fused_linear_cross_entropy, params, target, z_loss=z_loss, chunk_size=16, backend=backend
    )
    expected_loss, expected_grads = _loss_and_grads(fused_linear_cross_entropy_reference, params, target, z_loss=z_loss)
    # fp32; grad_weight and grad_bias are summed chunk by chunk instead of in one matmul: a different order
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_matches_reference_bf16(backend):
    params, target = _inputs(torch.bfloat16)
    loss, grads = _loss_and_grads(fused_linear_cross_entropy, params, target, chunk_size=16, backend=backend)
    expected_loss, expected_grads = _loss_and_grads(fused_linear_cross_entropy_reference, params, target)
    # Same bf16 logits, cross-entropy in fp32 on both sides: the loss agrees to fp32 rounding.
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    # The bf16 logit gradients may differ by one ulp (the interpreter rounds stores toward zero; the stored
    # gradients are rounded before, not after, the grad_output scaling), and grad_weight is rounded to bf16 once
    # per chunk (3 chunks) rather than once. A gradient entry is a sum of many such terms, so its error is bounded
    # by ulps of its largest terms, not of the (possibly cancelled) sum: rtol one ulp, atol one ulp of the largest
    # entry (the observed worst case needs about 0.4 ulp of atol).
    for grad, expected in zip(grads, expected_grads):
        assert grad.dtype == torch.bfloat16
        expected = expected.float()
        torch.testing.assert_close(grad.float(), expected, rtol=BF16_ULP, atol=BF16_ULP * expected.abs().max().item())


def test_reference_is_torch_cross_entropy_of_full_logits():
    (hidden, weight, bias), target = _inputs(torch.float32)
    torch.testing.assert_close(
        fused_linear_cross_entropy_reference(hidden, weight, target, bias=bias),
        F.cross_entropy(hidden @ weight.T + bias, target),
    )


class _LargestBuffer(TorchDispatchMode):
    """Records the largest storage (in bytes) behind any tensor an op returns: an upper bound on one allocation."""

    def __init__(self):
        super().__init__()
        self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.largest_bytes = max(self.largest_bytes, item.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_never_allocates_the_full_logits(backend):
    num_tokens, hidden_size, vocab_size, chunk_size = 64, 16, 500, 16
    hidden = torch.randn(num_tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab_size, hidden_size, requires_grad=True)
    target = torch.randint(0, vocab_size, (num_tokens,))
    full_logits_bytes = num_tokens * vocab_size * 4

    with _LargestBuffer() as naive:
        fused_linear_cross_entropy_reference(hidden, weight, target).backward()
    assert naive.largest_bytes >= full_logits_bytes  # the tracker sees the naive path's logits

    with _LargestBuffer() as chunked:
        fused_linear_cross_entropy(hidden, weight, target, chunk_size=chunk_size, backend=backend).backward()
    # The largest buffers are one chunk of fp32 logits (the interpreter copies it too) and grad_weight.
    assert chunked.largest_bytes <= max(chunk_size * vocab_size, vocab_size * hidden_size) * 4
    assert chunked.largest_bytes < full_logits_bytes


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_targets_ignored_gives_zero_loss_and_gradients(backend):
    params, target = _inputs(torch.float32, ignored=range(NUM_TOKENS))
    loss, grads = _loss_and_grads(fused_linear_cross_entropy, params, target, backend=backend)
    assert loss.item() == 0.0
    assert all(grad.eq(0).all() for grad in grads)


def test_frozen_weight_and_no_grad():
    (hidden, weight), target = _inputs(torch.float32, bias=False)
    weight.requires_grad_(False)
    loss = fused_linear_cross_entropy(hidden, weight, target, chunk_size=16, backend="triton")
    (grad_hidden,) = torch.autograd.grad(loss, hidden)
    expected = fused_linear_cross_entropy_reference(hidden, weight, target)
    (expected_grad_hidden,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(grad_hidden, expected_grad_hidden, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(
            fused_linear_cross_entropy(hidden, weight, target, backend="triton"), expected, rtol=1e-5, atol=1e-6
        )


def test_accepts_batch_and_sequence_dims():
    (hidden, weight), target = _inputs(torch.float32, bias=False)
    loss = fused_linear_cross_entropy(hidden.view(4, 10, HIDDEN), weight, target.view(4, 10), backend="torch")
    torch.testing.assert_close(loss, fused_linear_cross_entropy_reference(hidden, weight, target))


def test_rejects_bad_inputs():
    (hidden, weight), target = _inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="target must have shape"):
        fused_linear_cross_entropy(hidden, weight, target[:-1], backend="torch")
    with pytest.raises(ValueError, match="chunk_size=0"):
        fused_linear_cross_entropy(hidden, weight, target, chunk_size=0, backend="torch")
    with pytest.raises(UnsupportedKernelInput, match="hidden is torch.float64"):
        fused_linear_cross_entropy(hidden.double(), weight.double(), target, backend="triton")
