"""The arithmetic of PPO with a critic (Schulman et al., 2017; the RLHF recipe of Ziegler et al., 2019 and
Ouyang et al., 2022): rewards shaped by a KL penalty, GAE, advantage whitening over the global batch, the clipped
value loss, the clipped policy loss with a dual clip and an entropy bonus, and the KL coefficient's controllers.

Per response token ``t`` of row ``i`` (``M_it`` the response mask, a prefix of the ``T`` columns), with ``old`` the
policy's log-probs over the rollout (recomputed by the training forward), ``ref`` the frozen reference's, ``s_i`` the
row's score (a reward model or reward functions) and ``beta`` the KL coefficient:

- **rewards** (`kl_shaped_rewards`): ``r_it = -beta (old_it - ref_it)`` (the ``k1`` estimate of the KL per token) on
  every response token, plus ``s_i`` on the row's last response token;
- **GAE** (`gae`, Schulman et al., 2016): with the critic's values ``V_it`` (0 past the row's end)
  ``delta_it = r_it + gamma V_i,t+1 - V_it`` and ``A_it = delta_it + gamma lambda A_i,t+1``, so
  ``A_it = sum_{l >= 0} (gamma lambda)^l delta_i,t+l`` over the row's tokens; the returns are ``R_it = A_it + V_it``
  (the critic's targets);
- **whitening** (`whiten`): ``(A - mean) / sqrt(var + 1e-8)`` with the mean and the (Bessel-corrected) variance of
  every response token of the *global* batch (one all-reduce of three numbers over the data-parallel ranks), so the
  advantages do not depend on how the batch is split;
- **value loss** (`clipped_value_loss`): ``0.5 max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)``;
- **policy loss** (`ppo_policy_loss`): PPO's clipped surrogate with the asymmetric range ``[1 - eps_low,
  1 + eps_high]`` (`colo.apps.rlhf.policy_loss.clipped_policy_loss`) and, with ``dual_clip = c > 1``, the dual clip of
  Ye et al. (2020) for negative advantages, ``min(loss, -c A)``, minus ``entropy_coef`` times the policy's entropy;
- **KL coefficient** (`FixedKLController`, `AdaptiveKLController`): the adaptive one is Ziegler et al.'s
  proportional controller, ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta (1 + e n / horizon)`` with ``KL``
  the rollout's mean per-sequence KL (summed over tokens) and ``n`` its rows (TRL's ``AdaptiveKLController``).

The per-token losses become a scalar with `colo.apps.rlhf.policy_loss.aggregate_loss` and the global counts, as in
GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .grpo import _TokenMetrics
from .policy_loss import LOSS_AGGREGATIONS, AggregationCounts, aggregate_loss, clipped_policy_loss
from .ppo_pipeline import PPOPipeline

KL_CONTROLLERS = ("fixed", "adaptive")
"""The ``kind`` values of `build_kl_controller`."""


def kl_shaped_rewards(
    scores: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coef * k1`` on every response token, the row's score added on its last one.

    Args:
        scores (torch.Tensor): ``(R,)`` sequence scores.
        old_logps (torch.Tensor): ``(R, T)`` the policy's log-probs of the response tokens.
        ref_logps (torch.Tensor): ``(R, T)`` the reference's.
        response_mask (torch.Tensor): ``(R, T)`` 1 on response tokens (a prefix of each row).
        kl_coef (float): ``beta``.

    Returns:
        ``(rewards, kl)``, each ``(R, T)`` float32 and 0 past each row's end; ``kl`` is the per-token ``k1``.
        A row without response tokens gets no reward.
    """
    mask = response_mask.float()
    kl = (old_logps.float() - ref_logps.float()) * mask
    rewards = -kl_coef * kl
    lengths = response_mask.sum(dim=1).long()
    rows = torch.nonzero(lengths > 0).squeeze(1)
    rewards[rows, lengths[rows] - 1] += scores.float().to(rewards.device)[rows]
    return rewards, kl


