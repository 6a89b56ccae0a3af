"""The clipped policy-gradient loss of GRPO / RLOO, KL estimators to the reference, and loss aggregation.

Per response token ``t`` of row ``i``, with ``logp`` the policy's log-prob of the sampled token (differentiable),
``old`` the log-prob under the policy that generated the rollout (recomputed by the trainer's forward before the
update), ``ref`` the frozen reference's, ``A_i`` the row's advantage (`colo.apps.rlhf.advantages`) and
``rho = exp(logp - old)``::

    loss_t = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta * KL_t

(PPO's clipped surrogate, Schulman et al., 2017; the asymmetric ``eps_high`` is DAPO's "clip-higher", Yu et al.,
2025). ``KL_t`` estimates ``KL(pi || ref)`` from the sampled token with ``x = ref - logp`` (Schulman, 2020,
"Approximating KL divergence"):

- ``"k1"``: ``-x`` (unbiased, high variance, can be negative);
- ``"k2"``: ``x^2 / 2`` (biased, low variance);
- ``"k3"``: ``exp(x) - x - 1`` (unbiased, always >= 0; GRPO's and TRL's choice).

With ``kl_ratio_correction`` the KL term is ``beta * rho * KL_t`` (DeepSeek-V3.2, Eq. 8; TRL 1.16's default
``use_bias_correction_kl=True``): the ratio is differentiable, so the gradient is the unbiased reverse-KL gradient
even on-policy, where ``rho = 1``.

The per-token losses become one scalar by an explicit aggregation over the *whole* update batch (every microbatch on
every data-parallel rank), with ``M_i`` the response mask of row ``i``, ``N`` the batch's response tokens, ``S`` its
rows and ``L`` the generation budget (``max_new_tokens``):

- ``"token-mean"`` (TRL's ``dapo``, DAPO's token-level loss): ``sum_i sum_t M_it loss_it / N``;
- ``"seq-mean-token-mean"`` (TRL's ``grpo``, the GRPO paper): ``sum_i (sum_t M_it loss_it / |M_i|) / S``;
- ``"seq-mean-token-sum-norm"`` (TRL's ``dr_grpo``): ``sum_i sum_t M_it loss_it / (S L)``.

``N`` and ``S`` are *global* counts (`global_counts`: one all-reduce before the loss), and `aggregate_loss` returns
this microbatch's share of the global scalar: summed over microbatches and ranks it is the loss, so a step's loss and
update do not depend on the data-parallel size or the number of microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
"""The ``estimator`` values of `kl_penalty`."""

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""The ``mode`` values of `aggregate_loss` (TRL's ``dapo``, ``grpo`` and ``dr_grpo``)."""

