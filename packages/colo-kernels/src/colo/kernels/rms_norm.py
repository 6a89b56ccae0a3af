"""RMSNorm (Zhang & Sennrich, 2019), optionally fused with the residual add that precedes it in a pre-norm block.

`rms_norm` is the public op; `rms_norm_reference` is the same computation in torch ops. Both compute in fp32 and
round once to the input's dtype at the end. Both run as the operators ``torch.ops.colo.rms_norm`` (returning
``(y, h, rstd)``) and ``torch.ops.colo.rms_norm_backward``, the torch backend computing the same closed-form
gradient as the Triton kernel. The Triton kernels treat the input as ``(rows, hidden)``, keep a whole
row in one block and process ``ROWS`` rows per program; the backward kernel loops over row tiles so each program
accumulates its own partial weight gradient, summed afterwards in torch.
"""

from __future__ import annotations

import torch

from ._rows import _backward_grid, _row_tiling
from .dispatch import check_triton_dtypes, eager_fast_path, eager_function, op_backend, resolve_backend

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


def _forward_triton(x, weight, residual, eps):
    """Triton forward: ``(y, h, rstd)``; ``h`` (the residual sum) is empty without a residual."""
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
    h = h.view(shape) if residual is not None else x.new_empty(0)
    return y.view(shape), h, rstd.view(shape[:-1])


def _backward_triton(dy, dh_out, h, weight, rstd, compute_dweight):
    """Triton backward: ``(dh, dweight)``; ``dweight`` is empty unless ``compute_dweight``."""
    shape = h.shape
    n_cols = shape[-1]
    h = h.contiguous().view(-1, n_cols)
    n_rows = h.shape[0]
    block_n, rows, num_warps = _row_tiling("rms_norm", n_rows, n_cols, h.device, kernel="backward")
    grid = _backward_grid(triton.cdiv(n_rows, rows), h.device)
    dh = torch.empty_like(h)
    dweight_partial = torch.empty((grid, n_cols), dtype=torch.float32, device=h.device)
    dy = dy.contiguous().view(-1, n_cols)
    _rms_norm_backward_kernel[(grid,)](
        dy, dh_out.contiguous().view(-1, n_cols) if dh_out is not None else dy,
        h, weight.contiguous(), rstd.contiguous(), dh, dweight_partial, n_rows, n_cols,
        HAS_DH_OUT=dh_out is not None, COMPUTE_DWEIGHT=compute_dweight, BLOCK_N=block_n, ROWS=rows,
        num_warps=num_warps,
    )  # fmt: skip
    dweight = dweight_partial.sum(0).to(weight.dtype) if compute_dweight else weight.new_empty(0)
    return dh.view(shape), dweight


def _forward_torch(x, weight, residual, eps):
    """Torch forward, the values of `rms_norm_reference`: ``(y, h, rstd)``."""
    h = x if residual is None else x + residual
    h32 = h.float()
    rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    y = (h32 * rstd * weight.float()).to(x.dtype)
    h = h.contiguous() if residual is not None else x.new_empty(0)
    return y.contiguous(), h, rstd.squeeze(-1)


def _backward_torch(dy, dh_out, h, weight, rstd, compute_dweight):
    """Torch backward, the formulas of the Triton kernel: ``(dh, dweight)``."""
    rstd = rstd.unsqueeze(-1)
    normed = h.float() * rstd
    dy32 = dy.float()
    dnormed = dy32 * weight.float()
    # d/dh of h * rstd(h): rstd * (g - normed * mean(g * normed)) for the upstream g = dy * weight
    dh = rstd * (dnormed - normed * (dnormed * normed).mean(-1, keepdim=True))
    if dh_out is not None:
        dh = dh + dh_out.float()
    if compute_dweight:
        dweight = (dy32 * normed).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    else:
        dweight = weight.new_empty(0)
    return dh.to(h.dtype).contiguous(), dweight


@torch.library.custom_op(
    "colo::rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? residual, float eps, str backend) -> (Tensor, Tensor, Tensor)",
)
def _rms_norm_op(x, weight, residual, eps, backend):
    """``(y, h, rstd)``: the norm, the residual sum ``x + residual`` (empty without a residual) and the fp32
    ``1 / rms`` of each row (shaped ``x.shape[:-1]``), saved for the backward."""
    return _rms_norm_forward(x, weight, residual, eps, backend)


def _rms_norm_forward(x, weight, residual, eps, backend):
    """The body of ``colo::rms_norm`` (and of its eager fast path)."""
    if op_backend(backend, x, weight) == "triton":
        return _forward_triton(x, weight, residual, eps)
    return _forward_torch(x, weight, residual, eps)


@_rms_norm_op.register_fake
def _(x, weight, residual, eps, backend):
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), h, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(
    "colo::rms_norm_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor? dh_out, Tensor h, Tensor weight, Tensor rstd, bool compute_dweight, str backend) "
    "-> (Tensor, Tensor)",
)
def _rms_norm_backward_op(dy, dh_out, h, weight, rstd, compute_dweight, backend):
    """``(dh, dweight)``: the gradient of the normalized input ``h`` (plus ``dh_out``, the gradient the residual
    sum got from elsewhere) and of the weight (empty unless ``compute_dweight``)."""
    return _rms_norm_backward(dy, dh_out, h, weight, rstd, compute_dweight, backend)


def _rms_norm_backward(dy, dh_out, h, weight, rstd, compute_dweight, backend):
    """The body of ``colo::rms_norm_backward`` (and of its eager fast path)."""
    if op_backend(backend, h, weight) == "triton":
        return _backward_triton(dy, dh_out, h, weight, rstd, compute_dweight)
    return _backward_torch(dy, dh_out, h, weight, rstd, compute_dweight)


@_rms_norm_backward_op.register_fake
def _(dy, dh_out, h, weight, rstd, compute_dweight, backend):
    return h.new_empty(h.shape), weight.new_empty(weight.shape if compute_dweight else (0,))


def _setup_context(ctx, inputs, output):
    x, weight, residual, _, backend = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.backend = backend
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)


def _backward(ctx, dy, dh_out, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dh_out = dh_out if ctx.has_residual else None
    backward = _rms_norm_backward if eager_fast_path(dy, dh_out, h) else torch.ops.colo.rms_norm_backward
    dh, dweight = backward(dy, dh_out, h, weight, rstd, ctx.needs_input_grad[1], ctx.backend)
    return dh, dweight if ctx.needs_input_grad[1] else None, dh if ctx.has_residual else None, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)
_RMSNormEager = eager_function("_RMSNormEager", _rms_norm_forward, _setup_context, _backward)


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
    backend = resolve_backend("rms_norm", *tensors, backend=backend)
    if backend == "triton":
        check_triton_dtypes("rms_norm", x=x, weight=weight)
    if eager_fast_path(x, weight, residual):
        y, h, _ = _RMSNormEager.call(x, weight, residual, float(eps), backend)
    else:
        y, h, _ = torch.ops.colo.rms_norm(x, weight, residual, float(eps), backend)
    return y if residual is None else (y, h)
