"""The off-policy correction of asynchronous GRPO (``grpo.max_staleness=1``): decoupled PPO with truncated importance
weights.

With one-step off-policy rollouts (`colo.apps.rlhf.async_rollouts`) the completions trained on at step ``k`` were
sampled by the *behaviour* policy ``pi_behav`` (the weights before update ``k - 1``), while the clipped surrogate
must be anchored at the *proximal* policy ``pi_prox`` (the weights before update ``k``: the trainer's forward with
the current weights, before the update). The decoupled PPO objective (Hilton et al., 2022, "Batch size-invariance
for policy optimization"; AReaL, Fu et al., 2025) separates the two, per response token ``t`` of row ``i``::

    r_t   = exp(logp_t - prox_t)                              (the PPO ratio against the proximal policy)
    w_t   = min(exp(prox_t - behav_t), C)                     (the behaviour importance weight, truncated, detached)
    loss_t = -w_t * min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i) + beta * KL_t

``behav_t`` is the log-prob the rollout engine recorded when it sampled the token (``Rollout.logprobs``), ``prox_t``
the trainer's forward over the rollout with the current weights (with one update per rollout that is the update's
own forward, detached, so ``r_t = 1`` in value and the gradient is ``w_t A_i grad logp_t``: verl's truncated
importance sampling, TIS), and ``C`` is ``grpo.importance_sampling_cap``. Truncation (``min``, verl's TIS and TRL's
``vllm_importance_sampling_mode="token_truncate"``) keeps every token with a bounded weight; AReaL instead drops the
tokens above the cap (TRL's ``token_mask``). The KL penalty is not weighted (TRL adds it after the correction).
When ``behav == prox`` every ``w_t = 1`` and the loss is the on-policy loss exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def truncated_importance_weights(
    proximal_logps: torch.Tensor, behaviour_logps: torch.Tensor, *, cap: float
) -> torch.Tensor:
    """``w = min(exp(proximal - behaviour), cap)`` per token, detached (module docstring).

    Args:
        proximal_logps (torch.Tensor): ``(R, T)`` log-probs of the sampled tokens under the current weights.
        behaviour_logps (torch.Tensor): ``(R, T)`` log-probs the sampling policy recorded (``Rollout.logprobs``).
        cap (float): ``C > 0``, the truncation of the weight.

    Returns:
        torch.Tensor: ``(R, T)`` weights in ``(0, cap]``, in ``proximal_logps``'s dtype (unmasked: the loss's mask
        applies).
    """
    if cap <= 0:
        raise ValueError(f"truncated_importance_weights: cap={cap} must be > 0 (grpo.importance_sampling_cap)")
    log_weight = proximal_logps.detach() - behaviour_logps.detach().to(proximal_logps.dtype)
    return torch.exp(log_weight).clamp(max=cap)


@dataclass(frozen=True)
class ImportanceWeightStats:
    """Sums and extremes of the *untruncated* weights ``exp(prox - behav)`` over the response tokens of a batch.

    Attributes:
        num_tokens: response tokens counted.
        weight_sum: sum of the weights (mean = ``weight_sum / num_tokens``).
        capped_tokens: tokens whose weight exceeded the cap (truncated).
        weight_max: the largest weight (0 with no token).
        weight_min: the smallest weight (``inf`` with no token).
    """

    num_tokens: float
    weight_sum: float
    capped_tokens: float
    weight_max: float
    weight_min: float


def importance_weight_stats(
    proximal_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, *, cap: float
) -> ImportanceWeightStats:
    """The statistics of the untruncated weights on the tokens where ``mask`` is 1 (for the step's metrics)."""
    weights = torch.exp(proximal_logps.detach().double() - behaviour_logps.detach().double())
    chosen = weights[mask.bool()]
    if chosen.numel() == 0:
        return ImportanceWeightStats(0.0, 0.0, 0.0, 0.0, float("inf"))
    return ImportanceWeightStats(
        num_tokens=float(chosen.numel()),
        weight_sum=float(chosen.sum()),
        capped_tokens=float((chosen > cap).sum()),
        weight_max=float(chosen.max()),
        weight_min=float(chosen.min()),
    )
