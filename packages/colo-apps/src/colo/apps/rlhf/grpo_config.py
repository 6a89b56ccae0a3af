"""The ``grpo`` section of the run config (``data.task: grpo``): sampling, advantages, the loss, the updates per
rollout, the reward functions and the embedded arithmetic prompts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .advantages import check_group_size


class RolloutSection(BaseModel):
    """What every online RL task (``grpo``, ``ppo``) reads: sampling, the prompts, the reward functions, the SFT
    warm-up and the updates per rollout."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass of the rollouts.")
    max_new_tokens: int = Field(default=16, ge=1, description="The generation budget per completion.")
    max_prompt_len: int = Field(
        default=32, ge=1, description="The prompt budget in tokens (bos included); a longer prompt is an error."
    )
    epochs: int = Field(default=1, ge=1, description="Passes over each rollout batch.")
    minibatches: int = Field(
        default=1,
        ge=1,
        description="Optimizer updates per pass: the rollout batch is split into this many minibatches. With "
        "epochs * minibatches = k > 1 each step makes k updates; the LR schedule then runs over the run's updates.",
    )
    sft_steps: int = Field(
        default=0,
        ge=0,
        description="First train this many steps of next-token loss on the prompts' answers (the 'answer' column; "
        "the SFT the policy starts from); the reference is the policy after them.",
    )
    lr: float | None = Field(
        default=None,
        gt=0,
        description="The policy's learning rate of the RL steps (after sft_steps), constant (colo.apps.rlhf.rl_lr: "
        "the SFT warm-up keeps optimizer.lr and the schedule; layer-wise scales kept). None: the run's schedule "
        "throughout.",
    )
    reward_functions: list[str] = Field(
        default_factory=lambda: ["colo.apps.rlhf.rewards:exact_answer"],
        description="Reward functions as 'module:function', called fn(prompts=, completions=, **columns) -> one "
        "float per completion; their values add up.",
    )
    synthetic_prompts: int = Field(
        default=0,
        ge=0,
        description="With empty data.paths: generate this many integer-addition prompts at run time "
        "(colo.apps.rlhf.synthetic.arithmetic_prompts: 'a+b=' with the answer column).",
    )
    max_operand: int = Field(default=20, ge=1, description="Synthetic prompts add integers in [0, max_operand).")
    synthetic_answer: Literal["sum", "worked"] = Field(
        default="sum",
        description="The synthetic prompts' answer column: 'sum' ('19'), or 'worked' (colo.apps.rlhf.synthetic."
        "worked_sum, GSM8K's form: '2+7=9, 10+0=10, 10+9=19 #### 19', the SFT target of longer responses; reward "
        "it with colo.apps.rlhf.math_answer:math_answer, which compares the numbers after '####').",
    )
    eval_samples: int = Field(
        default=0,
        ge=0,
        description="At each eval, also sample this many completions per held-out prompt at the rollout temperature "
        "(0: greedy exact-match reward only).",
    )


