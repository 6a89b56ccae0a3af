"""The Triton masked softmax (run by Triton's interpreter on CPU) equals the torch reference, forward and backward,
and the reference masks as documented: causal bottom-right aligned, boolean masks broadcast, empty rows zero."""

import pytest
import torch

from colo.kernels.dispatch import UnsupportedKernelInput
from colo.kernels.softmax import softmax, softmax_reference

# fp32: same formula, differing in summation order and exp rounding only. bf16: both compute in fp32 from the same
# bf16 inputs; the interpreter rounds bf16 stores toward zero where torch rounds to nearest, so one bf16 ulp
# (2**-7 relative) apart; atol covers gradient entries near zero after cancellation.
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 2**-8}}


def _random_mask(shape, generator):
    mask = torch.rand(shape, generator=generator) > 0.3
    mask[..., 0, :] = False  # a fully masked row wherever the mask has one
    return mask


def _assert_triton_matches_reference(x, dtype, **kwargs):
    generator = torch.Generator().manual_seed(1)
    triton_out = softmax(x, backend="triton", **kwargs)
    reference_out = softmax_reference(x, **kwargs)
    upstream = torch.randn(x.shape, generator=generator).to(dtype)
    (triton_grad,) = torch.autograd.grad(triton_out, x, upstream)
    (reference_grad,) = torch.autograd.grad(reference_out, x, upstream)
    for got, expected in ((triton_out, reference_out), (triton_grad, reference_grad)):
        assert got.dtype == expected.dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "causal", "mask_shape"),
    [
        ((5, 37), False, None),
        ((2, 3, 6, 100), True, None),  # square causal
        ((2, 4, 9), True, None),  # q_len < k_len: bottom-right aligned, every row keeps >= 6 keys
        ((9, 4), True, None),  # q_len > k_len: the first 5 rows are fully masked
        ((2, 3, 6, 11), False, (2, 1, 6, 11)),  # mask broadcast over heads
        ((2, 3, 6, 11), True, (6, 11)),  # causal and a mask broadcast over batch and heads
        ((4, 7, 20), False, (4, 7, 20)),
        ((2, 150, 130), True, (150, 130)),  # 300 rows: three row tiles
    ],
)
def test_triton_matches_reference_forward_and_backward(dtype, shape, causal, mask_shape):
    generator = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(shape, generator=generator)).to(dtype).requires_grad_()
    mask = _random_mask(mask_shape, generator) if mask_shape is not None else None
    _assert_triton_matches_reference(x, dtype, causal=causal, mask=mask, scale=0.3)


def test_fully_masked_rows_are_zero_with_zero_gradient():
    x = torch.randn(3, 8, requires_grad=True)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1] = False
    for backend in ("triton", "torch"):
        y = softmax(x, mask=mask, backend=backend)
        (dx,) = torch.autograd.grad(y, x, torch.randn(3, 8))
        assert torch.equal(y[1], torch.zeros(8)) and torch.equal(dx[1], torch.zeros(8))
        torch.testing.assert_close(y.sum(-1), torch.tensor([1.0, 0.0, 1.0]))


def test_reference_matches_torch_softmax_and_causal_is_bottom_right():
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(softmax_reference(x, scale=0.5), torch.softmax(0.5 * x, dim=-1))
    y = softmax_reference(x, causal=True)
    keep = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)  # query i sees keys j <= i + (5 - 3)
    torch.testing.assert_close(y, torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1))


def test_rejects_bad_mask_and_unsupported_dtype():
    with pytest.raises(ValueError, match="bool"):
        softmax(torch.randn(2, 4), mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="broadcast"):
        softmax(torch.randn(2, 4), mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(UnsupportedKernelInput, match="float64"):
        softmax(torch.randn(2, 4, dtype=torch.float64), backend="triton")
