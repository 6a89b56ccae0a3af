"""Fused RMSNorm, SwiGLU and flash attention: Triton on a CUDA device, the torch references elsewhere."""

import torch

from colo.kernels import flash_attention, resolve_backend, rms_norm, swiglu, use_backend

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x = torch.randn(2, 64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
weight = torch.ones(256, device=device, dtype=torch.bfloat16, requires_grad=True)
residual = torch.randn_like(x)
y, h = rms_norm(x, weight, residual=residual)  # fused residual add + RMSNorm: returns the norm and the sum
gate, up = torch.randn(2, 64, 512, device=device, dtype=torch.bfloat16).chunk(2, dim=-1)
act = swiglu(gate, up)  # silu(gate) * up
q = torch.randn(2, 128, 8, 32, device=device, dtype=torch.bfloat16)  # (batch, seq, heads, head_dim)
k = torch.randn(2, 128, 2, 32, device=device, dtype=torch.bfloat16)  # 2 kv heads for 8 query heads: GQA
v = torch.randn_like(k)
out = flash_attention(q, k, v, causal=True)
(y.float().sum() + out.float().sum()).backward()

with use_backend("torch"):  # or COLO_KERNELS=torch, or backend="torch" per call: the references
    y_ref, h_ref = rms_norm(x, weight, residual=residual)
    act_ref = swiglu(gate, up)
    out_ref = flash_attention(q, k, v, causal=True)
torch.testing.assert_close(h, x + residual)
for got, want in [(y, y_ref), (act, act_ref), (out, out_ref)]:  # bf16: one rounding of an fp32 computation
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
assert x.grad is not None and weight.grad is not None
print(f"ok: rms_norm, swiglu, flash_attention on {device} with the {resolve_backend(x)} backend match the references")
