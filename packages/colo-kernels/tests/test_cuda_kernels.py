"""On a CUDA device: every compiled Triton kernel (not the interpreter) against its torch reference, forward and
backward, in bf16 and fp32, at shapes that take many programs and several tiles per row.

The other kernel tests run Triton's interpreter on CPU tensors; these run only where CUDA is visible. The rule for
low precision is the one flash-attention's own tests use: the "truth" is the reference evaluated in fp32 on the
fp32 copies of the same inputs, and the kernel's largest error against it may be at most twice the error of the
reference evaluated in the test dtype, plus a floor (``FLOOR`` times the largest magnitude of the truth) that
covers outputs the low-precision reference happens to round exactly and Triton's TF32 dot products in fp32.
A wrong kernel (a missed tile, a bad mask, a lost scale) is off by the truth's own magnitude and fails.
"""

from __future__ import annotations

import math

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.cuda, requires_cuda]

DTYPES = [torch.bfloat16, torch.float32]
FLOOR = {torch.bfloat16: 1e-2, torch.float32: 2e-3}


def _leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() if t.is_floating_point() else t for t in tensors]


def _outputs(result) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else [t for t in result if isinstance(t, torch.Tensor)]


def _check(kernel, reference, inputs: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Run ``kernel`` and ``reference`` on ``inputs`` (dtype) and ``reference`` on their fp32 copies; compare the
    outputs and the gradients of every floating input under one random upstream gradient."""
    low = _leaves(inputs)
    high = _leaves(inputs, torch.float32)
    ours = _leaves(inputs)
    outs = {"ours": _outputs(kernel(*ours)), "low": _outputs(reference(*low)), "high": _outputs(reference(*high))}
    generator = torch.Generator(device="cuda").manual_seed(7)
    upstream = [torch.randn(o.shape, device="cuda", generator=generator) for o in outs["high"]]
    grads = {}
    for name, leaves in (("ours", ours), ("low", low), ("high", high)):
        differentiable = [leaf for leaf in leaves if leaf.requires_grad]
        pairs = [(o, u.to(o.dtype)) for o, u in zip(outs[name], upstream) if o.requires_grad]
        grads[name] = list(
            torch.autograd.grad([o for o, _ in pairs], differentiable, [u for _, u in pairs], allow_unused=True)
        )
    compared = list(zip(outs["ours"] + grads["ours"], outs["low"] + grads["low"], outs["high"] + grads["high"]))
    assert compared, "nothing to compare"
    for index, (got, low_value, truth) in enumerate(compared):
        if truth is None:
            assert got is None, f"output/grad {index}: the reference has no gradient here but the kernel does"
            continue
        assert got.dtype == low_value.dtype and got.shape == truth.shape, (index, got.dtype, got.shape, truth.shape)
        truth = truth.float()
        assert torch.isfinite(got).all(), f"output/grad {index}: non-finite values"
        ours_error = (got.float() - truth).abs().max().item()
        reference_error = (low_value.float() - truth).abs().max().item()
        floor = FLOOR[dtype] * max(truth.abs().max().item(), 1e-6)
        assert ours_error <= 2 * reference_error + floor, (
            f"output/grad {index}: kernel error {ours_error:.3e} > 2 x reference error {reference_error:.3e} "
            f"+ floor {floor:.3e}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, residual):
    from colo.kernels.rms_norm import rms_norm, rms_norm_reference

    x, res = (
        torch.randn(2, 4096, 4096, device="cuda", dtype=dtype),
        torch.randn(2, 4096, 4096, device="cuda", dtype=dtype),
    )
    weight = torch.rand(4096, device="cuda", dtype=dtype) + 0.5
    if residual:
        _check(
            lambda x, w, r: rms_norm(x, w, 1e-6, residual=r, backend="triton"),
            lambda x, w, r: rms_norm_reference(x, w, 1e-6, residual=r),
            [x, weight, res],
            dtype,
        )
    else:
        _check(lambda x, w: rms_norm(x, w, 1e-6, backend="triton"), rms_norm_reference, [x, weight], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(dtype):
    from colo.kernels.layer_norm import layer_norm, layer_norm_reference

    x = torch.randn(8192, 5120, device="cuda", dtype=dtype)
    weight, bias = torch.rand(5120, device="cuda", dtype=dtype) + 0.5, torch.randn(5120, device="cuda", dtype=dtype)
    _check(lambda *a: layer_norm(*a, backend="triton"), layer_norm_reference, [x, weight, bias], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    from colo.kernels.rotary import rotary, rotary_cos_sin, rotary_reference

    q = torch.randn(2, 2048, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(2, 2048, 8, 128, device="cuda", dtype=dtype)
    cos, sin = rotary_cos_sin(2048, 128, dtype=dtype, device="cuda")
    _check(
        lambda q, k: rotary(q, k, cos, sin, backend="triton"),
        lambda q, k: rotary_reference(q, k, cos, sin),
        [q, k],
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    from colo.kernels.swiglu import swiglu, swiglu_reference

    gate, up = (torch.randn(4096, 14336, device="cuda", dtype=dtype) for _ in range(2))
    _check(lambda g, u: swiglu(g, u, backend="triton"), swiglu_reference, [gate, up], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_softmax(dtype, causal):
    from colo.kernels.softmax import softmax, softmax_reference

    x = torch.randn(2, 16, 1024, 1024, device="cuda", dtype=dtype) * 4
    _check(
        lambda x: softmax(x, causal=causal, scale=0.125, backend="triton"),
        lambda x: softmax_reference(x, causal=causal, scale=0.125),
        [x],
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(dtype):
    from colo.kernels.cross_entropy import cross_entropy, cross_entropy_reference

    logits = torch.randn(4096, 128256, device="cuda", dtype=dtype) * 3
    target = torch.randint(0, 128256, (4096,), device="cuda")
    target[::7] = -100
    _check(
        lambda x: cross_entropy(x, target, backend="triton"),
        lambda x: cross_entropy_reference(x, target),
        [logits],
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_cross_entropy(dtype):
    from colo.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_reference

    hidden = torch.randn(4096, 2048, device="cuda", dtype=dtype)
    weight = torch.randn(32000, 2048, device="cuda", dtype=dtype) / math.sqrt(2048)
    target = torch.randint(0, 32000, (4096,), device="cuda")
    target[::9] = -100
    _check(
        lambda h, w: fused_linear_cross_entropy(h, w, target, backend="triton"),
        lambda h, w: fused_linear_cross_entropy_reference(h, w, target),
        [hidden, weight],
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_grouped_query(dtype, causal, head_dim):
    from colo.kernels.flash_attention import flash_attention, flash_attention_reference

    q = torch.randn(2, 1024, 16, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 1024, 4, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    _check(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="triton"),
        lambda q, k, v: flash_attention_reference(q, k, v, causal=causal),
        [q, k, v],
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(1000, 1000), (300, 1000), (77, 1000)])
def test_flash_attention_uneven_lengths(dtype, causal, seq_q, seq_k):
    """Lengths that are no multiple of any block, and fewer queries than keys (the causal mask bottom-right
    aligned): the kernels' unmasked interior blocks and masked edge blocks together cover every score once."""
    from colo.kernels.flash_attention import flash_attention, flash_attention_reference

    q = torch.randn(2, seq_q, 8, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, seq_k, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    _check(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="triton"),
        lambda q, k, v: flash_attention_reference(q, k, v, causal=causal),
        [q, k, v],
        dtype,
    )


@pytest.mark.parametrize("causal", [False, True])
def test_plain_attention_through_sdpa(monkeypatch, causal):
    """``COLO_PLAIN_ATTENTION=sdpa``: plain 16-bit attention runs SDPA on colo's layout, grouped-query heads too."""
    from colo.kernels.flash_attention import PLAIN_ATTENTION_ENV, flash_attention, flash_attention_reference

    monkeypatch.setenv(PLAIN_ATTENTION_ENV, "sdpa")
    q = torch.randn(2, 1000, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _check(
        lambda q, k, v: flash_attention(q, k, v, causal=causal),
        lambda q, k, v: flash_attention_reference(q, k, v, causal=causal),
        [q, k, v],
        torch.bfloat16,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_documents_and_kv_offsets(dtype):
    from colo.kernels.flash_attention import flash_attention, flash_attention_reference

    seq = 1000  # not a multiple of any block size
    lengths = [1, 7, 64, 100, 300, 528]
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).cuda()
    padded = torch.cat([torch.full((200,), -1), torch.zeros(seq - 200, dtype=torch.long)]).cuda()  # left padding
    document_ids = torch.stack([documents, padded])
    q = torch.randn(2, seq, 8, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, seq, 2, 128, device="cuda", dtype=dtype) for _ in range(2))
    mask = {"causal": True, "document_ids": document_ids}
    _check(
        lambda q, k, v: flash_attention(q, k, v, backend="triton", **mask),
        lambda q, k, v: flash_attention_reference(q, k, v, **mask),
        [q, k, v],
        dtype,
    )
    decode = {"causal": True, "kv_offsets": torch.tensor([seq - 16, seq - 40], device="cuda")}  # a chunk of queries
    _check(
        lambda q, k, v: flash_attention(q, k, v, backend="triton", **decode),
        lambda q, k, v: flash_attention_reference(q, k, v, **decode),
        [q[:, :16].contiguous(), k, v],
        dtype,
    )


def test_fused_adamw_matches_the_reference_and_torch():
    from colo.kernels.adamw import adamw_reference, fused_adamw

    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 4096), (4096,), (37,), (1000, 3)]
    params = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
    grads = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
    copies = {
        name: (
            [p.clone() for p in params],
            [torch.zeros_like(p) for p in params],
            [torch.zeros_like(p) for p in params],
        )
        for name in ("ours", "ref")
    }
    twins = [torch.nn.Parameter(p.clone()) for p in params]
    torch_adamw = torch.optim.AdamW(twins, lr=1e-3, weight_decay=0.1, fused=True)
    for step in range(1, 4):
        fused_adamw(
            copies["ours"][0], grads, *copies["ours"][1:], step=step, lr=1e-3, weight_decay=0.1, backend="triton"
        )
        adamw_reference(copies["ref"][0], grads, *copies["ref"][1:], step=step, lr=1e-3, weight_decay=0.1)
        for twin, grad in zip(twins, grads):
            twin.grad = grad
        torch_adamw.step()
    for ours, ref, twin in zip(copies["ours"][0], copies["ref"][0], twins):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours, twin.detach(), rtol=1e-6, atol=1e-6)