TRL_LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
"""TRL's ``GRPOConfig.loss_type`` of each aggregation."""


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || ref)`` from log-probs of tokens sampled from ``pi`` (module docstring).

    Args:
        logps (torch.Tensor): the policy's per-token log-probs.
        ref_logps (torch.Tensor): the reference's, same shape.
        estimator (str): ``"k1"``, ``"k2"`` or ``"k3"``. Default: ``"k3"``.

    Returns:
        torch.Tensor: per-token estimates (unmasked: multiply by the response mask).
    """
    x = ref_logps - logps
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(x) - x - 1
    raise ValueError(f"kl estimator {estimator!r} is unknown; use one of {KL_ESTIMATORS}")


@dataclass(frozen=True)
class PolicyLossTerms:
    """The per-token pieces of `clipped_policy_loss` (all ``(R, T)``, unmasked).

    Attributes:
        loss: the per-token loss (surrogate plus ``beta`` times the KL estimate).
        ratio: ``rho = exp(logp - old)`` (detached).
        clipped: 1.0 where the clip is active: ``rho < 1 - eps_low`` with ``A < 0`` or ``rho > 1 + eps_high`` with
            ``A > 0`` (TRL's ``clip_ratio/region_mean``).
        kl: the KL estimate (detached; zeros without a reference).
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


def clipped_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_ratio_correction: bool = False,
    importance_weights: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """The per-token clipped surrogate plus the KL penalty (module docstring).

    Args:
        logps (torch.Tensor): ``(R, T)`` policy log-probs of the response tokens (differentiable).
        old_logps (torch.Tensor): ``(R, T)`` log-probs of the policy that sampled them.
        advantages (torch.Tensor): ``(R,)`` per-row (or ``(R, T)`` per-token) advantages.
        eps_low (float): lower clip range. Default: ``0.2``.
        eps_high (float | None): upper clip range; ``None``: ``eps_low``. Default: ``None``.
        ref_logps (torch.Tensor | None): ``(R, T)`` reference log-probs (needed when ``beta > 0``). Default: ``None``.
        beta (float): the KL coefficient. Default: ``0.0``.
        kl_estimator (str): ``"k1"``, ``"k2"`` or ``"k3"``. Default: ``"k3"``.
        kl_ratio_correction (bool): weight the KL term by ``rho`` (module docstring). Default: ``False``.
        importance_weights (torch.Tensor | None): ``(R, T)`` detached weights multiplying the clipped surrogate
            (not the KL term): the behaviour importance weights of off-policy rollouts
            (`colo.apps.rlhf.off_policy.truncated_importance_weights`). ``None``: no weighting. Default: ``None``.

    Returns:
        PolicyLossTerms: the per-token loss and its statistics.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    if importance_weights is not None:  # decoupled PPO: the surrogate anchored at the proximal policy, reweighted
        loss = importance_weights.detach().to(loss.dtype) * loss
    clipped = ((ratio < 1 - eps_low) & (advantages < 0)) | ((ratio > 1 + eps_high) & (advantages > 0))
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"clipped_policy_loss: beta={beta} needs the reference log-probs (ref_logps)")
        kl = kl_penalty(logps, ref_logps.to(logps.dtype), kl_estimator)
        loss = loss + beta * (kl * ratio if kl_ratio_correction else kl)
        kl = kl.detach()
    elif ref_logps is not None:
        kl = kl_penalty(logps, ref_logps.to(logps.dtype), kl_estimator).detach()
    else:
        kl = torch.zeros_like(logps).detach()
    return PolicyLossTerms(loss=loss, ratio=ratio.detach(), clipped=clipped.to(logps.dtype), kl=kl)


def rows_with_gradient(advantages: torch.Tensor, response_mask: torch.Tensor, *, beta: float) -> torch.Tensor:
    """``(R,)`` bool: the rows whose per-token loss is not identically zero, so the update must run them.

    A row moves no weight when none of its tokens is in the loss (an empty response mask: a truncated completion under
    ``mask_truncated``), or when ``beta == 0`` and its advantage is exactly 0 (``-min(rho * 0, clip(rho) * 0) = 0`` for
    every ratio: a group of equal rewards). Such a row adds nothing to the loss or the gradient; the aggregation's
    counts (`global_counts`) must still be taken over the whole batch, with it.

    Args:
        advantages (torch.Tensor): ``(R,)`` per-row or ``(R, T)`` per-token advantages.
        response_mask (torch.Tensor): ``(R, T)`` 1 on the tokens in the loss.
        beta (float): the KL coefficient (``!= 0``: every row with a token in the loss has a KL gradient).
    """
    has_tokens = response_mask.bool().any(dim=1)
    if beta != 0.0:
        return has_tokens
    per_row = advantages if advantages.dim() == 1 else (advantages * response_mask).abs().amax(dim=1)
    return has_tokens & (per_row.to(has_tokens.device) != 0)


def keep_whole_microbatches(keep: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """``keep`` (``(R,)`` bool, from `rows_with_gradient`) with left-out rows put back, first first, until the kept
    rows fill whole microbatches, at least one row each: every data-parallel rank runs every microbatch's forward and
    backward, so ranks stay in step. ``R`` must be a multiple of ``num_microbatches``."""
    keep = keep.clone()
    kept = int(keep.sum())
    short = (-kept) % num_microbatches if kept else num_microbatches
    for row in (~keep).nonzero().flatten().tolist()[:short]:
        keep[row] = True
    return keep


@dataclass(frozen=True)
class AggregationCounts:
    """The global denominators of `aggregate_loss` for one update batch.

    Attributes:
        num_tokens: ``N``, response tokens of the batch on every data-parallel rank.
        num_sequences: ``S``, its rows on every data-parallel rank.
        max_new_tokens: ``L``, the generation budget (``"seq-mean-token-sum-norm"``'s constant length).
    """

    num_tokens: float
    num_sequences: float
    max_new_tokens: int


def global_counts(response_mask: torch.Tensor, *, max_new_tokens: int, group=None) -> AggregationCounts:
    """`AggregationCounts` of the update batch whose local rows are ``response_mask`` (``(R, T)``), summed over
    the ranks of ``group`` (a colo `Group` of the ranks with different samples; one all-reduce of two numbers).

    Every rank of ``group`` must call it (before its first microbatch), with its own share of the batch.
    """
    counts = torch.tensor([float(response_mask.sum()), float(response_mask.shape[0])], dtype=torch.float64)
    if group is not None and group.size > 1:
        import torch.distributed as dist

        from colo.comm import all_reduce

        nccl = dist.get_backend(group.process_group) == "nccl"
        reduced = counts.to(torch.device("cuda", torch.cuda.current_device())) if nccl else counts
        all_reduce(reduced, group=group)
        counts = reduced.cpu()
    return AggregationCounts(
        num_tokens=float(counts[0]), num_sequences=float(counts[1]), max_new_tokens=int(max_new_tokens)
    )


def aggregate_loss(
    per_token_loss: torch.Tensor, response_mask: torch.Tensor, mode: str, counts: AggregationCounts
) -> torch.Tensor:
    """This microbatch's share of the batch loss under aggregation ``mode`` (module docstring).

    Args:
        per_token_loss (torch.Tensor): ``(R, T)`` per-token losses of this microbatch's rows.
        response_mask (torch.Tensor): ``(R, T)`` 1 on response tokens (up to and including the eos).
        mode (str): one of `LOSS_AGGREGATIONS`.
        counts (AggregationCounts): the global counts of the whole update batch (`global_counts`).

    Returns:
        torch.Tensor: a scalar; the sum of it over every microbatch and rank is the batch's loss.
    """
    mask = response_mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if mode == "token-mean":
        return masked.sum() / max(counts.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_row = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_row.sum() / max(counts.num_sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / max(counts.num_sequences * counts.max_new_tokens, 1.0)
    raise ValueError(f"loss aggregation {mode!r} is unknown; use one of {LOSS_AGGREGATIONS}")
