"""The Triton RoPE (run by Triton's interpreter on CPU) equals the torch reference, forward and backward, and the
reference is the pairwise rotation RoFormer defines."""

import pytest
import torch

from colo.kernels.dispatch import UnsupportedKernelInput
from colo.kernels.rotary import rotary, rotary_cos_sin, rotary_reference

# fp32: identical formula, fp32 rounding only. bf16: both compute in fp32 from the same bf16 inputs; the interpreter
# rounds bf16 stores toward zero where torch rounds to nearest, so one bf16 ulp (2**-7 relative) apart.
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "seq", "q_heads", "kv_heads", "head_dim", "position_offset"),
    # GQA; half head_dim not a power of two, with an offset; a decode step; enough rows for several programs
    [(2, 5, 4, 2, 16, 0), (1, 7, 3, 1, 20, 9), (3, 1, 2, 2, 64, 30), (2, 48, 8, 2, 64, 5)],
)
def test_triton_matches_reference_forward_and_backward(dtype, batch, seq, q_heads, kv_heads, head_dim, position_offset):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=generator).to(dtype).requires_grad_()
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=generator).to(dtype).requires_grad_()
    cos, sin = rotary_cos_sin(64, head_dim, dtype=torch.float32)

    triton_out = rotary(q, k, cos, sin, position_offset=position_offset, backend="triton")
    reference_out = rotary_reference(q, k, cos, sin, position_offset=position_offset)
    upstream = [torch.randn(out.shape, generator=generator).to(dtype) for out in reference_out]
    triton_grads = torch.autograd.grad(triton_out, (q, k), upstream)
    reference_grads = torch.autograd.grad(reference_out, (q, k), upstream)

    for got, expected in zip(triton_out + triton_grads, reference_out + reference_grads):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


def test_reference_rotates_each_pair_by_position_times_frequency():
    """rotate_half pairs element i with element i + head_dim/2 and rotates the pair by position * base**(-2i/d)."""
    head_dim, offset, seq = 8, 3, 4
    q = torch.randn(1, seq, 1, head_dim, dtype=torch.float64)
    cos, sin = rotary_cos_sin(16, head_dim, base=100.0, dtype=torch.float64)
    q_rot, _ = rotary(q, q, cos, sin, position_offset=offset, backend="torch")

    frequencies = 100.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (torch.arange(seq, dtype=torch.float64)[:, None] + offset) * frequencies
    pairs = torch.complex(q[0, :, 0, : head_dim // 2], q[0, :, 0, head_dim // 2 :]) * torch.polar(
        torch.ones_like(angles), angles
    )
    # the op computes in fp32 whatever the input dtype, so float64 inputs agree to fp32 precision only
    torch.testing.assert_close(q_rot[0, :, 0], torch.cat((pairs.real, pairs.imag), dim=-1), rtol=1e-6, atol=1e-6)


def test_backward_is_rotation_by_minus_theta():
    q = torch.randn(2, 6, 2, 12, requires_grad=True)
    cos, sin = rotary_cos_sin(6, 12)
    upstream = torch.randn(2, 6, 2, 12)
    (dq,) = torch.autograd.grad(rotary(q, q.detach(), cos, sin, backend="triton")[0], q, upstream)
    rotated_back, _ = rotary(upstream, upstream, cos, -sin, backend="torch")
    torch.testing.assert_close(dq, rotated_back, **TOLERANCES[torch.float32])


def test_only_k_used_downstream():
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    k = torch.randn(1, 3, 2, 8, requires_grad=True)
    cos, sin = rotary_cos_sin(3, 8)
    _, k_rot = rotary(q, k, cos, sin, backend="triton")
    (dk,) = torch.autograd.grad(k_rot.sum(), k)
    (expected,) = torch.autograd.grad(rotary_reference(q, k, cos, sin)[1].sum(), k)
    torch.testing.assert_close(dk, expected, **TOLERANCES[torch.float32])


def test_rejects_positions_past_the_table_odd_head_dim_and_unsupported_dtype():
    cos, sin = rotary_cos_sin(4, 8)
    q = torch.randn(1, 3, 1, 8)
    with pytest.raises(ValueError, match="outside"):
        rotary(q, q, cos, sin, position_offset=2)
    odd = torch.randn(1, 3, 1, 7)
    with pytest.raises(ValueError, match="even"):
        rotary(odd, odd, cos[:, :7], sin[:, :7])
    with pytest.raises(UnsupportedKernelInput, match="float64"):
        rotary(q.double(), q.double(), cos, sin, backend="triton")
