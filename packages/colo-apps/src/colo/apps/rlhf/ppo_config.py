"""The ``ppo`` section of the run config (``data.task: ppo``): the rollout settings shared with GRPO, the critic,
the reward model, GAE, the clipped losses and the KL controller."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .grpo_config import RolloutSection


class PPOSection(RolloutSection):
    """Online RL with a critic (colo.apps.rlhf.ppo): every step samples group_size completions of each prompt from
    the current policy, scores them (reward functions and / or a reward model trained with data.task='rm'), shapes
    per-token rewards with a k1 KL penalty to the frozen reference, estimates advantages with GAE from the critic's
    values, and updates the actor (clipped policy loss, dual clip, entropy bonus) and the critic (clipped value loss)
    for epochs x minibatches updates."""

    group_size: int = Field(default=1, ge=1, description="Completions sampled per prompt (PPO needs no groups).")
    critic: Literal["separate", "shared"] = Field(
        default="separate",
        description="'separate': the critic is a model of its own (its own Booster, plugin and optimizer, started "
        "from the reward model when ppo.reward_model is set, else from the policy after the SFT warm-up with a fresh "
        "scalar head); 'shared': a value head on the actor's backbone, trained by the actor's loss plus "
        "value_coef x the value loss.",
    )
    critic_plugin: dict[str, Any] | None = Field(
        default=None,
        description="The separate critic's plugin section (as 'plugin': name 'ddp' or 'zero', stage 0-3); None: the "
        "actor's plugin settings.",
    )
    critic_lr: float | None = Field(default=None, gt=0, description="The critic's peak LR; None: optimizer.lr.")
    reward_model: str | None = Field(
        default=None,
        description="A checkpoint directory of a data.task='rm' run with the same tokenizer (data.tokenizer): its "
        "score of each completion is added to the reward functions' (run replicated on every rank, frozen).",
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="GAE's discount.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE's lambda.")
    whiten_advantages: bool = Field(
        default=True, description="Whiten the advantages over every response token of the global batch."
    )
    kl_coef: float = Field(default=0.05, ge=0, description="The KL penalty's coefficient (the start for 'adaptive').")
    kl_controller: Literal["fixed", "adaptive"] = Field(
        default="fixed", description="'adaptive': Ziegler et al.'s proportional controller towards kl_target."
    )
    kl_target: float = Field(default=6.0, gt=0, description="The adaptive controller's target per-sequence KL.")
    kl_horizon: float = Field(default=10000.0, gt=0, description="The adaptive controller's horizon (sequences).")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        default="token-mean", description="As grpo.loss_aggregation, for the policy and the value losses."
    )
    eps_low: float = Field(default=0.2, ge=0, description="Lower clip range of the ratio: 1 - eps_low.")
    eps_high: float | None = Field(default=None, ge=0, description="Upper clip range: 1 + eps_high; None: eps_low.")
    dual_clip: float | None = Field(
        default=None, gt=1, description="Dual clip c > 1 bounding the loss of negative advantages by -c A (Ye et al.)."
    )
    value_clip: float | None = Field(
        default=0.2, gt=0, description="eps_v of the clipped value loss; None: the plain 0.5 (V - R)^2."
    )
    value_coef: float = Field(default=0.5, ge=0, description="The value loss' weight with critic='shared'.")
    entropy_coef: float = Field(default=0.0, ge=0, description="The entropy bonus' weight in the actor's loss.")

    @model_validator(mode="after")
    def _valid(self):
        if not self.reward_functions and self.reward_model is None:
            raise ValueError("ppo.reward_functions is empty and ppo.reward_model unset: give the policy a reward")
        if self.critic == "shared" and (self.critic_plugin is not None or self.critic_lr is not None):
            raise ValueError(
                "ppo.critic='shared' trains the value head with the actor (its plugin and LR); drop "
                "ppo.critic_plugin / ppo.critic_lr or use ppo.critic='separate'"
            )
        return self
