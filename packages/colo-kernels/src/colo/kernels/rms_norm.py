"""RMSNorm (Zhang & Sennrich, 2019), optionally fused with the residual add that precedes it in a pre-norm block.

`rms_norm` is the public op; `rms_norm_reference` is the same computation in torch ops. Both compute in fp32 and
round once to the input's dtype at the end. The Triton kernels treat the input as ``(rows, hidden)``, keep a whole
row in one block and process ``ROWS`` rows per program; the backward kernel loops over row tiles so each program
accumulates its own partial weight gradient, summed afterwards in torch.
"""

from __future__ import annotations

import torch

from ._rows import _backward_grid, _row_tiling
from .dispatch import check_triton_dtypes, resolve_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency; the reference still works without it
    triton = None

if triton is not None:

    @triton.jit
    def _rms_norm_forward_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        y_ptr,
        h_ptr,
        rstd_ptr,
        n_rows,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]

        h = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + offsets, h, mask=mask)
            h = h.to(tl.float32)  # normalize the rounded sum, exactly what the caller gets back as h
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = h * rstd[:, None] * weight[None, :]
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    @triton.jit
    def _rms_norm_backward_kernel(
        dy_ptr,
        dh_out_ptr,
        h_ptr,
        weight_ptr,
        rstd_ptr,
        dh_ptr,
        dweight_partial_ptr,
        n_rows,
        n_cols,
        HAS_DH_OUT: tl.constexpr,
        COMPUTE_DWEIGHT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dweight = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for tile in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]

            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            normed = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
            dnormed = dy * weight[None, :]
            # d/dh of h * rstd(h): rstd * (g - normed * mean(g * normed)) for the upstream g = dy * weight
            dh = rstd[:, None] * (dnormed - normed * (tl.sum(dnormed * normed, axis=1) / n_cols)[:, None])
            if HAS_DH_OUT:
                dh += tl.load(dh_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(dh_ptr + offsets, dh.to(dh_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DWEIGHT:
                dweight += dy * normed
        if COMPUTE_DWEIGHT:
            tl.store(dweight_partial_ptr + pid * n_cols + cols, tl.sum(dweight, axis=0), mask=col_mask)


class _RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm; with a residual it returns ``(y, h)`` and its backward adds the gradient of ``h``."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        shape = x.shape
        n_cols = shape[-1]
        x2d = x.contiguous().view(-1, n_cols)
        n_rows = x2d.shape[0]
        block_n, rows, num_warps = _row_tiling("rms_norm", n_rows, n_cols, x.device)
        y = torch.empty_like(x2d)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if residual is not None:
            residual2d = residual.contiguous().view(-1, n_cols)
            h = torch.empty_like(x2d)
        else:
            residual2d, h = x2d, x2d  # unused by the kernel when HAS_RESIDUAL is False
        _rms_norm_forward_kernel[(triton.cdiv(n_rows, rows) or 1,)](
            x2d, residual2d, weight.contiguous(), y, h, rstd, n_rows, n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps,
        )  # fmt: skip
        ctx.save_for_backward(h, weight, rstd)
        ctx.has_residual = residual is not None
        ctx.tiling = (block_n, rows, num_warps)
        if residual is None:
            return y.view(shape)
        return y.view(shape), h.view(shape)

    @staticmethod
    def backward(ctx, dy, dh_out=None):
        h, weight, rstd = ctx.saved_tensors
        block_n, rows, num_warps = ctx.tiling
        n_rows, n_cols = h.shape
        shape = dy.shape
        compute_dweight = ctx.needs_input_grad[1]
        grid = _backward_grid(triton.cdiv(n_rows, rows), h.device)
        dh = torch.empty_like(h)
        dweight_partial = torch.empty((grid, n_cols), dtype=torch.float32, device=h.device)
        _rms_norm_backward_kernel[(grid,)](
            dy.contiguous().view(-1, n_cols), dh_out.contiguous().view(-1, n_cols) if dh_out is not None else dy,
            h, weight, rstd, dh, dweight_partial, n_rows, n_cols,
            HAS_DH_OUT=dh_out is not None, COMPUTE_DWEIGHT=compute_dweight, BLOCK_N=block_n, ROWS=rows,
            num_warps=num_warps,
        )  # fmt: skip
        dweight = dweight_partial.sum(0).to(weight.dtype) if compute_dweight else None
        dh = dh.view(shape)
        return dh, dweight, dh if ctx.has_residual else None, None


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in torch ops (the reference for the Triton kernel); same arguments and results as `rms_norm`."""
    h = x if residual is None else x + residual
    h32 = h.float()
    y = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, h)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square layer normalization over the last dimension, ``y = x / sqrt(mean(x**2) + eps) * weight``.

    With ``residual`` it first adds the residual stream, as a pre-norm transformer block does
    (``h = x + residual; y = rms_norm(h)``), and returns ``h`` too so the caller carries it to the next block; the
    Triton kernel does both in one pass. Statistics and the product with ``weight`` are computed in fp32 and
    rounded once to ``x.dtype``.

    Paper: Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.

    Args:
        x (torch.Tensor): input of shape ``(..., hidden)``.
        weight (torch.Tensor): scale of shape ``(hidden,)``.
        eps (float): added to the mean square before the square root. Default: ``1e-6``.
        residual (torch.Tensor | None): tensor shaped like ``x`` to add before normalizing. Default: ``None``.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; ``None`` follows `use_backend` and
            ``COLO_KERNELS``. Default: ``None``.

    Returns:
        torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ``y`` shaped and typed like ``x``; with ``residual``,
        ``(y, h)`` where ``h = x + residual``.

    Raises:
        ValueError: if ``weight`` or ``residual`` does not match ``x``.
        UnsupportedKernelInput: on the Triton path, for dtypes other than fp32/bf16/fp16 or rows wider than
            `MAX_FUSED_COLS`.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},) for x {tuple(x.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual is {tuple(residual.shape)} {residual.dtype}; "
            f"it must match x {tuple(x.shape)} {x.dtype}"
        )
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if resolve_backend("rms_norm", *tensors, backend=backend) == "torch":
        return rms_norm_reference(x, weight, eps, residual=residual)
    check_triton_dtypes("rms_norm", x=x, weight=weight)
    return _RMSNormFunction.apply(x, weight, residual, eps)
