"""Per-token log-probs of given tokens and the policy's entropy, from whole or vocabulary-parallel logits.

The policy forward of online RL (GRPO, PPO's actor) needs two numbers per response position of the softmax of the
(temperature-scaled) logits ``z``: the log-prob of the sampled token, ``z_y - logsumexp(z)``, and the entropy,
``H = logsumexp(z) - sum_v softmax(z)_v z_v``. Under tensor parallelism ``lm_head`` leaves each rank a contiguous
range of vocabulary columns; `vocab_parallel_token_stats` computes both from this rank's columns with two small
all-reduces per position (Megatron-LM's vocabulary-parallel cross-entropy, extended by the entropy's third sum), so
the ``(tokens, vocab)`` logits are never gathered.
"""

from __future__ import annotations

import torch

from colo.comm import Group, all_reduce
from colo.tensor.vocab_parallel import shifted_vocab_parallel_rows


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits`` in fp32 divided by the sampling temperature (0, greedy, and 1 leave them as they are)."""
    scaled = logits.float()
    return scaled / temperature if temperature not in (0, 1) else scaled


def token_logprobs_and_entropy(
    scaled_logits: torch.Tensor, tokens: torch.Tensor, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``tokens`` and entropies under ``softmax(scaled_logits)`` over the whole vocabulary, in fp32.

    Args:
        scaled_logits (torch.Tensor): ``(..., vocab)`` logits already divided by the temperature.
        tokens (torch.Tensor): ``(...)`` long ids.
        entropy_grad (bool): keep the entropy differentiable (an entropy bonus); ``False`` returns it detached
            (a metric). Default: ``False``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(logps, entropy)``, each ``(...)`` float32; ``logps`` differentiable.
    """
    log_probs = torch.log_softmax(scaled_logits.float(), dim=-1)
    logps = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        source = log_probs if entropy_grad else log_probs.detach()
        entropy = -(source.exp() * source).sum(-1)
    return logps, entropy


class VocabParallelTokenStats(torch.autograd.Function):
    """Per-token log-prob of a given token and entropy of vocabulary-parallel logits ``z`` (fp32).

    Forward: all-reduce (max) of each row's largest logit ``m``; then one all-reduce (sum) of three numbers per row:
    the token's shifted logit ``z_y - m`` (from the rank that holds ``y``), ``S = sum exp(z - m)`` and
    ``sum exp(z - m) (z - m)``. Then ``logp = z_y - m - log S`` and ``H = log S - E_p[z - m]``.
    Backward: no communication. With ``p`` the softmax (this rank's columns, from the saved ``S``),
    ``d logp / dz = onehot(y) - p`` and ``dH / dz = p (E_p[z] - z)``, both local to a column.
    """

    @staticmethod
    def forward(ctx, logits, tokens, group: Group, vocab_size: int | None, entropy_grad: bool):
        shifted, local_tokens, owned, token_logit, padding = shifted_vocab_parallel_rows(
            logits, tokens, group=group, vocab_size=vocab_size
        )
        exp = shifted.exp()
        if padding is not None:  # exp is 0 there; keep 0 * (-inf) out of the weighted sum
            shifted = shifted.masked_fill(padding, 0.0)
        stats = torch.stack([token_logit, exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
        all_reduce(stats, "sum", group=group)
        token_logit, sum_exp, weighted = stats
        log_sum_exp = sum_exp.log()
        mean_shifted = weighted / sum_exp
        shape = logits.shape[:-1]
        logps = (token_logit - log_sum_exp).view(shape)
        entropy = (log_sum_exp - mean_shifted).view(shape)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.entropy_grad = entropy_grad
        if entropy_grad:
            ctx.save_for_backward(softmax, local_tokens, owned, shifted, mean_shifted)
        else:
            ctx.mark_non_differentiable(entropy)
            ctx.save_for_backward(softmax, local_tokens, owned)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        if ctx.entropy_grad:
            softmax, local_tokens, owned, shifted, mean_shifted = ctx.saved_tensors
        else:
            softmax, local_tokens, owned = ctx.saved_tensors
        grad = torch.zeros_like(softmax)
        if grad_logps is not None:
            scale = grad_logps.reshape(-1, 1).float()
            grad -= softmax * scale
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, local_tokens] += owned.to(grad.dtype) * scale.squeeze(-1)
        if ctx.entropy_grad and grad_entropy is not None:
            grad += softmax * (mean_shifted.unsqueeze(-1) - shifted) * grad_entropy.reshape(-1, 1).float()
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_token_stats(
    local_logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    group: Group,
    vocab_size: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs_and_entropy` of logits split over the vocabulary, without gathering them.

    Rank ``r`` of ``group`` holds vocabulary columns ``[r * V, (r + 1) * V)`` with ``V = local_logits.shape[-1]`` (a
    column-parallel ``lm_head``'s output). Per token row: one all-reduce (max) of one number and one all-reduce (sum)
    of three (`VocabParallelTokenStats`); the backward needs none. Computed in float32.

    Args:
        local_logits (torch.Tensor): ``(..., V)`` this rank's columns, already divided by the temperature.
        tokens (torch.Tensor): ``(...)`` ids in ``[0, vocab_size)``, the same on every rank.
        group (Group): the group the vocabulary is split over, e.g. ``mesh.group("tp")``.
        vocab_size (int | None): the true vocabulary size when the columns are padded (columns from it on are no
            class); ``None``: every column is one. Default: ``None``.
        entropy_grad (bool): keep the entropy differentiable (saves this rank's scaled logits for the backward);
            ``False`` returns it as a constant. Default: ``False``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(logps, entropy)``, each ``(...)`` float32; ``logps`` differentiable.
    """
    if not isinstance(group, Group):
        raise TypeError(f"vocab_parallel_token_stats: group must be a colo.comm.Group, not {type(group).__name__}")
    if local_logits.dim() == 0 or local_logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"vocab_parallel_token_stats: local_logits {tuple(local_logits.shape)} and tokens {tuple(tokens.shape)} "
            "must agree on every dimension but the last (the vocabulary)"
        )
    if local_logits.shape[-1] == 0:
        raise ValueError(
            "vocab_parallel_token_stats: local_logits hold no vocabulary columns; every rank needs at least one (pad "
            "the vocabulary to a multiple of the group size)"
        )
    return VocabParallelTokenStats.apply(local_logits, tokens, group, vocab_size, entropy_grad)
