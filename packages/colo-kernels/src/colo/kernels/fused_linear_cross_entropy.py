"""The language-model head and its cross-entropy loss in one op that never holds the full ``(tokens, vocab)`` logits.

`fused_linear_cross_entropy` walks the tokens in chunks. For each chunk it computes the chunk's logits with a
torch matmul, runs the cross-entropy forward and backward on them (the Triton kernel on the Triton path, torch
ops on the torch path), overwriting the logits with their gradient, and immediately turns that into the chunk's
``grad_hidden`` and a contribution to ``grad_weight`` (and ``grad_bias``). The gradients are therefore computed
during the forward and kept for the backward, which only scales them by the incoming gradient: the operator
``torch.ops.colo.fused_linear_cross_entropy`` returns the loss and the three gradients of a unit loss. Peak extra
memory is one chunk of logits (plus its fp32 copy on the torch path) instead of ``tokens * vocab`` logits and
their gradient. The same scheme is known as "fused linear cross-entropy" (Liger-Kernel, Hsu et al., 2024) and
"cut cross-entropy" (Wijmans et al., 2024) for the variant that also tiles the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cross_entropy import _check_triton_inputs, _cross_entropy_rows_triton, _mean_divisor, cross_entropy_reference
from .dispatch import op_backend, resolve_backend


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The naive computation: full logits ``hidden @ weight.T (+ bias)``, then mean cross-entropy in fp32.

    Args:
        hidden (torch.Tensor): ``(..., hidden_size)`` final hidden states.
        weight (torch.Tensor): ``(vocab_size, hidden_size)`` output projection.
        target (torch.Tensor): ``hidden.shape[:-1]`` class indices.
        bias (torch.Tensor | None): ``(vocab_size,)`` output bias. Default: None.
        ignore_index (int): target value of tokens without a loss. Default: -100.
        z_loss (float): weight of ``logsumexp(logits) ** 2`` added per token. Default: 0.0.

    Returns:
        torch.Tensor: the fp32 mean loss over non-ignored tokens (0 when all are ignored).
    """
    logits = F.linear(hidden, weight, bias)
    return cross_entropy_reference(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index, z_loss=z_loss
    )


def _chunk_loss_and_grad_torch(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int, z_loss: float, grad_scale: torch.Tensor
) -> torch.Tensor:
    """Per-row fp32 losses of a chunk; overwrites ``logits`` with ``d(loss.sum() * grad_scale) / d(logits)``."""
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0).long().unsqueeze(1)
    logits32 = logits.float()  # the same tensor when logits are fp32: everything below is then in place
    lse = torch.logsumexp(logits32, dim=-1)
    loss = lse - logits32.gather(1, safe_target).squeeze(1)
    if z_loss:
        loss = loss + z_loss * lse.square()
    loss = torch.where(valid, loss, 0.0)
    grad = logits32.sub_(lse.unsqueeze(1)).exp_()
    if z_loss:
        grad.mul_((1.0 + 2.0 * z_loss * lse).unsqueeze(1))
    grad.scatter_add_(1, safe_target, -valid.to(grad.dtype).unsqueeze(1))
    grad.mul_((valid * grad_scale).unsqueeze(1))
    if grad is not logits:
        logits.copy_(grad)
    return loss


def _chunk_loss_and_grad_triton(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int, z_loss: float, grad_scale: torch.Tensor
) -> torch.Tensor:
    """The same as `_chunk_loss_and_grad_torch`, in the Triton cross-entropy kernel (one read, one write)."""
    loss, _ = _cross_entropy_rows_triton(
        logits, target, ignore_index=ignore_index, z_loss=z_loss, grad_scale=grad_scale
    )
    return loss