class GRPOSection(RolloutSection):
    """Online RL with critic-free advantages (colo.apps.rlhf): every step generates group_size completions of each
    prompt from the current policy, scores them with the reward functions, and updates the policy with the clipped
    loss and a KL penalty to the frozen reference (GRPO, Dr. GRPO, RLOO)."""

    group_size: int = Field(default=4, description="G: completions sampled per prompt (>= 2).")
    advantage: Literal["grpo", "dr_grpo", "rloo"] = Field(
        default="grpo",
        description="'grpo': (r - group mean) / (group std + 1e-4); 'dr_grpo': r - group mean (Dr. GRPO); 'rloo': r - "
        "mean of the group's other rewards (REINFORCE leave-one-out).",
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        default="token-mean",
        description="How per-token losses become the loss, over the whole update batch on every data-parallel rank: "
        "'token-mean' (TRL's dapo), 'seq-mean-token-mean' (TRL's grpo), 'seq-mean-token-sum-norm' (TRL's dr_grpo: "
        "token sums over rows x max_new_tokens).",
    )
    beta: float = Field(default=0.04, ge=0, description="The KL coefficient (0: no KL term in the loss).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="The per-token estimator of KL(policy || reference) (Schulman, 2020)."
    )
    kl_ratio_correction: bool = Field(
        default=False,
        description="Weight the KL term by the importance ratio (DeepSeek-V3.2; TRL 1.16's use_bias_correction_kl).",
    )
    eps_low: float = Field(default=0.2, ge=0, description="Lower clip range of the ratio: 1 - eps_low.")
    eps_high: float | None = Field(
        default=None, ge=0, description="Upper clip range: 1 + eps_high (DAPO's clip-higher); None: eps_low."
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO's dynamic sampling (colo.apps.rlhf.dapo): drop the prompt groups whose rewards are all equal "
        "(zero advantage) and refill the step's batch with groups generated from the next prompts, for at most "
        "grpo.dynamic_sampling_max_rounds extra rounds (agreed by every data-parallel rank); a batch still short then "
        "is filled with dropped groups. Metrics: grpo/dynamic_dropped_groups, grpo/dynamic_extra_rounds, "
        "grpo/dynamic_shortfall_groups.",
    )
    dynamic_sampling_max_rounds: int = Field(
        default=3,
        ge=1,
        description="With grpo.dynamic_sampling: the most generation rounds per step after the first (each draws a "
        "new batch of prompts from the sampler).",
    )
    overlong_buffer: int = Field(
        default=0,
        ge=0,
        description="DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment): a completion of n tokens "
        "(eos counted) gets grpo.overlong_penalty * (L - B - n) / B added to its reward when n > L - B, with L = "
        "grpo.max_new_tokens and B this buffer; 0: off.",
    )
    overlong_penalty: float = Field(
        default=1.0, ge=0, description="The overlong punishment at the budget (-penalty at n = max_new_tokens)."
    )
    pack_rows: bool = Field(
        default=False,
        description="Pack the rollout rows of each update microbatch (and of the reference's forward) into rows of "
        "the batch's width, each row's prompt and response a document of its own, so no compute goes to padding "
        "(colo.apps.rlhf.packing; the same log-probs, loss and gradients as the padded rows). Metric: "
        "grpo/pack_padding_saved, the share of the padded forward's positions not computed. colo's Llama; under "
        "plugin.sp > 1 (Ulysses, ring) each packed row is split over sp like any row; not under plugin.pp > 1.",
    )
    mask_truncated: bool = Field(
        default=False,
        description="Leave completions that ran out of budget without an eos out of the loss and its token count "
        "(DAPO's overlong filtering, TRL's mask_truncated_completions); their rows still count as sequences.",
    )

    max_staleness: int = Field(
        default=0,
        ge=0,
        description="Asynchronous (one-step off-policy) rollouts, verl's one-step off-policy / AReaL's "
        "max_head_offpolicyness: 0 generates each step's rollout from the current weights, then updates (the "
        "synchronous loop); 1 generates the rollout of step k+1 in a background thread from a copy of the weights "
        "taken before update k, while update k runs, and corrects the loss with the truncated importance weight "
        "min(pi_proximal / pi_behaviour, grpo.importance_sampling_cap) (colo.apps.rlhf.off_policy). Data-parallel "
        "layouts only (ddp, zero, gemini, hybrid with tp = sp = pp = 1).",
    )
    rollout_worker: Literal["thread", "process"] = Field(
        default="thread",
        description="With grpo.max_staleness=1: where the background rollout runs. 'thread': a thread of each rank "
        "(CPU or CUDA, on a side stream); 'process' (CPU only): a child process per rank holding the rollout copy in "
        "shared memory, so the rollout and the update share no GIL (small CPU models, whose ops are mostly Python "
        "overhead, overlap only this way).",
    )
    importance_sampling_cap: float = Field(
        default=2.0,
        gt=1,
        description="With grpo.max_staleness=1: the cap C of the per-token behaviour importance weight "
        "min(exp(logp_proximal - logp_behaviour), C) multiplying the clipped surrogate (verl's truncated importance "
        "sampling, tis_imp_ratio_cap=2; TRL's vllm_importance_sampling_clip_max in 'token_truncate' mode).",
    )

    @model_validator(mode="after")
    def _valid(self):
        check_group_size(self.group_size, self.advantage, field="grpo.group_size")
        if self.max_staleness > 1:
            raise ValueError(
                f"grpo.max_staleness={self.max_staleness}: colo overlaps one rollout with one update (staleness at "
                "most 1); set grpo.max_staleness to 0 (synchronous) or 1 (one-step off-policy)"
            )
        if not self.reward_functions:
            raise ValueError("grpo.reward_functions is empty; name at least one 'module:function'")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"grpo.overlong_buffer={self.overlong_buffer} exceeds grpo.max_new_tokens={self.max_new_tokens}: the "
                "buffer is the last tokens before the budget; set it to at most max_new_tokens (0: off)"
            )
        return self
