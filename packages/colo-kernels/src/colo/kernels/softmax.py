"""Scaled, masked softmax over the last dimension, with a bottom-right-aligned causal mask.

`softmax` is the public op; `softmax_reference` is the same computation in torch ops. Masked positions get
probability 0 and a row with every position masked is all zeros rather than NaN, on both paths. The Triton
kernels hold a whole row in one block (``ROWS`` rows per program, fp32 math, as `rms_norm`); an explicit
``mask`` is read through its broadcast strides (a per-row offset table plus a column stride), never expanded in
memory. The backward uses only the saved output: ``dx = scale * y * (dy - sum(dy * y))``. Either backend runs as
the operators ``torch.ops.colo.softmax`` and ``torch.ops.colo.softmax_backward``.
"""

from __future__ import annotations

import torch

from ._rows import _backward_grid, _row_tiling
from .dispatch import check_triton_dtypes, op_backend, resolve_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency; the reference still works without it
    triton = None


if triton is not None:

    @triton.jit
    def _softmax_forward_kernel(
        x_ptr,
        y_ptr,
        mask_ptr,
        mask_row_offsets_ptr,
        mask_col_stride,
        n_rows,
        n_cols,
        q_len,
        scale,
        HAS_MASK: tl.constexpr,
        CAUSAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        keep = row_mask[:, None] & (cols < n_cols)[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        if CAUSAL:
            # query i (of q_len) sees keys j <= i + (k_len - q_len): the last query sees every key
            query = rows % q_len
            keep = keep & (cols[None, :] <= (query + (n_cols - q_len))[:, None])
        if HAS_MASK:
            mask_row = tl.load(mask_row_offsets_ptr + rows, mask=row_mask, other=0)
            mask_offsets = mask_row[:, None] + cols.to(tl.int64)[None, :] * mask_col_stride
            keep = keep & (tl.load(mask_ptr + mask_offsets, mask=keep, other=0) != 0)

        logits = tl.load(x_ptr + offsets, mask=keep, other=0.0).to(tl.float32) * scale
        logits = tl.where(keep, logits, float("-inf"))
        row_max = tl.max(logits, axis=1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # fully masked row: avoid -inf - -inf
        numerators = tl.where(keep, tl.exp(logits - row_max[:, None]), 0.0)
        denominators = tl.sum(numerators, axis=1)
        denominators = tl.where(denominators == 0.0, 1.0, denominators)
        y = numerators / denominators[:, None]
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols < n_cols)[None, :])

    @triton.jit
    def _softmax_backward_kernel(
        dy_ptr, y_ptr, dx_ptr, n_rows, n_cols, scale, BLOCK_N: tl.constexpr, ROWS: tl.constexpr
    ):
        for tile in range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
            rows = tile * ROWS + tl.arange(0, ROWS)
            cols = tl.arange(0, BLOCK_N)
            mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            dx = scale * y * (dy - tl.sum(dy * y, axis=1)[:, None])
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _mask_layout(mask: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``mask`` broadcast to ``shape`` without copying: ``(uint8 view, per-row element offsets, column stride)``."""
    expanded = mask.expand(shape)
    row_offsets = torch.zeros((), dtype=torch.int64, device=mask.device)
    for dim, (size, stride) in enumerate(zip(shape[:-1], expanded.stride()[:-1])):
        index_shape = [1] * (len(shape) - 1)
        index_shape[dim] = size
        row_offsets = row_offsets + (torch.arange(size, device=mask.device) * stride).view(index_shape)
    row_offsets = row_offsets.expand(shape[:-1]).reshape(-1).contiguous()
    return expanded.view(torch.uint8), row_offsets, expanded.stride()[-1]


def _forward_triton(x, mask, causal, scale):
    shape = x.shape
    n_cols = shape[-1]
    q_len = shape[-2] if causal else 1
    x2d = x.contiguous().view(-1, n_cols)
    n_rows = x2d.shape[0]
    block_n, rows, num_warps = _row_tiling("softmax", n_rows, n_cols, x.device)
    y = torch.empty_like(x2d)
    if mask is not None:
        mask_arg, mask_row_offsets, mask_col_stride = _mask_layout(mask, shape)
    else:
        mask_arg, mask_row_offsets, mask_col_stride = x2d, x2d, 0  # unused when HAS_MASK is False
    _softmax_forward_kernel[(triton.cdiv(n_rows, rows) or 1,)](
        x2d, y, mask_arg, mask_row_offsets, mask_col_stride, n_rows, n_cols, q_len, scale,
        HAS_MASK=mask is not None, CAUSAL=causal, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps,
    )  # fmt: skip
    return y.view(shape)


def _backward_triton(dy, y, scale):
    shape = y.shape
    n_cols = shape[-1]
    y = y.contiguous().view(-1, n_cols)
    n_rows = y.shape[0]
    block_n, rows, num_warps = _row_tiling("softmax", n_rows, n_cols, y.device)
    dx = torch.empty_like(y)
    _softmax_backward_kernel[(_backward_grid(triton.cdiv(n_rows, rows), y.device),)](
        dy.contiguous().view(-1, n_cols), y, dx, n_rows, n_cols, scale,
        BLOCK_N=block_n, ROWS=rows, num_warps=num_warps,
    )  # fmt: skip
    return dx.view(shape)


@torch.library.custom_op(
    "colo::softmax",
    mutates_args=(),
    schema="(Tensor x, Tensor? mask, bool causal, float scale, str backend) -> Tensor",
)
def _softmax_op(x, mask, causal, scale, backend):
    """The masked, scaled softmax of `softmax`."""
    if op_backend(backend, x) == "triton":
        return _forward_triton(x, mask, causal, scale)
    return softmax_reference(x, causal=causal, mask=mask, scale=scale).contiguous()


@_softmax_op.register_fake
def _(x, mask, causal, scale, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op(
    "colo::softmax_backward", mutates_args=(), schema="(Tensor dy, Tensor y, float scale, str backend) -> Tensor"
)
def _softmax_backward_op(dy, y, scale, backend):
    """``dx = scale * y * (dy - sum(dy * y))`` from the saved output alone (masked entries have ``y = 0``)."""
    if op_backend(backend, y) == "triton":
        return _backward_triton(dy, y, scale)
    y32 = y.float()
    dy32 = dy.float()
    return (scale * y32 * (dy32 - (dy32 * y32).sum(-1, keepdim=True))).to(y.dtype).contiguous()


@_softmax_backward_op.register_fake
def _(dy, y, scale, backend):
    return y.new_empty(y.shape)


def _setup_context(ctx, inputs, output):
    _, _, _, scale, backend = inputs
    ctx.scale, ctx.backend = scale, backend
    ctx.save_for_backward(output)


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.colo.softmax_backward(dy, y, ctx.scale, ctx.backend), None, None, None, None


_softmax_op.register_autograd(_backward, setup_context=_setup_context)


def softmax_reference(
    x: torch.Tensor, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """Masked softmax in torch ops (the reference for the Triton kernel); same arguments and result as `softmax`."""
    keep = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    if causal:
        q_len, k_len = x.shape[-2:]
        queries = torch.arange(q_len, device=x.device)[:, None]
        keep = keep & (torch.arange(k_len, device=x.device)[None, :] <= queries + (k_len - q_len))
    if mask is not None:
        keep = keep & mask
    logits = (x.float() * scale).masked_fill(~keep, float("-inf"))
    row_max = logits.amax(-1, keepdim=True).detach()  # softmax is shift-invariant: no gradient through the max
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    numerators = torch.where(keep, torch.exp(logits - row_max), torch.zeros_like(logits))
    denominators = numerators.sum(-1, keepdim=True)
    denominators = torch.where(denominators == 0, torch.ones_like(denominators), denominators)
    return (numerators / denominators).to(x.dtype)


def softmax(
    x: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Softmax of ``scale * x`` over the last dimension, with optional causal and boolean masks.

    Masked positions get probability 0; a row whose positions are all masked is all zeros (not NaN), so padded
    queries are harmless. The causal mask is bottom-right aligned, as in attention with a KV cache: for ``x``
    shaped ``(..., q_len, k_len)`` query ``i`` sees keys ``j <= i + (k_len - q_len)``. Math is in fp32, rounded
    once to ``x.dtype``.

    Args:
        x (torch.Tensor): scores of shape ``(..., k_len)``; ``(..., q_len, k_len)`` when ``causal``.
        causal (bool): apply the causal mask. Default: ``False``.
        mask (torch.Tensor | None): boolean tensor broadcastable to ``x``, ``True`` = keep. Default: ``None``.
        scale (float): multiplies ``x`` before the softmax (e.g. ``head_dim ** -0.5``). Default: ``1.0``.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; ``None`` follows `use_backend` and
            ``COLO_KERNELS``. Default: ``None``.

    Returns:
        torch.Tensor: probabilities shaped and typed like ``x``.

    Raises:
        ValueError: if ``mask`` is not boolean or not broadcastable to ``x``, or ``causal`` with a 1-d ``x``.
        UnsupportedKernelInput: on the Triton path, for dtypes other than fp32/bf16/fp16 or rows wider than
            `MAX_FUSED_COLS`.
    """
    if causal and x.dim() < 2:
        raise ValueError(f"softmax: causal=True needs x shaped (..., q_len, k_len); got {tuple(x.shape)}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"softmax: mask must be a bool tensor (True = keep); got {mask.dtype}")
        try:
            broadcast = torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            broadcast = None
        if broadcast != x.shape:
            raise ValueError(f"softmax: mask {tuple(mask.shape)} does not broadcast to x {tuple(x.shape)}")
    tensors = (x,) if mask is None else (x, mask)
    backend = resolve_backend("softmax", *tensors, backend=backend)
    if backend == "triton":
        check_triton_dtypes("softmax", x=x)
    return torch.ops.colo.softmax(x, mask, bool(causal), float(scale), backend)