def default_chunk_size(num_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk so that a chunk's logits (``chunk * vocab``) are about as large as ``hidden``."""
    num_chunks = max(1, -(-vocab_size // max(hidden_size, 1)))
    return max(1, -(-num_tokens // num_chunks))


def _loss_and_grads(hidden, weight, bias, target, ignore_index, z_loss, chunk_size, chunk_fn, needs_grad):
    """The chunked forward: ``(loss, grad_hidden, grad_weight, grad_bias)`` for a unit gradient of the loss; the
    gradients not asked for are empty."""
    num_tokens = hidden.shape[0]
    needs_hidden, needs_weight, needs_bias = needs_grad
    divisor = _mean_divisor(target, ignore_index)
    grad_scale = divisor.reciprocal().reshape(1)
    loss_rows = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0)
    # grad_weight accumulates in the weight's dtype through addmm_ (no weight-sized temporary per chunk); with
    # bf16 weights that rounds once per chunk, slightly more than the naive path's single rounding.
    grad_weight = torch.zeros_like(weight) if needs_weight else weight.new_empty(0)
    grad_bias = weight.new_zeros(weight.shape[0], dtype=torch.float32) if needs_bias else weight.new_empty(0)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        hidden_chunk = hidden[start:end]
        logits = hidden_chunk @ weight.T if bias is None else torch.addmm(bias, hidden_chunk, weight.T)
        loss_rows[start:end] = chunk_fn(
            logits, target[start:end], ignore_index=ignore_index, z_loss=z_loss, grad_scale=grad_scale
        )
        grad_logits = logits  # overwritten in place by chunk_fn
        if needs_hidden:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        if needs_weight:
            grad_weight.addmm_(grad_logits.T, hidden_chunk)
        if needs_bias:
            grad_bias += grad_logits.sum(0, dtype=torch.float32)
        del logits, grad_logits
    return loss_rows.sum() / divisor, grad_hidden, grad_weight, grad_bias


@torch.library.custom_op(
    "colo::fused_linear_cross_entropy",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float z_loss, "
    "int chunk_size, bool hidden_grad, bool weight_grad, bool bias_grad, str backend) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _fused_linear_cross_entropy_op(
    hidden, weight, bias, target, ignore_index, z_loss, chunk_size, hidden_grad, weight_grad, bias_grad, backend
):
    """``(loss, grad_hidden, grad_weight, grad_bias)``: the fp32 mean loss of ``(tokens, hidden)`` states and the
    gradients of a unit loss (fp32 for the bias), computed in the forward; those not asked for are empty."""
    tensors = (hidden, weight, target) + (() if bias is None else (bias,))
    chunk_fn = _chunk_loss_and_grad_triton if op_backend(backend, *tensors) == "triton" else _chunk_loss_and_grad_torch
    needs_grad = (hidden_grad, weight_grad, bias_grad and bias is not None)
    return _loss_and_grads(hidden, weight, bias, target, ignore_index, z_loss, chunk_size, chunk_fn, needs_grad)


@_fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, target, ignore_index, z_loss, chunk_size, hidden_grad, weight_grad, bias_grad, backend):
    loss = hidden.new_empty((), dtype=torch.float32)
    grad_hidden = hidden.new_empty(hidden.shape if hidden_grad else (0,))
    grad_weight = weight.new_empty(weight.shape if weight_grad else (0,))
    grad_bias = weight.new_empty((weight.shape[0],) if bias_grad and bias is not None else (0,), dtype=torch.float32)
    return loss, grad_hidden, grad_weight, grad_bias


def _setup_context(ctx, inputs, output):
    bias = inputs[2]
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.needs = inputs[7:10]
    ctx.save_for_backward(*output[1:])


def _backward(ctx, grad_output, *_):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    hidden_grad, weight_grad, bias_grad = ctx.needs
    # Out of place, so that a second backward (retain_graph=True) scales the stored gradients only once.
    grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype) if hidden_grad else None
    grad_weight = grad_weight * grad_output.to(grad_weight.dtype) if weight_grad else None
    grad_bias = (grad_bias * grad_output).to(ctx.bias_dtype) if bias_grad and ctx.bias_dtype is not None else None
    return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


_fused_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target``, without materializing the logits.

    Tokens are processed ``chunk_size`` at a time: the chunk's logits are computed, turned into their gradient in
    place, and consumed into ``grad_hidden``/``grad_weight``/``grad_bias`` before the next chunk, so the extra
    memory is one chunk of logits rather than ``num_tokens * vocab_size``. Gradients are computed in the forward
    (only for inputs that require them, and only when grad mode is on) and scaled by the incoming gradient in the
    backward. The loss is fp32, the mean over non-ignored tokens, 0 when every token is ignored; each token may
    add ``z_loss * logsumexp(logits) ** 2`` (PaLM, Chowdhery et al., 2022). The torch backend runs the same
    chunking with torch ops; `fused_linear_cross_entropy_reference` is the naive full-logits computation.

    Args:
        hidden (torch.Tensor): ``(..., hidden_size)`` final hidden states (fp32, bf16 or fp16 for Triton).
        weight (torch.Tensor): ``(vocab_size, hidden_size)`` output projection, same dtype as ``hidden``.
        target (torch.Tensor): ``hidden.shape[:-1]`` int64 (or int32) class indices.
        bias (torch.Tensor | None): ``(vocab_size,)`` output bias. Default: None.
        ignore_index (int): target value of tokens without a loss. Default: -100.
        z_loss (float): weight of the squared logsumexp added to each token's loss. Default: 0.0.
        chunk_size (int | None): tokens per chunk; None picks `default_chunk_size` (a chunk's logits about the
            size of ``hidden``). Default: None.
        backend (str | None): ``"triton"`` (the Triton cross-entropy kernel per chunk), ``"torch"`` or
            ``"auto"``; None follows `use_backend` and ``COLO_KERNELS``. Default: None.

    Returns:
        torch.Tensor: the fp32 scalar mean loss.

    Raises:
        ValueError: for mismatched shapes or dtypes, or a chunk_size below 1.
        UnsupportedKernelInput: on the Triton path, for dtypes other than fp32/bf16/fp16 or a non-integer target.
    """
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy: weight must be (vocab_size, hidden_size={hidden.shape[-1]}), "
            f"got {tuple(weight.shape)}"
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"fused_linear_cross_entropy: target must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
            f"got {tuple(target.shape)}"
        )
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"fused_linear_cross_entropy: hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share a dtype"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size={chunk_size} must be at least 1 (or None)")
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    target1d = target.reshape(-1)
    tensors = (hidden2d, weight, target1d) + (() if bias is None else (bias,))
    backend = resolve_backend("fused_linear_cross_entropy", *tensors, backend=backend)
    if backend == "triton":
        _check_triton_inputs("fused_linear_cross_entropy", hidden2d, target1d, name="hidden")
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden2d.shape[0], weight.shape[1], weight.shape[0])
    grad_on = torch.is_grad_enabled()
    loss, *_ = torch.ops.colo.fused_linear_cross_entropy(
        hidden2d, weight, bias, target1d, int(ignore_index), float(z_loss), int(chunk_size),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad, backend,
    )  # fmt: skip
    return loss
