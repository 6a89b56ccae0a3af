"""LayerNorm (Ba, Kiros & Hinton, 2016) with optional affine parameters and an optional fused residual add.

`layer_norm` is the public op; `layer_norm_reference` is the same computation in torch ops. The Triton kernels
follow `rms_norm`'s layout: rows of ``hidden`` elements, ``ROWS`` rows per program, fp32 math, per-program partial
weight and bias gradients summed in torch. Either backend runs as the operators ``torch.ops.colo.layer_norm``
(returning ``(y, h, mean, rstd)``) and ``torch.ops.colo.layer_norm_backward`` (the Triton kernel's closed form).
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
    def _layer_norm_forward_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        bias_ptr,
        y_ptr,
        h_ptr,
        mean_ptr,
        rstd_ptr,
        n_rows,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
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
        mean = tl.sum(h, axis=1) / n_cols
        centered = tl.where(mask, h - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
        y = centered * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    @triton.jit
    def _layer_norm_backward_kernel(
        dy_ptr,
        dh_out_ptr,
        h_ptr,
        weight_ptr,
        mean_ptr,
        rstd_ptr,
        dh_ptr,
        dweight_partial_ptr,
        dbias_partial_ptr,
        n_rows,
        n_cols,
        HAS_DH_OUT: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        COMPUTE_DWEIGHT: tl.constexpr,
        COMPUTE_DBIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        else:
            weight = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
        dweight = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        dbias = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for tile in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
            rows = tile * ROWS + tl.arange(0, ROWS)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]

            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            normed = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
            dnormed = dy * weight[None, :]
            # d/dh of (h - mean) * rstd: rstd * (g - mean(g) - normed * mean(g * normed)) for the upstream g
            dh = rstd[:, None] * (
                dnormed
                - (tl.sum(dnormed, axis=1) / n_cols)[:, None]
                - normed * (tl.sum(dnormed * normed, axis=1) / n_cols)[:, None]
            )
            if HAS_DH_OUT:
                dh += tl.load(dh_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(dh_ptr + offsets, dh.to(dh_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DWEIGHT:
                dweight += dy * normed
            if COMPUTE_DBIAS:
                dbias += dy
        if COMPUTE_DWEIGHT:
            tl.store(dweight_partial_ptr + pid * n_cols + cols, tl.sum(dweight, axis=0), mask=col_mask)
        if COMPUTE_DBIAS:
            tl.store(dbias_partial_ptr + pid * n_cols + cols, tl.sum(dbias, axis=0), mask=col_mask)


def _forward_triton(x, weight, bias, residual, eps):
    """Triton forward: ``(y, h, mean, rstd)``; ``h`` is empty without a residual."""
    shape = x.shape
    n_cols = shape[-1]
    x2d = x.contiguous().view(-1, n_cols)
    n_rows = x2d.shape[0]
    block_n, rows, num_warps = _row_tiling("layer_norm", n_rows, n_cols, x.device)
    y = torch.empty_like(x2d)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if residual is not None:
        residual2d = residual.contiguous().view(-1, n_cols)
        h = torch.empty_like(x2d)
    else:
        residual2d, h = x2d, x2d  # unused by the kernel when HAS_RESIDUAL is False
    weight_arg = weight.contiguous() if weight is not None else x2d
    bias_arg = bias.contiguous() if bias is not None else x2d
    _layer_norm_forward_kernel[(triton.cdiv(n_rows, rows) or 1,)](
        x2d, residual2d, weight_arg, bias_arg, y, h, mean, rstd, n_rows, n_cols, eps,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, ROWS=rows, num_warps=num_warps,
    )  # fmt: skip
    h = h.view(shape) if residual is not None else x.new_empty(0)
    return y.view(shape), h, mean.view(shape[:-1]), rstd.view(shape[:-1])


def _backward_triton(dy, dh_out, h, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype):
    """Triton backward: ``(dh, dweight, dbias)``, the parameter gradients empty unless asked for."""
    shape = h.shape
    n_cols = shape[-1]
    h = h.contiguous().view(-1, n_cols)
    n_rows = h.shape[0]
    block_n, rows, num_warps = _row_tiling("layer_norm", n_rows, n_cols, h.device)
    grid = _backward_grid(triton.cdiv(n_rows, rows), h.device)
    dh = torch.empty_like(h)
    dweight_partial = torch.empty((grid if compute_dweight else 1, n_cols), dtype=torch.float32, device=h.device)
    dbias_partial = torch.empty((grid if compute_dbias else 1, n_cols), dtype=torch.float32, device=h.device)
    dy = dy.contiguous().view(-1, n_cols)
    _layer_norm_backward_kernel[(grid,)](
        dy, dh_out.contiguous().view(-1, n_cols) if dh_out is not None else dy,
        h, weight.contiguous() if weight is not None else h, mean.contiguous(), rstd.contiguous(), dh,
        dweight_partial, dbias_partial, n_rows, n_cols,
        HAS_DH_OUT=dh_out is not None, HAS_WEIGHT=weight is not None, COMPUTE_DWEIGHT=compute_dweight,
        COMPUTE_DBIAS=compute_dbias, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps,
    )  # fmt: skip
    dweight = dweight_partial.sum(0).to(weight.dtype) if compute_dweight else h.new_empty(0)
    dbias = dbias_partial.sum(0).to(bias_dtype) if compute_dbias else h.new_empty(0)
    return dh.view(shape), dweight, dbias


def _forward_torch(x, weight, bias, residual, eps):
    """Torch forward, the values of `layer_norm_reference`: ``(y, h, mean, rstd)``."""
    h = x if residual is None else x + residual
    h32 = h.float()
    mean = h32.mean(-1, keepdim=True)
    centered = h32 - mean
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    y = centered * rstd
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    h = h.contiguous() if residual is not None else x.new_empty(0)
    return y.to(x.dtype).contiguous(), h, mean.squeeze(-1), rstd.squeeze(-1)


def _backward_torch(dy, dh_out, h, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype):
    """Torch backward, the formulas of the Triton kernel."""
    rstd = rstd.unsqueeze(-1)
    normed = (h.float() - mean.unsqueeze(-1)) * rstd
    dy32 = dy.float()
    dnormed = dy32 * weight.float() if weight is not None else dy32
    # d/dh of (h - mean) * rstd: rstd * (g - mean(g) - normed * mean(g * normed)) for the upstream g
    dh = rstd * (dnormed - dnormed.mean(-1, keepdim=True) - normed * (dnormed * normed).mean(-1, keepdim=True))
    if dh_out is not None:
        dh = dh + dh_out.float()
    n_cols = h.shape[-1]
    dweight = (dy32 * normed).reshape(-1, n_cols).sum(0).to(weight.dtype) if compute_dweight else h.new_empty(0)
    dbias = dy32.reshape(-1, n_cols).sum(0).to(bias_dtype) if compute_dbias else h.new_empty(0)
    return dh.to(h.dtype).contiguous(), dweight, dbias


@torch.library.custom_op(
    "colo::layer_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, str backend) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _layer_norm_op(x, weight, bias, residual, eps, backend):
    """``(y, h, mean, rstd)``: the norm, the residual sum (empty without a residual) and each row's fp32 mean and
    ``1 / std`` (shaped ``x.shape[:-1]``), saved for the backward."""
    tensors = [t for t in (x, weight, bias, residual) if t is not None]
    if op_backend(backend, *tensors) == "triton":
        return _forward_triton(x, weight, bias, residual, eps)
    return _forward_torch(x, weight, bias, residual, eps)


@_layer_norm_op.register_fake
def _(x, weight, bias, residual, eps, backend):
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), h, stats, stats.new_empty(stats.shape)


@torch.library.custom_op(
    "colo::layer_norm_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor? dh_out, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, bool compute_dweight, "
    "bool compute_dbias, ScalarType bias_dtype, str backend) -> (Tensor, Tensor, Tensor)",
)
def _layer_norm_backward_op(dy, dh_out, h, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype, backend):
    """``(dh, dweight, dbias)``: ``dh`` includes ``dh_out``; the parameter gradients are empty unless asked for."""
    tensors = (h,) if weight is None else (h, weight)
    if op_backend(backend, *tensors) == "triton":
        return _backward_triton(dy, dh_out, h, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype)
    return _backward_torch(dy, dh_out, h, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype)


@_layer_norm_backward_op.register_fake
def _(dy, dh_out, h, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype, backend):
    n_cols = h.shape[-1]
    dweight = weight.new_empty(n_cols) if compute_dweight else h.new_empty(0)
    dbias = h.new_empty(n_cols, dtype=bias_dtype) if compute_dbias else h.new_empty(0)
    return h.new_empty(h.shape), dweight, dbias


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _, backend = inputs
    _, h, mean, rstd = output
    ctx.has_residual, ctx.backend = residual is not None, backend
    ctx.has_weight = weight is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)


def _backward(ctx, dy, dh_out, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    compute_dweight = ctx.has_weight and ctx.needs_input_grad[1]
    compute_dbias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dh, dweight, dbias = torch.ops.colo.layer_norm_backward(
        dy, dh_out if ctx.has_residual else None, h, weight, mean, rstd, compute_dweight, compute_dbias,
        ctx.bias_dtype or torch.float32, ctx.backend,
    )  # fmt: skip
    return (
        dh,
        dweight if compute_dweight else None,
        dbias if compute_dbias else None,
        dh if ctx.has_residual else None,
        None,
        None,
    )


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm in torch ops (the reference for the Triton kernel); same arguments and results as `layer_norm`."""
    h = x if residual is None else x + residual
    h32 = h.float()
    centered = h32 - h32.mean(-1, keepdim=True)
    y = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Layer normalization over the last dimension, ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

    The variance is the biased one, as in `torch.nn.functional.layer_norm`. With ``residual`` it first adds the
    residual stream (``h = x + residual; y = layer_norm(h)``) and returns ``h`` too, in one pass on the Triton
    path. Math is in fp32, rounded once to ``x.dtype``.

    Paper: Ba, Kiros & Hinton, "Layer Normalization", 2016.

    Args:
        x (torch.Tensor): input of shape ``(..., hidden)``.
        weight (torch.Tensor | None): scale of shape ``(hidden,)``, or ``None`` for none.
        bias (torch.Tensor | None): shift of shape ``(hidden,)``, or ``None`` for none.
        eps (float): added to the variance before the square root. Default: ``1e-5``.
        residual (torch.Tensor | None): tensor shaped like ``x`` to add before normalizing. Default: ``None``.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; ``None`` follows `use_backend` and
            ``COLO_KERNELS``. Default: ``None``.

    Returns:
        torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ``y`` shaped and typed like ``x``; with ``residual``,
        ``(y, h)`` where ``h = x + residual``.

    Raises:
        ValueError: if ``weight``, ``bias`` or ``residual`` does not match ``x``.
        UnsupportedKernelInput: on the Triton path, for dtypes other than fp32/bf16/fp16 or rows wider than
            `MAX_FUSED_COLS`.
    """
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != x.shape[-1:]:
            raise ValueError(
                f"layer_norm: {name} has shape {tuple(param.shape)}; expected ({x.shape[-1]},) for x {tuple(x.shape)}"
            )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"layer_norm: residual is {tuple(residual.shape)} {residual.dtype}; "
            f"it must match x {tuple(x.shape)} {x.dtype}"
        )
    tensors = [t for t in (x, weight, bias, residual) if t is not None]
    backend = resolve_backend("layer_norm", *tensors, backend=backend)
    if backend == "triton":
        check_triton_dtypes("layer_norm", x=x, weight=weight, bias=bias)
    y, h, _, _ = torch.ops.colo.layer_norm(x, weight, bias, residual, float(eps), backend)
    return y if residual is None else (y, h)
