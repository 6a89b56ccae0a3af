"""One PPO iteration on a scored rollout batch, for boosted actor and critic models (any plugin each, on the same
ranks): `PPOLearner`.

`PPOLearner.experience` runs the forwards that precede the updates (no gradients) and the arithmetic of
`colo.apps.rlhf.ppo`: the actor's old log-probs (recomputed by the training forward, so the first minibatch's ratio
is exactly 1), the critic's old values, the KL-shaped rewards with the controller's coefficient, GAE, the returns and
the advantages whitened over every data-parallel rank's tokens. `PPOLearner.update` then makes ``epochs`` passes of
``minibatches`` optimizer updates of the actor and of the critic (one update of the shared model when the critic
shares the actor's backbone), each loss aggregated with the minibatch's global counts, and steps the KL controller
with the rollout's global mean per-sequence KL. Every data-parallel rank calls both with its own share of the batch;
the result does not depend on that split (tests/test_rlhf_ppo_train.py). Under a pipeline (``HybridParallel(pp > 1)``,
a separate critic boosted over the actor's stages) every rank of the pipeline calls both with the same rows: the
forwards' log-probs and values reach every rank from the last stage
(`colo.apps.booster.plugins.runner.PipelineRunner.forward`), so the experience is the same on each, and each update's
loss is reduced on the last stage (`colo.apps.rlhf.ppo_pipeline`; tests/test_rlhf_ppo_pp.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..booster.microbatch import split_batch
from .policy_loss import global_counts
from .ppo import PPOCriterion, explained_variance, gae, kl_shaped_rewards, masked_moments, whiten

_FORWARD_KEYS = ("input_ids", "position_ids", "document_ids", "attention_mask", "response_mask")


@dataclass(frozen=True)
class PPOHyperparameters:
    """What `PPOLearner` reads (the ``ppo`` section of the run config has these fields and more).

    Attributes:
        gamma, lam: GAE's discount and lambda.
        whiten_advantages: whiten over the global batch.
        epochs, minibatches: passes over the rollout and optimizer updates per pass.
        max_new_tokens: the generation budget (the ``seq-mean-token-sum-norm`` aggregation's ``L``).
    """

    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    epochs: int = 1
    minibatches: int = 1
    max_new_tokens: int = 16


class PPOLearner:
    """PPO's experience and updates for boosted models (module docstring).

    Args:
        actor: the actor's `Booster` (boosted with a `PPOCriterion` of role ``"actor"`` or, sharing the backbone,
            ``"actor_critic"``; its model's forward from `colo.apps.rlhf.critic.attach_ppo_forward`).
        actor_criterion (PPOCriterion): that criterion.
        critic: the critic's own `Booster` (role ``"critic"``), or ``None`` when the actor carries the value head.
        critic_criterion (PPOCriterion | None): its criterion.
        settings: `PPOHyperparameters` or an object with the same attributes (the run config's ``ppo`` section).
        kl_controller: `colo.apps.rlhf.ppo.FixedKLController` or `AdaptiveKLController`.
        group: the colo `Group` of the ranks holding different rows (``None``: one process).
    """

    def __init__(self, actor, actor_criterion: PPOCriterion, *, critic=None, critic_criterion=None, settings,
                 kl_controller, group=None) -> None:  # fmt: skip
        shared = actor_criterion.role == "actor_critic"
        if shared == (critic is not None):
            raise ValueError(
                "PPOLearner: give a critic Booster with an 'actor' criterion, or none with an 'actor_critic' one "
                f"(the value head on the actor's backbone); got role={actor_criterion.role!r}, critic="
                f"{'a Booster' if critic is not None else None}"
            )
        if critic is not None and (critic_criterion is None or critic_criterion.role != "critic"):
            raise ValueError("PPOLearner: a separate critic needs a PPOCriterion of role 'critic'")
        self.actor, self.critic = actor, critic
        self.actor_criterion, self.critic_criterion = actor_criterion, critic_criterion
        self.settings, self.kl_controller, self.group = settings, kl_controller, group

    @property
    def shared(self) -> bool:
        return self.critic is None

    def _num_data_ranks(self) -> int:
        return 1 if self.group is None else self.group.size

    @torch.no_grad()
    def _forward(self, booster, batch: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> dict:
        """``names`` of the boosted model's rollout outputs over ``batch``, one microbatch of rows at a time."""
        rows = batch["input_ids"].shape[0]
        size = max(1, rows // (self.settings.minibatches * booster.plugin.num_microbatches))
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for first in range(0, rows, size):
            micro = {key: batch[key][first : first + size] for key in _FORWARD_KEYS if key in batch}
            output = booster.forward(micro)
            for name in names:
                pieces[name].append(output[name].detach().float())
        mask = batch["response_mask"].float()
        return {name: torch.cat(values) * mask for name, values in pieces.items()}

    def experience(
        self, batch: Mapping[str, torch.Tensor], scores: torch.Tensor, ref_logps: torch.Tensor
    ) -> tuple[dict, dict]:
        """The update batch from this rank's rollout rows (module docstring).

        Args:
            batch: the rollout's model inputs (`colo.apps.generation.rollout_model_inputs`) and ``response_mask``.
            scores (torch.Tensor): ``(R,)`` the rows' scores (reward model or functions).
            ref_logps (torch.Tensor): ``(R, T)`` the frozen reference's log-probs of the responses.

        Returns:
            ``(batch, stats)``: the batch with ``old_logps``, ``old_values``, ``advantages`` and ``returns`` added;
            global statistics: ``kl`` (mean per-sequence summed k1), ``kl_coef`` (the coefficient used),
            ``score``, ``returns``, ``values``, ``advantages`` (before whitening), ``explained_variance``.
        """
        settings, group = self.settings, self.group
        batch = dict(batch)
        mask = batch["response_mask"]
        if self.shared:
            outputs = self._forward(self.actor, batch, ("logps", "values"))
            old_logps, old_values = outputs["logps"], outputs["values"]
        else:
            old_logps = self._forward(self.actor, batch, ("logps",))["logps"]
            old_values = self._forward(self.critic, batch, ("values",))["values"]
        coef = self.kl_controller.value
        rewards, kl = kl_shaped_rewards(scores, old_logps, ref_logps, mask, coef)
        advantages, returns = gae(rewards, old_values, mask, gamma=settings.gamma, lam=settings.lam)
        raw_mean, _, _ = masked_moments(advantages, mask, group)
        if settings.whiten_advantages:
            advantages = whiten(advantages, mask, group=group)
        batch.update(old_logps=old_logps, old_values=old_values, advantages=advantages, returns=returns)
        ones = torch.ones(mask.shape[0], 1, device=mask.device)
        per_row_kl, _, rows = masked_moments(kl.sum(dim=1, keepdim=True), ones, group)
        score, _, _ = masked_moments(scores.float().reshape(-1, 1).to(mask.device), ones, group)
        stats = {
            "kl": per_row_kl,
            "kl_coef": coef,
            "score": score,
            "returns": masked_moments(returns, mask, group)[0],
            "values": masked_moments(old_values, mask, group)[0],
            "advantages": raw_mean,
            "explained_variance": explained_variance(old_values, returns, mask, group),
            "rows": rows,
        }
        return batch, stats

    def update(self, batch: Mapping[str, torch.Tensor], stats: Mapping[str, float] | None = None) -> dict:
        """``epochs x minibatches`` updates of the actor and the critic; then the KL controller's step (with
        ``stats`` from `experience`). Returns ``{"actor": [losses], "critic": [losses], "actor_grad_norms": [...],
        "critic_grad_norms": [...], "last": StepResult}`` (the gradient norms before clipping, one an update)."""
        settings = self.settings
        ranks = self._num_data_ranks()
        actor_losses, critic_losses, outcome = [], [], None
        actor_norms, critic_norms = [], []
        for _ in range(settings.epochs):
            for part in split_batch(dict(batch), settings.minibatches):
                counts = global_counts(part["response_mask"], max_new_tokens=settings.max_new_tokens, group=self.group)
                self.actor_criterion.prepare(
                    counts, num_microbatches=self.actor.plugin.num_microbatches, num_data_ranks=ranks
                )
                outcome = self.actor.train_step(part)
                actor_losses.append(outcome.loss)
                actor_norms.append(outcome.grad_norm)
                if self.critic is not None:
                    self.critic_criterion.prepare(
                        counts, num_microbatches=self.critic.plugin.num_microbatches, num_data_ranks=ranks
                    )
                    critic_outcome = self.critic.train_step(part)
                    critic_losses.append(critic_outcome.loss)
                    critic_norms.append(critic_outcome.grad_norm)
        if stats is not None:
            self.kl_controller.update(stats["kl"], int(stats["rows"]))
        return {"actor": actor_losses, "critic": critic_losses, "actor_grad_norms": actor_norms,
                "critic_grad_norms": critic_norms, "last": outcome}  # fmt: skip
