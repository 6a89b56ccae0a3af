"""Per-token log-probs and entropies of a causal LM: the one path of DPO, GRPO and PPO.

Every preference and online-RL task scores positions of a sequence by the softmax of the (temperature-scaled) logits
``z`` there: the log-prob of one given token ``y``, ``z_y - logsumexp(z)`` (DPO's sequence log-probs are sums of
them), and for the policy-gradient tasks the entropy, ``H = logsumexp(z) - sum_v softmax(z)_v z_v``. Both are
computed here and nowhere else, in fp32, from either form of the logits:

- the whole vocabulary (one process, data parallelism, or a plan that gathers the logits): ``log_softmax`` and a
  gather;
- this rank's contiguous range of vocabulary columns under tensor parallelism (a column-parallel ``lm_head``):
  `vocab_parallel_token_stats`, two small all-reduces per position (Megatron-LM's vocabulary-parallel
  cross-entropy, extended by the entropy's third sum) and none in the backward, so the ``(tokens, vocab)`` logits
  are never gathered.

`token_logps` takes logits in either form; `llama_token_logps` takes colo's `Llama` and the final hidden states of
the scoring positions, and reads which form its ``lm_head`` gives from the model's objective (a
`colo.apps.models.llama.VocabParallelCausalLMObjective` under a tensor-parallel plan). ``vocab_size`` limits the
classes to the ids generation samples from (a tokenizer smaller than the model's vocabulary, or the padding of a
vocabulary split unevenly): columns from it on are no class.
"""

from __future__ import annotations

import torch
from torch import nn

from colo.comm import Group, all_reduce
from colo.tensor.vocab_parallel import shifted_vocab_parallel_rows

from ..models.llama import IGNORE_INDEX, Llama, VocabParallelCausalLMObjective


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits`` in fp32 divided by the sampling temperature (0, greedy, and 1 leave them as they are)."""
    scaled = logits.float()
    return scaled / temperature if temperature not in (0, 1) else scaled


def token_logps(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    group: Group | None = None,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` (and entropies) under ``softmax(logits / temperature)``, in fp32.

    Args:
        logits (torch.Tensor): ``(..., V)``: the whole vocabulary (``group=None``), or this rank's columns
            ``[r * V, (r + 1) * V)`` of a vocabulary split over ``group`` (rank ``r``).
        tokens (torch.Tensor): ``(...)`` long ids in ``[0, vocab_size)``, the same on every rank of ``group``.
        temperature (float): the sampling temperature (0, greedy, taken as 1). Default: ``1.0``.
        vocab_size (int | None): the number of classes: columns from it on (a tokenizer smaller than the model's
            vocabulary, a padded split) are left out of the softmax; ``None``: every column. Default: ``None``.
        group (Group | None): the tensor-parallel group the vocabulary is split over; ``None``: whole logits.
            Default: ``None``.
        entropy (bool): also return the entropies. Default: ``False``.
        entropy_grad (bool): keep the entropy differentiable (an entropy bonus); else it is detached (a metric).
            Default: ``False``.

    Returns:
        tuple[torch.Tensor, torch.Tensor | None]: ``(logps, entropy)``, each ``(...)`` float32 (``entropy`` is
        ``None`` unless asked for); ``logps`` differentiable.
    """
    scaled = scale_logits(logits, temperature)
    if group is not None:
        logps, entropies = vocab_parallel_token_stats(
            scaled, tokens, group=group, vocab_size=vocab_size, entropy_grad=entropy_grad
        )
        return logps, entropies if entropy else None
    if vocab_size is not None and vocab_size < scaled.shape[-1]:
        scaled = scaled[..., :vocab_size]
    log_probs = torch.log_softmax(scaled, dim=-1)
    logps = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logps, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        source = log_probs if entropy_grad else log_probs.detach()
        entropies = -(source.exp() * source).sum(-1)
    return logps, entropies


def target_logps(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    vocab_size: int | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """`token_logps` of each position's target, 0 where the target is ``ignore_index`` (sums along a row are DPO's
    sequence log-probs). ``logits`` ``(..., V)`` and ``targets`` ``(...)`` are aligned (already shifted)."""
    ignored = targets == ignore_index
    logps, _ = token_logps(logits, targets.masked_fill(ignored, 0), vocab_size=vocab_size, group=group)
    return logps.masked_fill(ignored, 0.0)


def vocabulary_split(model: nn.Module) -> tuple[Group | None, int | None]:
    """``(group, vocab_size)`` of colo's `Llama` whose ``lm_head`` leaves each rank its vocabulary columns (a
    tensor-parallel plan's `VocabParallelCausalLMObjective`); ``(None, None)`` when it gives whole logits."""
    objective = getattr(model, "objective", None)
    if isinstance(objective, VocabParallelCausalLMObjective):
        return objective.group, objective.vocab_size
    return None, None


def llama_token_logps(
    model: Llama,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_limit: int | None = None,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logps` of colo's `Llama` from the final hidden states of the positions that predict ``tokens``: its
    ``lm_head``'s output, under tensor parallelism this rank's vocabulary columns (`vocabulary_split`), never
    gathered.

    Args:
        model (Llama): the model (its ``lm_head`` and ``objective``).
        hidden (torch.Tensor): ``(batch, seq, hidden)`` final hidden states (after the last norm).
        tokens (torch.Tensor): ``(batch, seq)`` the tokens whose log-probs are taken (no shift here).
        temperature (float): the sampling temperature. Default: ``1.0``.
        vocab_limit (int | None): only ids below it are classes (`colo.apps.generation.SamplingParams`'s
            ``vocab_limit``); ``None``: the model's vocabulary. Default: ``None``.
        entropy, entropy_grad: as `token_logps`.

    Returns:
        tuple[torch.Tensor, torch.Tensor | None]: ``(logps, entropy)``, each ``(batch, seq)`` float32.
    """
    group, vocab_size = vocabulary_split(model)
    if vocab_limit is not None:
        vocab_size = vocab_limit if vocab_size is None else min(vocab_size, vocab_limit)
    return token_logps(
        model.lm_head(hidden),
        tokens,
        temperature=temperature,
        vocab_size=vocab_size,
        group=group,
        entropy=entropy,
        entropy_grad=entropy_grad,
    )


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
    """Log-probs and entropies of logits split over the vocabulary, without gathering them.

    Rank ``r`` of ``group`` holds vocabulary columns ``[r * V, (r + 1) * V)`` with ``V = local_logits.shape[-1]`` (a
    column-parallel ``lm_head``'s output). Per token row: one all-reduce (max) of one number and one all-reduce (sum)
    of three (`VocabParallelTokenStats`); the backward needs none. Computed in float32.

    Args:
        local_logits (torch.Tensor): ``(..., V)`` this rank's columns, already divided by the temperature.
        tokens (torch.Tensor): ``(...)`` ids in ``[0, vocab_size)``, the same on every rank.
        group (Group): the group the vocabulary is split over, e.g. ``mesh.group("tp")``.
        vocab_size (int | None): the number of classes when the columns hold more (padding, or ids generation never
            samples): columns from it on are no class; ``None``: every column is one. Default: ``None``.
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
