"""The Triton cross-entropy matches the torch reference (loss and logits gradient), and the reference matches torch.

The Triton kernels run in Triton's interpreter on CPU (the conftest sets ``TRITON_INTERPRET=1``).
"""

import pytest
import torch
import torch.nn.functional as F

from colo.kernels import UnsupportedKernelInput, use_backend
from colo.kernels.cross_entropy import cross_entropy, cross_entropy_reference

# bf16 has 8 significant bits: one unit in the last place is at most 2**-7 of the value. The interpreter also
# rounds bf16 stores toward zero where torch rounds to nearest, so the two paths may differ by that one ulp.
BF16_ULP = 2**-7


def _inputs(num_tokens, vocab_size, dtype, *, seed=0, ignored=(3, 7)):
    generator = torch.Generator().manual_seed(seed)
    # a ramp puts each row's maximum in its last vocab block, so the online max is rescaled across blocks
    logits = 4 * torch.randn(num_tokens, vocab_size, generator=generator) + torch.linspace(0, 6, vocab_size)
    target = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
    target[list(ignored)] = -100
    return logits.to(dtype).requires_grad_(), target


def _loss_and_grad(fn, logits, target, **kwargs):
    loss = fn(logits, target, **kwargs)
    grad_output = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (grad,) = torch.autograd.grad(loss, logits, grad_output)
    return loss, grad


@pytest.mark.parametrize(
    "reduction, z_loss",
    [("mean", 0.0), ("mean", 1e-3), ("sum", 1e-3), ("none", 0.0)],
)
def test_triton_matches_reference_fp32(reduction, z_loss):
    # vocab 1000: not a power of two, four 256-wide blocks per row in the interpreter
    logits, target = _inputs(20, 1000, torch.float32)
    with use_backend("triton"):
        loss, grad = _loss_and_grad(cross_entropy, logits, target, reduction=reduction, z_loss=z_loss)
    expected_loss, expected_grad = _loss_and_grad(
        cross_entropy_reference, logits, target, reduction=reduction, z_loss=z_loss
    )
    # fp32 throughout; only the summation order of the logsumexp differs (blocks with an online max vs torch's)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert grad[[3, 7]].eq(0).all(), "ignored rows get zero gradient"


def test_triton_matches_reference_bf16():
    logits, target = _inputs(20, 513, torch.bfloat16)
    loss, grad = _loss_and_grad(cross_entropy, logits, target, z_loss=1e-3, backend="triton")
    expected_loss, expected_grad = _loss_and_grad(cross_entropy_reference, logits, target, z_loss=1e-3)
    # Both compute in fp32 from the same bf16 logits, so the fp32 loss agrees to fp32 rounding; the gradient is
    # rounded to bf16 by each path (to nearest in torch, toward zero in the interpreter): one bf16 ulp apart.
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), expected_grad.float(), rtol=BF16_ULP, atol=1e-9)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_matches_torch_cross_entropy(reduction):
    logits, target = _inputs(20, 513, torch.float32)
    torch.testing.assert_close(
        cross_entropy_reference(logits, target, reduction=reduction),
        F.cross_entropy(logits, target, reduction=reduction),
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_targets_ignored_gives_zero_loss_and_gradient(backend):
    logits, target = _inputs(6, 100, torch.float32, ignored=range(6))
    loss, grad = _loss_and_grad(cross_entropy, logits, target, z_loss=1e-3, backend=backend)
    assert loss.item() == 0.0  # F.cross_entropy gives NaN here: 0 / 0
    assert grad.eq(0).all()


def test_triton_rejects_unsupported_dtype():
    logits, target = _inputs(4, 64, torch.float64, ignored=())
    with pytest.raises(UnsupportedKernelInput, match="logits is torch.float64"):
        cross_entropy(logits, target, backend="triton")


def test_rejects_bad_shapes_and_reduction():
    logits, target = _inputs(4, 64, torch.float32, ignored=())
    with pytest.raises(ValueError, match="2-D"):
        cross_entropy(logits.view(2, 2, 64), target, backend="torch")
    with pytest.raises(ValueError, match="reduction='avg'"):
        cross_entropy(logits, target, reduction="avg", backend="torch")
