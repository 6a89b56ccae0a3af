"""The Triton LayerNorm (run by Triton's interpreter on CPU) equals the torch reference, forward and backward."""

import pytest
import torch

from colo.kernels.dispatch import UnsupportedKernelInput
from colo.kernels.layer_norm import layer_norm, layer_norm_reference

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
@pytest.mark.parametrize("affine", ["weight_and_bias", "weight_only", "none"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_reference_forward_and_backward(dtype, shape, affine, with_residual):
    generator = torch.Generator().manual_seed(0)
    hidden = shape[-1]
    x = _grid_values(shape, dtype, generator).requires_grad_()
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype).requires_grad_() if affine != "none" else None
    bias = torch.randn(hidden, generator=generator).to(dtype).requires_grad_() if affine == "weight_and_bias" else None
    residual = _grid_values(shape, dtype, generator).requires_grad_() if with_residual else None
    inputs = [t for t in (x, weight, bias, residual) if t is not None]

    triton_out = layer_norm(x, weight, bias, 1e-5, residual=residual, backend="triton")
    reference_out = layer_norm_reference(x, weight, bias, 1e-5, residual=residual)
    triton_out = triton_out if with_residual else (triton_out,)
    reference_out = reference_out if with_residual else (reference_out,)
    upstream = [torch.randn(out.shape, generator=generator).to(dtype) for out in reference_out]
    triton_grads = torch.autograd.grad(triton_out, inputs, upstream)
    reference_grads = torch.autograd.grad(reference_out, inputs, upstream)

    for got, expected in zip(triton_out + triton_grads, reference_out + reference_grads):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


def test_reference_matches_torch_layer_norm():
    x, weight, bias = torch.randn(6, 40), torch.rand(40), torch.randn(40)
    expected = torch.nn.functional.layer_norm(x, (40,), weight, bias, 1e-5)
    torch.testing.assert_close(layer_norm(x, weight, bias, backend="triton"), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer_norm_reference(x, weight, bias), expected, rtol=1e-5, atol=1e-5)


def test_only_bias_requires_grad():
    x, weight = torch.randn(5, 24), torch.rand(24)
    bias = torch.randn(24, requires_grad=True)
    (dbias,) = torch.autograd.grad(layer_norm(x, weight, bias, backend="triton").pow(2).sum(), bias)
    (expected,) = torch.autograd.grad(layer_norm_reference(x, weight, bias).pow(2).sum(), bias)
    torch.testing.assert_close(dbias, expected, **TOLERANCES[torch.float32])


def test_triton_rejects_unsupported_dtype_and_bad_shapes():
    with pytest.raises(UnsupportedKernelInput, match="float64"):
        layer_norm(torch.randn(2, 8, dtype=torch.float64), None, None, backend="triton")
    with pytest.raises(ValueError, match="bias"):
        layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(9), backend="torch")
    with pytest.raises(ValueError, match="residual"):
        layer_norm(torch.randn(2, 8), None, None, residual=torch.randn(2, 7), backend="torch")
