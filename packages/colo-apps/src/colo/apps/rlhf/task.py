"""``data.task: rm | dpo`` inside the one trainer (`colo.apps.train.Trainer`): what those tasks add to it.

`PreferenceTask` turns the run's model into a reward model or a policy with the pair forward, gives the Booster its
criterion, runs the SFT warm-up of a DPO recipe (``preference.sft_steps``), precomputes the reference log-probs at
the first DPO step (from the policy then: the frozen reference, with no second model), keeps that table in the
checkpoints (so a resumed run has the same reference), logs the pair metrics and evaluates held-out accuracy.
"""

from __future__ import annotations

import torch

from ..data import collate
from .modeling import attach_pair_forward, make_reward_model
from .objectives import PreferenceCriterion, RewardCriterion
from .reference import WithReferenceLogps, precompute_reference_logps

STATE_KEY = "preference"


class PreferenceTask:
    """The rm / dpo parts of a training run (see the module docstring).

    Args:
        config: the run config (``data.task`` is ``"rm"`` or ``"dpo"``).
        tokenizer: the run's tokenizer (its ``pad_id`` is the reward head's padding).
    """

    def __init__(self, config, tokenizer) -> None:
        self.config = config
        self.kind = config.data.task
        self.pad_id = tokenizer.pad_id
        preference = config.preference
        if self.kind == "rm":
            self.criterion = RewardCriterion(margin=preference.margin)
        else:
            self.criterion = PreferenceCriterion(
                preference.loss_type,
                beta=preference.beta,
                label_smoothing=preference.label_smoothing,
                simpo_gamma=preference.simpo_gamma,
            )
        self.sft_steps = preference.sft_steps if self.kind == "dpo" else 0
        self.table: torch.Tensor | None = None

    @property
    def needs_reference(self) -> bool:
        return self.kind == "dpo" and self.criterion.needs_reference

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Before the optimizer is built: the scalar head (rm) and the pair forward."""
        if self.kind == "rm":
            make_reward_model(model, seed=self.config.seed)
        attach_pair_forward(model, head="reward" if self.kind == "rm" else "logps", pad_id=self.pad_id)

    def before_step(self, trainer, step: int) -> None:
        """Before the step after ``step``: SFT mode during the warm-up; the reference table at the first DPO step."""
        if self.kind != "dpo":
            return
        self.criterion.sft = step < self.sft_steps
        if not self.criterion.sft and self.needs_reference and self.table is None:
            self._compute_reference(trainer)

    def _compute_reference(self, trainer) -> None:
        data = trainer.data
        dataset = data.train.dataset  # the whole PreferenceDataset (train rows, then the held-out tail)
        group = trainer.sample_group
        batch_size = max(1, data.batch_size // self.config.schedule.num_microbatches)
        self.table = precompute_reference_logps(
            trainer.booster.forward,
            dataset,
            batch_size=batch_size,
            num_replicas=group.size,
            rank=group.rank,
            device=trainer.device,
        )
        self._attach(trainer)
        trainer.log.print(
            f"reference log-probs of {len(dataset)} pairs computed from the policy (the frozen reference)"
        )

    def _attach(self, trainer) -> None:
        data = trainer.data
        full = data.train.dataset
        base = full.dataset if isinstance(full, WithReferenceLogps) else full
        wrapped = WithReferenceLogps(base, self.table)
        data.train.dataset = wrapped
        if data.eval is not None:
            data.eval.dataset = wrapped

    def take_metrics(self, trainer) -> dict[str, float]:
        """The pair metrics since the last call, averaged over the data-parallel ranks (every rank calls it)."""
        prefix = "rm" if self.kind == "rm" else "dpo"
        return {f"{prefix}/{name}": value for name, value in self.criterion.take_metrics(trainer.sample_group).items()}

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint keeps: the reference table (JSON floats; float32 values round-trip exactly)."""
        return {"reference_logps": None if self.table is None else self.table.tolist()}

    def load_state(self, trainer, run: dict) -> None:
        table = (run.get(STATE_KEY) or {}).get("reference_logps")
        if table is not None:
            self.table = torch.tensor(table, dtype=torch.float32)
            self._attach(trainer)

    # --- eval -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, trainer, step: int) -> float:
        """Held-out loss and pair metrics (accuracy, margin, ...) over this rank's share, averaged over the ranks."""
        sft_phase = self.kind == "dpo" and step < self.sft_steps
        if self.needs_reference and self.table is None and not sft_phase:
            self._compute_reference(trainer)
        group, evaluation = trainer.sample_group, trainer.data.eval
        per_rank = len(evaluation) // group.size
        size = self.config.eval.batch_size
        self.criterion.take_metrics()  # drop this rank's unlogged training statistics (no collective)
        was_sft = getattr(self.criterion, "sft", False)
        if self.kind == "dpo":
            self.criterion.sft = sft_phase  # before the reference exists: the held-out SFT loss only
        for first in range(0, per_rank, size):
            indices = [group.rank + group.size * i for i in range(first, min(first + size, per_rank))]
            micro = {k: v.to(trainer.device) for k, v in collate([evaluation[i] for i in indices]).items()}
            self.criterion(trainer.booster.forward(micro), micro)
        if self.kind == "dpo":
            self.criterion.sft = was_sft
        metrics = self.criterion.take_metrics(group)
        prefix = "rm" if self.kind == "rm" else "dpo"
        if sft_phase:
            loss = metrics["sft_loss"]
            trainer.log.log({"step": step, "eval_loss": loss})
            trainer.log.print(f"eval at step {step} (SFT warm-up): held-out loss of the chosen answers {loss:.4f}")
            return loss
        trainer.log.log(
            {"step": step, "eval_loss": metrics["loss"], **{f"eval_{prefix}/{k}": v for k, v in metrics.items()}}
        )
        trainer.log.print(
            f"eval at step {step}: held-out loss {metrics['loss']:.4f} | "
            + ("" if self.kind == "rm" else "implicit-reward ")
            + f"accuracy {metrics['accuracy']:.1%} | margin {metrics['margin']:.4f}"
        )
        self.last_eval = metrics
        return metrics["loss"]
