"""The ``preference`` section of the run config (``data.task: rm | dpo``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PreferenceSection(BaseModel):
    """Preference training (``data.task: rm | dpo``, colo.apps.rlhf): the loss, its temperature, the prompt budget,
    the SFT warm-up of a DPO policy or a reward model and the embedded synthetic data of the tiny presets."""

    model_config = ConfigDict(extra="forbid")

    loss_type: Literal["sigmoid", "ipo", "simpo"] = Field(
        default="sigmoid",
        description="task='dpo': 'sigmoid' (DPO; cDPO with label_smoothing), 'ipo', or the reference-free 'simpo'.",
    )
    beta: float = Field(default=0.1, gt=0, description="task='dpo': the temperature beta.")
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5, description="task='dpo': cDPO's probability of a flipped label ('sigmoid', 'simpo')."
    )
    simpo_gamma: float = Field(default=0.5, description="task='dpo', loss_type='simpo': the target reward margin.")
    margin: float | None = Field(
        default=None, description="task='rm': a margin the chosen reward must exceed the rejected one by."
    )
    max_prompt_len: int | None = Field(
        default=None, ge=1, description="Prompts keep their last max_prompt_len tokens (None: data.seq_len // 2)."
    )
    sft_steps: int = Field(
        default=0,
        ge=0,
        description="First train this many steps of next-token loss on the chosen responses: task='dpo': the SFT "
        "the DPO policy starts from (same optimizer), the reference is the policy after them; task='rm': the reward "
        "model then starts from that policy (saved to output_dir/sft-policy) with a fresh scalar head and its own "
        "optimizer.",
    )
    synthetic_records: int = Field(
        default=0,
        ge=0,
        description="With empty data.paths: generate this many arithmetic preference records at run time "
        "(colo.apps.rlhf.synthetic.python_line_records: a standard-library line chosen, its words shuffled "
        "rejected).",
    )
