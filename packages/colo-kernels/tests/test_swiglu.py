"""The Triton SwiGLU (run by Triton's interpreter on CPU) equals the torch reference, forward and backward."""

import pytest
import torch

from colo.kernels.dispatch import UnsupportedKernelInput
from colo.kernels.swiglu import swiglu, swiglu_reference

# fp32: the kernel's sigmoid (exp of -abs(g)) and torch's silu differ in the last bits only.
# bf16: both compute in fp32 from the same bf16 inputs; the interpreter rounds bf16 stores toward zero where torch
# rounds to nearest, so one bf16 ulp (2**-7 relative) apart.
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 100), (70001,)])  # the last spans two interpreter blocks
def test_triton_matches_reference_forward_and_backward(dtype, shape):
    generator = torch.Generator().manual_seed(0)
    gate = (3 * torch.randn(shape, generator=generator)).to(dtype).requires_grad_()
    up = torch.randn(shape, generator=generator).to(dtype).requires_grad_()

    triton_out = swiglu(gate, up, backend="triton")
    reference_out = swiglu_reference(gate, up)
    upstream = torch.randn(shape, generator=generator).to(dtype)
    triton_grads = torch.autograd.grad(triton_out, (gate, up), upstream)
    reference_grads = torch.autograd.grad(reference_out, (gate, up), upstream)

    for got, expected in zip((triton_out, *triton_grads), (reference_out, *reference_grads)):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


def test_large_negative_gate_gives_zero_not_nan():
    gate = torch.tensor([-200.0, -90.0, 0.0, 90.0], requires_grad=True)
    up = torch.ones(4, requires_grad=True)
    out = swiglu(gate, up, backend="triton")
    dgate, dup = torch.autograd.grad(out.sum(), (gate, up))
    assert torch.isfinite(out).all() and torch.isfinite(dgate).all() and torch.isfinite(dup).all()
    torch.testing.assert_close(out, swiglu_reference(gate, up))


def test_rejects_mismatched_inputs_and_unsupported_dtype():
    with pytest.raises(ValueError, match="must match"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(UnsupportedKernelInput, match="float64"):
        swiglu(torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64), backend="triton")
