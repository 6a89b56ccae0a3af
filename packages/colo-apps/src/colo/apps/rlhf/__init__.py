"""colo.apps.rlhf: preference data, reward models and the DPO family (DPO, cDPO, IPO, SimPO).

- `losses`: `bradley_terry_loss`, `dpo_loss` (sigmoid, cDPO label smoothing), `ipo_loss`, `simpo_loss`,
  `preference_loss`, formulas in their docstrings.
- `data`: `read_preference_records` (JSON Lines / saved Hugging Face datasets), `PreferenceDataset` (chosen and
  rejected rows of one example as one ``(2, seq_len)`` item).
- `modeling`: `attach_pair_forward` (one forward per pair: policy log-probs or rewards), `make_reward_model`,
  `save_reward_model_as_hf`, `sequence_logps`.
- `objectives`: `RewardCriterion`, `PreferenceCriterion` (criteria for `Booster.boost`, with metrics).
- `reference`: `precompute_reference_logps`, `WithReferenceLogps`.
- `synthetic`: the Python-line preference set of the ``tiny-rm`` / ``tiny-dpo`` presets, arithmetic sets (the
  ``tiny-grpo`` preset's prompts).
- GRPO / RLOO (``data.task: grpo``): `advantages` (`group_advantages`: GRPO, Dr. GRPO, RLOO), `policy_loss` (KL
  estimators, the clipped loss, loss aggregation with global counts), `grpo` (`attach_rollout_forward`,
  `GRPOCriterion`), `rewards` (reward functions by import path), `math_answer` (the verifiable math-answer reward:
  `math_answer`, `extract_answer`, `answers_match`), `dapo` (DAPO's overlong punishment, truncation mask and dynamic
  sampling), `prompts` (`PromptDataset`), `grpo_task` (the trainer's `GRPOTask`).
- PPO (``data.task: ppo``): `ppo` (KL-shaped rewards, GAE, global whitening, the clipped value loss, the clipped
  policy loss with dual clip and entropy bonus, fixed / adaptive KL controllers, `PPOCriterion`), `critic`
  (`add_value_head`, `attach_ppo_forward`: per-token log-probs, entropies and values; `critic_from_policy`),
  `ppo_learner` (`PPOLearner`: experience and updates of boosted actor and critic), `ppo_task` (the trainer's
  `PPOTask`).
- `token_logps`: the one per-token log-prob / entropy path of DPO, GRPO and PPO, from whole or vocabulary-parallel
  logits (`token_logps`, `target_logps`, `llama_token_logps`, `vocab_parallel_token_stats`).
"""

from .advantages import ADVANTAGE_ESTIMATORS, group_advantages
from .critic import add_value_head, attach_ppo_forward, critic_from_policy
from .data import PreferenceDataset, read_preference_records
from .grpo import GRPOCriterion, attach_rollout_forward
from .losses import PREFERENCE_LOSSES, bradley_terry_loss, dpo_loss, ipo_loss, preference_loss, simpo_loss
from .math_answer import answers_match, extract_answer, math_answer
from .modeling import (
    attach_pair_forward,
    last_non_pad_index,
    make_reward_model,
    save_reward_model_as_hf,
    sequence_logps,
)
from .objectives import PreferenceCriterion, RewardCriterion
from .policy_loss import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    AggregationCounts,
    aggregate_loss,
    clipped_policy_loss,
    global_counts,
    kl_penalty,
)
from .ppo import (
    AdaptiveKLController,
    FixedKLController,
    PPOCriterion,
    clipped_value_loss,
    gae,
    kl_shaped_rewards,
    ppo_policy_loss,
    whiten,
)
from .ppo_learner import PPOHyperparameters, PPOLearner
from .prompts import PromptDataset
from .reference import WithReferenceLogps, precompute_reference_logps
from .rewards import RewardFunctionError, compute_rewards, exact_answer, load_reward_function
from .synthetic import arithmetic_prompts, arithmetic_records, python_line_records

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "PPOCriterion",
    "PPOHyperparameters",
    "PPOLearner",
    "add_value_head",
    "attach_ppo_forward",
    "clipped_value_loss",
    "critic_from_policy",
    "gae",
    "kl_shaped_rewards",
    "ppo_policy_loss",
    "whiten",
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AggregationCounts",
    "GRPOCriterion",
    "PromptDataset",
    "RewardFunctionError",
    "aggregate_loss",
    "arithmetic_prompts",
    "attach_rollout_forward",
    "clipped_policy_loss",
    "compute_rewards",
    "exact_answer",
    "answers_match",
    "extract_answer",
    "math_answer",
    "global_counts",
    "group_advantages",
    "kl_penalty",
    "load_reward_function",
    "PREFERENCE_LOSSES",
    "PreferenceCriterion",
    "PreferenceDataset",
    "RewardCriterion",
    "WithReferenceLogps",
    "arithmetic_records",
    "python_line_records",
    "attach_pair_forward",
    "bradley_terry_loss",
    "dpo_loss",
    "ipo_loss",
    "last_non_pad_index",
    "make_reward_model",
    "precompute_reference_logps",
    "preference_loss",
    "read_preference_records",
    "save_reward_model_as_hf",
    "sequence_logps",
    "simpo_loss",
]
