"""Cross-entropy over a large vocabulary, with the optional z-loss of PaLM (Chowdhery et al., 2022).

`cross_entropy` is the public op; `cross_entropy_reference` is the same computation in torch ops (in fp32). The
Triton kernels give one program to one row of logits and loop over the vocabulary in blocks: the forward keeps an
online max and sum of exponentials (one read of the row) and saves the row's logsumexp; the backward reads the row
once more and writes ``(softmax * (1 + 2 * z_loss * lse) - onehot) * scale``.

Either backend runs as the operators ``torch.ops.colo.cross_entropy`` (returning the loss and each row's logsumexp)
and ``torch.ops.colo.cross_entropy_backward``; the torch backend's gradient is the same closed form.

`_cross_entropy_rows_triton` runs the forward and, in the same program, overwrites the logits with their gradient;
`fused_linear_cross_entropy` uses it on each chunk of tokens so the chunk's logits never need a second buffer.
"""

from __future__ import annotations

import torch

from .dispatch import UnsupportedKernelInput, check_triton_dtypes, op_backend, resolve_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency; the reference still works without it
    triton = None

REDUCTIONS = ("mean", "sum", "none")


def _check_inputs(logits: torch.Tensor, target: torch.Tensor, reduction: str) -> None:
    """Shape and reduction checks shared by both backends."""
    if logits.ndim != 2:
        raise ValueError(
            f"cross_entropy: logits must be 2-D (num_tokens, vocab_size), got shape {tuple(logits.shape)}; "
            "flatten leading dims with logits.view(-1, vocab_size)"
        )
    if target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy: target must have shape (num_tokens,) = ({logits.shape[0]},), got {tuple(target.shape)}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r} is unknown; use one of {REDUCTIONS}")


def _check_triton_inputs(op: str, scores: torch.Tensor, target: torch.Tensor, name: str = "logits") -> None:
    """Raise `UnsupportedKernelInput` for dtypes the Triton kernels do not take (``name`` names ``scores``)."""
    check_triton_dtypes(op, **{name: scores})
    if target.dtype not in (torch.int64, torch.int32):
        raise UnsupportedKernelInput(f"{op}: target must be int64 or int32, got {target.dtype}")


def _tiling(num_rows: int, vocab_size: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_V, ROWS, num_warps)``: a program handles ``ROWS`` rows, ``BLOCK_V`` columns per loop iteration.

    On a GPU one program owns one row and streams it in blocks of up to 4096. In Triton's interpreter every block
    operation is one numpy call with a large fixed cost, so a program takes up to 32 rows at once; ``BLOCK_V`` stays
    at 256 there so that test vocabularies still take several iterations of the online logsumexp.
    """
    if device.type == "cuda":
        block_v = min(4096, triton.next_power_of_2(max(vocab_size, 1)))
        return block_v, 1, 8 if block_v >= 2048 else 4
    block_v = min(256, triton.next_power_of_2(max(vocab_size, 1)))
    return block_v, min(32, triton.next_power_of_2(max(num_rows, 1))), 4


def _mean_divisor(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Number of non-ignored tokens as an fp32 tensor, at least 1 (so an all-ignored batch has mean loss 0)."""
    return (target != ignore_index).sum().clamp_(min=1).to(torch.float32)


def cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy plus optional z-loss in plain torch ops, computed in fp32 (autograd-aware).

    Args:
        logits (torch.Tensor): ``(num_tokens, vocab_size)`` unnormalized scores.
        target (torch.Tensor): ``(num_tokens,)`` class indices; ``ignore_index`` marks tokens without a loss.
        ignore_index (int): target value whose rows add no loss and get zero gradient. Default: -100.
        z_loss (float): weight of ``logsumexp(logits) ** 2`` added to each token's loss. Default: 0.0.
        reduction (str): ``"mean"`` over non-ignored tokens, ``"sum"`` or ``"none"``. Default: ``"mean"``.

    Returns:
        torch.Tensor: the fp32 loss, a scalar or ``(num_tokens,)`` for ``reduction="none"``.
    """
    _check_inputs(logits, target, reduction)
    valid = target != ignore_index
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    target_logit = logits32.gather(1, torch.where(valid, target, 0).long().unsqueeze(1)).squeeze(1)
    loss = lse - target_logit
    if z_loss:
        loss = loss + z_loss * lse.square()
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / _mean_divisor(target, ignore_index)


if triton is not None:

    @triton.jit
    def _rows_logsumexp(row_ptrs, vocab_size, BLOCK_V: tl.constexpr, ROWS: tl.constexpr):
        """fp32 logsumexp of ``ROWS`` rows (pointers to their first element), one pass with an online max."""
        cols = tl.arange(0, BLOCK_V)
        row_max = tl.full([ROWS], -float("inf"), tl.float32)
        sum_exp = tl.zeros([ROWS], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            mask = (start + cols < vocab_size)[None, :]
            x = tl.load(row_ptrs[:, None] + start + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, axis=1))
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
            row_max = new_max
        return row_max + tl.log(sum_exp)

    @triton.jit
    def _write_rows_grad(
        row_ptrs, grad_row_ptrs, row_mask, t, valid, lse, scale, vocab_size, z_loss, BLOCK_V: tl.constexpr
    ):
        """Write ``(softmax * (1 + 2 z lse) - onehot(t)) * scale`` for each row (zeros for an ignored row).

        ``grad_row_ptrs`` may equal ``row_ptrs``: each block is read before it is overwritten.
        """
        cols = tl.arange(0, BLOCK_V)
        softmax_coef = (1.0 + 2.0 * z_loss * lse)[:, None]
        for start in range(0, vocab_size, BLOCK_V):
            col = start + cols[None, :]
            mask = row_mask[:, None] & (col < vocab_size)
            x = tl.load(row_ptrs[:, None] + col, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse[:, None]) * softmax_coef - tl.where(col == t[:, None], 1.0, 0.0)
            grad = tl.where(valid[:, None], grad * scale[:, None], 0.0)
            tl.store(grad_row_ptrs[:, None] + col, grad.to(grad_row_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _cross_entropy_forward_kernel(
        logits_ptr,
        target_ptr,
        loss_ptr,
        lse_ptr,
        grad_scale_ptr,
        num_rows,
        row_stride,
        vocab_size,
        ignore_index,
        z_loss,
        WRITE_GRAD: tl.constexpr,
        BLOCK_V: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        """Per-row loss and logsumexp; with WRITE_GRAD, also overwrite each row with its gradient * grad_scale[0].

        Rows past the end are clamped to the last row for loads (so they stay finite) and never stored.
        """
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < num_rows
        rows = tl.minimum(rows, num_rows - 1)
        row_ptrs = logits_ptr + rows * row_stride
        t = tl.load(target_ptr + rows).to(tl.int64)
        valid = t != ignore_index
        lse = _rows_logsumexp(row_ptrs, vocab_size, BLOCK_V, ROWS)
        # A target outside [0, vocab_size) loads NaN, so the bad token shows as a NaN loss.
        in_range = (t >= 0) & (t < vocab_size)
        target_logit = tl.load(row_ptrs + t, mask=valid & in_range, other=float("nan")).to(tl.float32)
        loss = tl.where(valid, lse - target_logit + z_loss * lse * lse, 0.0)
        tl.store(loss_ptr + rows, loss, mask=row_mask)
        tl.store(lse_ptr + rows, lse, mask=row_mask)
        if WRITE_GRAD:
            scale = tl.load(grad_scale_ptr + rows * 0).to(tl.float32)
            _write_rows_grad(row_ptrs, row_ptrs, row_mask, t, valid, lse, scale, vocab_size, z_loss, BLOCK_V)

    @triton.jit
    def _cross_entropy_backward_kernel(
        logits_ptr,
        target_ptr,
        lse_ptr,
        grad_scale_ptr,
        grad_logits_ptr,
        num_rows,
        row_stride,
        grad_row_stride,
        grad_scale_stride,
        vocab_size,
        ignore_index,
        z_loss,
        BLOCK_V: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        """Gradient of each row's loss, scaled by ``grad_scale[row * grad_scale_stride]``."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < num_rows
        rows = tl.minimum(rows, num_rows - 1)
        t = tl.load(target_ptr + rows).to(tl.int64)
        lse = tl.load(lse_ptr + rows)
        scale = tl.load(grad_scale_ptr + rows * grad_scale_stride).to(tl.float32)
        _write_rows_grad(
            logits_ptr + rows * row_stride,
            grad_logits_ptr + rows * grad_row_stride,
            row_mask,
            t,
            t != ignore_index,
            lse,
            scale,
            vocab_size,
            z_loss,
            BLOCK_V,
        )


