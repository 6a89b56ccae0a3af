"""colo.apps.rlhf: preference data, reward models and the DPO family (DPO, cDPO, IPO, SimPO).

- `losses`: `bradley_terry_loss`, `dpo_loss` (sigmoid, cDPO label smoothing), `ipo_loss`, `simpo_loss`,
  `preference_loss`, formulas in their docstrings.
- `data`: `read_preference_records` (JSON Lines / saved Hugging Face datasets), `PreferenceDataset` (chosen and
  rejected rows of one example as one ``(2, seq_len)`` item).
- `modeling`: `attach_pair_forward` (one forward per pair: policy log-probs or rewards), `make_reward_model`,
  `save_reward_model_as_hf`, `sequence_logps`.
- `objectives`: `RewardCriterion`, `PreferenceCriterion` (criteria for `Booster.boost`, with metrics).
- `reference`: `precompute_reference_logps`, `WithReferenceLogps`.
- `synthetic`: the Python-line preference set of the ``tiny-rm`` / ``tiny-dpo`` presets, and an arithmetic set.
"""

from .data import PreferenceDataset, read_preference_records
from .losses import PREFERENCE_LOSSES, bradley_terry_loss, dpo_loss, ipo_loss, preference_loss, simpo_loss
from .modeling import (
    attach_pair_forward,
    last_non_pad_index,
    make_reward_model,
    save_reward_model_as_hf,
    sequence_logps,
)
from .objectives import PreferenceCriterion, RewardCriterion
from .reference import WithReferenceLogps, precompute_reference_logps
from .synthetic import arithmetic_records, python_line_records

__all__ = [
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