def gae(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the response tokens (module docstring).

    Args:
        rewards (torch.Tensor): ``(R, T)`` per-token rewards.
        values (torch.Tensor): ``(R, T)`` the critic's values (of the state each token is sampled in).
        response_mask (torch.Tensor): ``(R, T)`` 1 on response tokens.
        gamma (float): the discount.
        lam (float): GAE's lambda.

    Returns:
        ``(advantages, returns)``, each ``(R, T)`` float32 and 0 past each row's end.
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma={gamma} and lam={lam} must be in [0, 1]")
    mask = response_mask.float()
    values = values.float() * mask
    rewards = rewards.float() * mask
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        following = values[:, t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * following - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def masked_moments(values: torch.Tensor, mask: torch.Tensor, group=None) -> tuple[float, float, float]:
    """``(mean, unbiased variance, count)`` of ``values`` where ``mask`` is 1, over the ranks of ``group`` (a colo
    `Group` of the ranks holding different samples; one all-reduce of three float64 numbers; every rank calls it)."""
    mask = mask.double()
    data = values.detach().double() * mask
    sums = torch.stack([mask.sum(), data.sum(), (data * data).sum()]).cpu()
    if group is not None and group.size > 1:
        import torch.distributed as dist

        from colo.comm import all_reduce

        nccl = dist.get_backend(group.process_group) == "nccl"
        reduced = sums.to(torch.device("cuda", torch.cuda.current_device())) if nccl else sums
        all_reduce(reduced, group=group)
        sums = reduced.cpu()
    count, total, squares = (float(x) for x in sums)
    if count == 0:
        return 0.0, 0.0, 0.0
    mean = total / count
    variance = max(squares - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    return mean, variance, count


def whiten(
    values: torch.Tensor, mask: torch.Tensor, *, group=None, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with the moments of every masked value of the global batch
    (`masked_moments`); ``shift_mean=False`` keeps the mean (scales only). 0 where ``mask`` is 0."""
    mean, variance, _ = masked_moments(values, mask, group)
    whitened = (values.float() - mean) * (variance + eps) ** -0.5
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.float()


@dataclass(frozen=True)
class ValueLossTerms:
    """The per-token pieces of `clipped_value_loss` (``(R, T)``, unmasked).

    Attributes:
        loss: ``0.5 max((V - R)^2, (V_clipped - R)^2)``.
        clipped: 1.0 where the clipped term is the larger (the clip is active).
    """

    loss: torch.Tensor
    clipped: torch.Tensor


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float | None = 0.2
) -> ValueLossTerms:
    """PPO's clipped value loss per token (module docstring); ``clip=None``: ``0.5 (V - R)^2``."""
    values = values.float()
    returns = returns.float().to(values.device)
    plain = (values - returns) ** 2
    if clip is None:
        return ValueLossTerms(loss=0.5 * plain, clipped=torch.zeros_like(plain).detach())
    old = old_values.float().to(values.device)
    clipped_values = old + torch.clamp(values - old, -clip, clip)
    clipped = (clipped_values - returns) ** 2
    return ValueLossTerms(loss=0.5 * torch.max(plain, clipped), clipped=(clipped > plain).float().detach())


@dataclass(frozen=True)
class PPOPolicyTerms:
    """The per-token pieces of `ppo_policy_loss` (``(R, T)``, unmasked; statistics detached).

    Attributes:
        loss: the per-token loss (surrogate, dual clip, minus the entropy bonus).
        ratio: ``exp(logp - old)``.
        clipped: 1.0 where the ratio clip is active (`colo.apps.rlhf.policy_loss.PolicyLossTerms.clipped`).
        dual_clipped: 1.0 where the dual clip is active (``A < 0`` and ``-rho A > -c A``, i.e. ``rho > c``).
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


def ppo_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> PPOPolicyTerms:
    """The clipped surrogate (asymmetric range), the dual clip and the entropy bonus per token (module docstring).

    Args:
        logps (torch.Tensor): ``(R, T)`` the policy's log-probs (differentiable).
        old_logps (torch.Tensor): ``(R, T)`` those of the rollout's policy.
        advantages (torch.Tensor): ``(R, T)`` per-token advantages.
        eps_low (float): lower clip range. Default: ``0.2``.
        eps_high (float | None): upper clip range; ``None``: ``eps_low``. Default: ``None``.
        dual_clip (float | None): ``c > 1`` bounds the loss of negative advantages by ``-c A``. Default: ``None``.
        entropy (torch.Tensor | None): ``(R, T)`` the policy's entropy (differentiable), for the bonus.
        entropy_coef (float): the bonus' weight. Default: ``0.0``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"ppo_policy_loss: dual_clip={dual_clip} must be > 1 (Ye et al.'s c; verl's 3.0)")
    terms = clipped_policy_loss(logps, old_logps, advantages, eps_low=eps_low, eps_high=eps_high)
    loss = terms.loss
    advantages = advantages.to(loss.dtype)
    dual = torch.zeros_like(loss)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = ((advantages < 0) & (loss > bound)).to(loss.dtype)
        loss = torch.where(advantages < 0, torch.min(loss, bound), loss)
    if entropy_coef:
        if entropy is None:
            raise ValueError(f"ppo_policy_loss: entropy_coef={entropy_coef} needs the policy's entropy")
        loss = loss - entropy_coef * entropy.to(loss.dtype)
    return PPOPolicyTerms(loss=loss, ratio=terms.ratio, clipped=terms.clipped, dual_clipped=dual.detach())


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, group=None) -> float:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens of the global batch (nan when the returns do not vary)."""
    _, residual, _ = masked_moments(returns.float() - values.float(), mask, group)
    _, spread, _ = masked_moments(returns, mask, group)
    return float("nan") if spread == 0 else 1.0 - residual / spread


class FixedKLController:
    """A constant KL coefficient."""

    kind = "fixed"

    def __init__(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"FixedKLController: the KL coefficient {value} must be >= 0")
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing: the coefficient is fixed."""

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self, state)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al.'s (2019) proportional controller of the KL coefficient (module docstring).

    Args:
        init (float): the first coefficient (> 0).
        target (float): the per-sequence KL to steer towards (> 0).
        horizon (float): ``K_beta = n / horizon`` per update of ``n`` sequences (> 0).
    """

    kind = "adaptive"

    def __init__(self, init: float, target: float, horizon: float) -> None:
        if init <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController: init={init}, target={target} and horizon={horizon} must be > 0")
        self.value, self.target, self.horizon = float(init), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """One update after a rollout of ``n_steps`` sequences whose mean summed KL is ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self, state)
        self.value, self.target, self.horizon = (float(state[k]) for k in ("value", "target", "horizon"))


def build_kl_controller(kind: str, *, init: float, target: float | None = None, horizon: float = 10000.0):
    """`FixedKLController` (``kind="fixed"``) or `AdaptiveKLController` (``"adaptive"``, needs ``target``)."""
    if kind == "fixed":
        return FixedKLController(init)
    if kind == "adaptive":
        if target is None:
            raise ValueError("an adaptive KL controller needs a target KL (ppo.kl_target)")
        return AdaptiveKLController(init, target, horizon)
    raise ValueError(f"KL controller {kind!r} is unknown; use one of {KL_CONTROLLERS}")


def _check_kind(controller, state: dict) -> None:
    if state.get("kind") != controller.kind:
        raise ValueError(
            f"the checkpoint's KL controller is {state.get('kind')!r}, this run's is {controller.kind!r}; resume "
            "with the same ppo.kl_controller"
        )


class PPOCriterion(PPOPipeline, _TokenMetrics):
    """The PPO loss of one model, aggregated over the update batch like `colo.apps.rlhf.grpo.GRPOCriterion`.

    Called as ``criterion(output, microbatch)`` on the output of `colo.apps.rlhf.critic.attach_ppo_forward`; the
    microbatch holds ``response_mask``, ``advantages`` (whitened, ``(R, T)``) and ``old_logps`` for the actor,
    ``returns`` and ``old_values`` for the critic. Call `prepare` with the update batch's global counts before each
    ``booster.train_step``.

    - ``role="actor"``: `ppo_policy_loss`; metrics ``clip_fraction``, ``dual_clip_fraction``, ``entropy``,
      ``ratio``, ``policy_loss``;
    - ``role="critic"``: `clipped_value_loss`; metrics ``value_loss``, ``value_clip_fraction``, ``values``;
    - ``role="actor_critic"`` (a shared backbone): the policy loss plus ``value_coef`` times the value loss.

    Args:
        role (str): ``"actor"``, ``"critic"`` or ``"actor_critic"``.
        loss_aggregation (str): one of `colo.apps.rlhf.policy_loss.LOSS_AGGREGATIONS`. Default: ``"token-mean"``.
        eps_low, eps_high, dual_clip, entropy_coef: see `ppo_policy_loss`.
        value_clip (float | None): ``eps_v`` of `clipped_value_loss` (``None``: unclipped). Default: ``0.2``.
        value_coef (float): the value loss' weight beside the policy loss (``"actor_critic"``). Default: ``0.5``.
        temperature (float): the sampling temperature; read only under a pipeline, where the last stage takes the
            actor's log-probs from the logits itself (`colo.apps.rlhf.ppo_pipeline`). Default: ``1.0``.
        vocab_limit (int | None): the ids generation samples from (`attach_ppo_forward`'s); read only under a
            pipeline, as ``temperature``. Default: ``None`` (the whole vocabulary).
    """

    def __init__(
        self,
        role: str = "actor",
        *,
        loss_aggregation: str = "token-mean",
        eps_low: float = 0.2,
        eps_high: float | None = None,
        dual_clip: float | None = None,
        entropy_coef: float = 0.0,
        value_clip: float | None = 0.2,
        value_coef: float = 0.5,
        temperature: float = 1.0,
        vocab_limit: int | None = None,
    ) -> None:
        super().__init__()
        from .critic import ROLES

        if role not in ROLES:
            raise ValueError(f"PPOCriterion: role={role!r} is unknown; use one of {ROLES}")
        if loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(
                f"PPOCriterion: loss_aggregation={loss_aggregation!r} is unknown; use one of {LOSS_AGGREGATIONS}"
            )
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"PPOCriterion: dual_clip={dual_clip} must be > 1")
        self.role, self.loss_aggregation = role, loss_aggregation
        self.eps_low, self.eps_high, self.dual_clip = eps_low, eps_high, dual_clip
        self.entropy_coef, self.value_clip, self.value_coef = entropy_coef, value_clip, value_coef
        self.temperature, self.vocab_limit = temperature, vocab_limit
        self.counts: AggregationCounts | None = None
        self.scale = 1.0
        self.sft = False
        """While set, the loss is the model's own next-token loss of the batch's ``labels`` (an SFT warm-up)."""

    def prepare(self, counts: AggregationCounts, *, num_microbatches: int, num_data_ranks: int) -> None:
        """As `colo.apps.rlhf.grpo.GRPOCriterion.prepare`: the global counts, and the Booster's averaging undone."""
        self.counts = counts
        self.scale = float(num_microbatches * num_data_ranks)

    def __call__(self, output, batch) -> torch.Tensor:
        if self.sft:
            return output.loss
        if self.counts is None:
            raise RuntimeError("PPOCriterion: call prepare(global_counts(...), ...) before the update")
        mask = batch["response_mask"]
        total, metrics = None, {}
        if self.role != "critic":
            terms = ppo_policy_loss(
                output["logps"],
                batch["old_logps"],
                batch["advantages"],
                eps_low=self.eps_low,
                eps_high=self.eps_high,
                dual_clip=self.dual_clip,
                entropy=output["entropy"],
                entropy_coef=self.entropy_coef,
            )
            total = aggregate_loss(terms.loss, mask, self.loss_aggregation, self.counts)
            metrics.update(
                policy_loss=terms.loss.detach(),
                clip_fraction=terms.clipped,
                dual_clip_fraction=terms.dual_clipped,
                entropy=output["entropy"].detach(),
                ratio=terms.ratio,
            )
        if self.role != "actor":
            value = clipped_value_loss(output["values"], batch["old_values"], batch["returns"], clip=self.value_clip)
            share = aggregate_loss(value.loss, mask, self.loss_aggregation, self.counts)
            total = share if total is None else total + self.value_coef * share
            metrics.update(
                value_loss=value.loss.detach(), value_clip_fraction=value.clipped, values=output["values"].detach()
            )
        self.record(mask, **metrics)
        return total * self.scale