def _row_major(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _cross_entropy_rows_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    z_loss: float,
    grad_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp32 ``(loss, lse)`` from the Triton forward kernel.

    With ``grad_scale`` (a one-element fp32 tensor), ``logits`` is overwritten in place with
    ``d(loss.sum() * grad_scale) / d(logits)``; it must then have unit stride along the vocabulary.
    """
    num_tokens, vocab_size = logits.shape
    loss = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
    lse = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return loss, lse
    block_v, rows, num_warps = _tiling(num_tokens, vocab_size, logits.device)
    write_grad = grad_scale is not None
    if write_grad and logits.stride(-1) != 1:
        raise ValueError("cross_entropy: the in-place gradient needs logits with unit stride along the vocabulary")
    logits = _row_major(logits)
    _cross_entropy_forward_kernel[(triton.cdiv(num_tokens, rows),)](
        logits,
        target,
        loss,
        lse,
        grad_scale if write_grad else lse,  # an unused pointer when WRITE_GRAD is off
        num_tokens,
        logits.stride(0),
        vocab_size,
        ignore_index,
        float(z_loss),
        WRITE_GRAD=write_grad,
        BLOCK_V=block_v,
        ROWS=rows,
        num_warps=num_warps,
    )
    return loss, lse


def _reduce(loss_rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / _mean_divisor(target, ignore_index)


def _forward_torch(logits, target, ignore_index, z_loss, reduction):
    """`cross_entropy_reference`'s loss, and the fp32 logsumexp of each row for the backward."""
    valid = target != ignore_index
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    target_logit = logits32.gather(1, torch.where(valid, target, 0).long().unsqueeze(1)).squeeze(1)
    loss = lse - target_logit
    if z_loss:
        loss = loss + z_loss * lse.square()
    return _reduce(torch.where(valid, loss, 0.0), target, ignore_index, reduction), lse


def _grad_scale(grad_output, target, ignore_index, reduction):
    """The fp32 factor each row's gradient is scaled by: one per row for ``"none"``, one in all for the others."""
    grad_scale = grad_output.float()
    if reduction == "mean":
        grad_scale = grad_scale / _mean_divisor(target, ignore_index)
    return grad_scale.reshape(-1).contiguous()


def _backward_torch(grad_output, logits, target, lse, ignore_index, z_loss, reduction):
    """``(softmax * (1 + 2 z lse) - onehot) * scale`` in torch ops; zero rows for ignored targets."""
    valid = target != ignore_index
    scale = _grad_scale(grad_output, target, ignore_index, reduction)
    grad = torch.exp(logits.float() - lse.unsqueeze(1))
    if z_loss:
        grad = grad * (1.0 + 2.0 * z_loss * lse).unsqueeze(1)
    grad = grad.scatter_add(1, torch.where(valid, target, 0).long().unsqueeze(1), -torch.ones_like(grad[:, :1]))
    grad = torch.where(valid.unsqueeze(1), grad * scale.unsqueeze(-1), 0.0)
    return grad.to(logits.dtype).contiguous()


def _backward_triton(grad_output, logits, target, lse, ignore_index, z_loss, reduction):
    logits = _row_major(logits)
    num_tokens, vocab_size = logits.shape
    grad_scale = _grad_scale(grad_output, target, ignore_index, reduction)
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if num_tokens:
        block_v, rows, num_warps = _tiling(num_tokens, vocab_size, logits.device)
        _cross_entropy_backward_kernel[(triton.cdiv(num_tokens, rows),)](
            logits, target, lse.contiguous(), grad_scale, grad_logits, num_tokens, logits.stride(0),
            grad_logits.stride(0), 1 if reduction == "none" else 0, vocab_size, ignore_index, float(z_loss),
            BLOCK_V=block_v, ROWS=rows, num_warps=num_warps,
        )  # fmt: skip
    return grad_logits


@torch.library.custom_op(
    "colo::cross_entropy",
    mutates_args=(),
    schema="(Tensor logits, Tensor target, int ignore_index, float z_loss, str reduction, str backend) "
    "-> (Tensor, Tensor)",
)
def _cross_entropy_op(logits, target, ignore_index, z_loss, reduction, backend):
    """``(loss, lse)``: the reduced fp32 loss and each row's fp32 logsumexp (saved for the backward)."""
    if op_backend(backend, logits, target) == "triton":
        loss_rows, lse = _cross_entropy_rows_triton(_row_major(logits), target, ignore_index=ignore_index,
                                                    z_loss=z_loss)  # fmt: skip
        return _reduce(loss_rows, target, ignore_index, reduction), lse
    return _forward_torch(logits, target, ignore_index, z_loss, reduction)


@_cross_entropy_op.register_fake
def _(logits, target, ignore_index, z_loss, reduction, backend):
    rows = logits.shape[0]
    loss = logits.new_empty((rows,) if reduction == "none" else (), dtype=torch.float32)
    return loss, logits.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(
    "colo::cross_entropy_backward",
    mutates_args=(),
    schema="(Tensor grad_output, Tensor logits, Tensor target, Tensor lse, int ignore_index, float z_loss, "
    "str reduction, str backend) -> Tensor",
)
def _cross_entropy_backward_op(grad_output, logits, target, lse, ignore_index, z_loss, reduction, backend):
    """The gradient of the logits given the loss's gradient and the saved logsumexp."""
    if op_backend(backend, logits, target) == "triton":
        return _backward_triton(grad_output, logits, target, lse, ignore_index, z_loss, reduction)
    return _backward_torch(grad_output, logits, target, lse, ignore_index, z_loss, reduction)


@_cross_entropy_backward_op.register_fake
def _(grad_output, logits, target, lse, ignore_index, z_loss, reduction, backend):
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, z_loss, reduction, backend = inputs
    ctx.ignore_index, ctx.z_loss, ctx.reduction, ctx.backend = ignore_index, z_loss, reduction, backend
    ctx.save_for_backward(logits, target, output[1])


def _backward(ctx, grad_output, _dlse):
    logits, target, lse = ctx.saved_tensors
    grad_logits = torch.ops.colo.cross_entropy_backward(
        grad_output, logits, target, lse, ctx.ignore_index, ctx.z_loss, ctx.reduction, ctx.backend
    )
    return grad_logits, None, None, None, None, None


_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
    backend: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against ``target``, with optional z-loss, for vocabularies of any size.

    Each token's loss is ``logsumexp(x) - x[target] + z_loss * logsumexp(x) ** 2``; the z-loss term (PaLM,
    Chowdhery et al., 2022, section 5) keeps the softmax normalizer near 1. Tokens whose target is
    ``ignore_index`` add nothing and get zero gradient. The loss is accumulated and returned in fp32 whatever the
    logits dtype. With ``reduction="mean"`` the sum is divided by the number of non-ignored tokens, or by 1 when
    every token is ignored, so an all-ignored batch gives a loss of 0 and zero gradients (``F.cross_entropy``
    returns NaN there). On the Triton path a target outside ``[0, vocab_size)`` gives a NaN loss for that token.

    Args:
        logits (torch.Tensor): ``(num_tokens, vocab_size)`` unnormalized scores, fp32, bf16 or fp16 for Triton.
        target (torch.Tensor): ``(num_tokens,)`` int64 (or int32) class indices.
        ignore_index (int): target value that marks tokens without a loss. Default: -100.
        z_loss (float): weight of the squared logsumexp added to each token's loss. Default: 0.0.
        reduction (str): ``"mean"`` over non-ignored tokens, ``"sum"``, or ``"none"`` (per-token losses, 0 for
            ignored tokens). Default: ``"mean"``.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; None follows `use_backend` and
            ``COLO_KERNELS``. Default: None.

    Returns:
        torch.Tensor: the fp32 loss, a scalar, or ``(num_tokens,)`` with ``reduction="none"``.

    Raises:
        UnsupportedKernelInput: on the Triton path, for logits that are not fp32/bf16/fp16 or a non-integer target.
    """
    _check_inputs(logits, target, reduction)
    backend = resolve_backend("cross_entropy", logits, target, backend=backend)
    if backend == "triton":
        _check_triton_inputs("cross_entropy", logits, target)
    loss, _ = torch.ops.colo.cross_entropy(logits, target, int(ignore_index), float(z_loss), reduction, backend)
    return loss
