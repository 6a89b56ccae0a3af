"""The Triton RMSNorm (run by Triton's interpreter on CPU) equals the torch reference, forward and backward."""

import pytest
import torch

from colo.kernels.dispatch import UnsupportedKernelInput
from colo.kernels.rms_norm import rms_norm, rms_norm_reference

# fp32: both sides compute in fp32 and differ only in summation order. bf16: both compute in fp32 from the same
# bf16 inputs, but the interpreter rounds bf16 stores toward zero where torch rounds to nearest (one ulp, 2**-7
# relative), and with a residual the reference's autograd adds the two gradients of h in bf16 while the kernel adds
# in fp32; atol (one ulp at unit scale) covers entries near zero produced by that cancellation.
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7}}


def _grid_values(shape, dtype, generator):
    """Values on a 1/16 grid in [-4, 4): sums of two of them are exact in bf16, so x + residual rounds the same
    on both paths and the comparison tests the normalization, not the rounding mode of the add."""
    return (torch.randint(-64, 64, shape, generator=generator) / 16).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 100), (37, 64), (1, 37), (300, 200)])  # the last: three row tiles
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_reference_forward_and_backward(dtype, shape, with_residual):
    generator = torch.Generator().manual_seed(0)
    x = _grid_values(shape, dtype, generator).requires_grad_()
    weight = (torch.rand(shape[-1], generator=generator) + 0.5).to(dtype).requires_grad_()
    residual = _grid_values(shape, dtype, generator).requires_grad_() if with_residual else None
    inputs = [x, weight] + ([residual] if with_residual else [])

    triton_out = rms_norm(x, weight, 1e-6, residual=residual, backend="triton")
    reference_out = rms_norm_reference(x, weight, 1e-6, residual=residual)
    triton_out = triton_out if with_residual else (triton_out,)
    reference_out = reference_out if with_residual else (reference_out,)
    upstream = [torch.randn(out.shape, generator=generator).to(dtype) for out in reference_out]
    triton_grads = torch.autograd.grad(triton_out, inputs, upstream)
    reference_grads = torch.autograd.grad(reference_out, inputs, upstream)

    for got, expected in zip(triton_out + triton_grads, reference_out + reference_grads):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


def test_fp32_weight_with_bf16_input_keeps_each_dtype():
    x = torch.randn(4, 24, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.rand(24, requires_grad=True)
    y = rms_norm(x, weight, backend="triton")
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(y.float(), rms_norm_reference(x, weight).float(), **TOLERANCES[torch.bfloat16])


def test_weight_without_grad_and_non_contiguous_input():
    x = torch.randn(20, 12).t().requires_grad_()  # (12, 20), not contiguous
    weight = torch.rand(20)
    (dx,) = torch.autograd.grad(rms_norm(x, weight, backend="triton").sum(), x)
    (expected,) = torch.autograd.grad(rms_norm_reference(x, weight).sum(), x)
    torch.testing.assert_close(dx, expected, **TOLERANCES[torch.float32])


def test_triton_rejects_unsupported_dtype_and_bad_weight():
    with pytest.raises(UnsupportedKernelInput, match="float64"):
        rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), backend="triton")
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.ones(7), backend="torch")
