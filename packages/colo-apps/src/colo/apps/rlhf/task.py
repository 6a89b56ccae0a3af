"""``data.task: rm | dpo`` inside the one trainer (`colo.apps.train.Trainer`): what those tasks add to it.

`PreferenceTask` turns the run's model into a reward model or a policy with the pair forward, gives the Booster its
criterion, runs the SFT warm-up of the recipe (``preference.sft_steps``), precomputes the reference log-probs at
the first DPO step (from the policy then: the frozen reference, with no second model), keeps that table in the
checkpoints (so a resumed run has the same reference), logs the pair metrics and evaluates held-out accuracy.

A reward model with an SFT warm-up is trained in two stages of one run, as DeepSpeed-Chat and ColossalChat start their
reward models from the SFT'd policy: the policy first trains ``sft_steps`` of next-token loss on the chosen
responses; then it is saved (``output_dir/sft-policy``, a trainer checkpoint any layout loads, e.g. as a later
run's ``model.init_from``) and the reward model is built from it (its weights, a fresh scalar head in place of
``lm_head``) and boosted again under the same plugin with an optimizer and learning-rate schedule of its own (warmup,
then cosine over the remaining steps). Checkpoints of the second stage hold the reward model; resuming from one
builds that structure before loading it.
"""

from __future__ import annotations

import os

import torch

from ..data import collate
from ..train.language_model import LanguageModelTask
from .data import build_preference_dataset
from .modeling import attach_pair_forward, make_reward_model
from .objectives import PreferenceCriterion, RewardCriterion
from .pair_pipeline import from_last_stage
from .reference import WithReferenceLogps, precompute_reference_logps

STATE_KEY = "preference"
SFT_POLICY_DIR = "sft-policy"


class PreferenceTask(LanguageModelTask):
    """``data.task: rm | dpo`` on the one trainer (see the module docstring).

    Args:
        config: the run config (``data.task`` is ``"rm"`` or ``"dpo"``).
    """

    state_key = STATE_KEY

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kind = config.data.task
        self.pad_id = self.tokenizer.pad_id
        preference = config.preference
        self.sft_steps = preference.sft_steps
        self.reward_model_built = self.kind == "rm" and self.sft_steps == 0
        """rm: whether the model is the reward model yet (after the SFT warm-up, or from the start without one)."""
        if self.reward_model_built:
            self.criterion = RewardCriterion(margin=preference.margin, pad_id=self.pad_id)
        else:  # dpo, and the SFT warm-up of a reward model (the sft flag set by before_step)
            self.criterion = PreferenceCriterion(
                preference.loss_type,
                beta=preference.beta,
                label_smoothing=preference.label_smoothing,
                simpo_gamma=preference.simpo_gamma,
            )
        self.table: torch.Tensor | None = None

    @property
    def needs_reference(self) -> bool:
        return self.kind == "dpo" and self.criterion.needs_reference

    @classmethod
    def dataset_rows(cls, config, tokenizer) -> tuple:
        return build_preference_dataset(config.data, config.preference, tokenizer)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Before the optimizer is built: the scalar head (a reward model) and the pair forward."""
        if self.reward_model_built:
            make_reward_model(model, seed=self.config.seed)
        attach_pair_forward(model, head="reward" if self.reward_model_built else "logps", pad_id=self.pad_id)

    def in_sft_warmup(self, step: int) -> bool:
        """Whether the model after ``step`` steps is still the policy of the SFT warm-up (a reward model is built
        just before step ``sft_steps + 1``)."""
        return not self.reward_model_built if self.kind == "rm" else step < self.sft_steps

    def before_step(self, trainer, step: int) -> None:
        """Before the step after ``step``: SFT mode during the warm-up; then the reference table at the first DPO
        step, or the reward model built from the SFT'd policy."""
        if self.kind == "rm":
            if step < self.sft_steps:
                self.criterion.sft = True
            elif not self.reward_model_built:
                self._build_reward_model(trainer, from_policy_at=step)
            return
        self.criterion.sft = step < self.sft_steps
        if not self.criterion.sft and self.needs_reference and self.table is None:
            self._compute_reference(trainer)

    def before_resume(self, trainer, step: int) -> None:
        """Before a checkpoint saved after ``step`` loads: a reward model's second stage saved the reward model, so
        build that structure first (its weights come from the checkpoint)."""
        if self.kind == "rm" and step > self.sft_steps and not self.reward_model_built:
            self._build_reward_model(trainer, from_policy_at=None)

    def _build_reward_model(self, trainer, *, from_policy_at: int | None) -> None:
        """The second stage of a reward model with an SFT warm-up (see the module docstring): save the policy (when
        ``from_policy_at`` is its step), build the reward model from it, boost it under a fresh plugin of the same
        layout with its own optimizer and schedule, and make it the trainer's model."""
        from ..train.optim import build_scheduler

        config = self.config
        init_from = None
        if from_policy_at is not None:
            init_from = os.path.join(config.output_dir, SFT_POLICY_DIR)  # not a step of the run to resume from
            _save_replacing(trainer, from_policy_at, init_from)
        trainer.booster.wait_for_saves()
        self.reward_model_built = True
        self.criterion = RewardCriterion(margin=config.preference.margin, pad_id=self.pad_id)
        with torch.random.fork_rng(devices=[]):  # building draws from the RNG: keep the run's stream
            model = self.build_model(trainer, init_from=init_from)
        self.prepare_model(model)
        optimizer = self.build_optimizer(trainer, model)
        remaining = config.schedule.model_copy(update={"total_steps": config.schedule.total_steps - self.sft_steps})
        scheduler = build_scheduler(optimizer, remaining, peak_lr=config.optimizer.lr)
        trainer.boost(model, optimizer, criterion=self.criterion, lr_scheduler=scheduler)
        if from_policy_at is not None:
            trainer.log.print(
                f"reward model: the policy after {from_policy_at} SFT steps (saved to {init_from}) with a fresh "
                f"scalar head, its own optimizer and a {remaining.total_steps}-step schedule"
            )

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
        # under a pipeline the last stage computed the losses (pair_pipeline): its ranks hold the statistics
        metrics = from_last_stage(self.criterion.take_metrics(trainer.sample_group), trainer.booster.mesh)
        return {f"{prefix}/{name}": value for name, value in metrics.items()}

    def finish(self, trainer, *, final_checkpoint: str | None) -> str | None:
        """A DPO policy's samples, as a language model's; a reward model does not generate."""
        if self.kind == "rm":
            return None
        return super().finish(trainer, final_checkpoint=final_checkpoint)

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint keeps: the reference table (JSON floats; float32 values round-trip exactly)."""
        return {"reference_logps": None if self.table is None else self.table.tolist()}

    def load_state(self, trainer, state: dict | None) -> None:
        table = (state or {}).get("reference_logps")
        if table is not None:
            self.table = torch.tensor(table, dtype=torch.float32)
            self._attach(trainer)

    # --- eval -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, trainer, step: int) -> float | None:
        """Held-out loss and pair metrics (accuracy, margin, ...) over this rank's share, averaged over the ranks."""
        if trainer.data.eval is None:
            return None
        sft_phase = self.in_sft_warmup(step)
        if self.needs_reference and self.table is None and not sft_phase:
            self._compute_reference(trainer)
        group, evaluation = trainer.sample_group, trainer.data.eval
        per_rank = len(evaluation) // group.size
        size = self.config.eval.batch_size
        self.criterion.take_metrics()  # drop this rank's unlogged training statistics (no collective)
        was_sft = getattr(self.criterion, "sft", False)
        if isinstance(self.criterion, PreferenceCriterion):
            self.criterion.sft = sft_phase  # before the reference exists: the held-out SFT loss only
        for first in range(0, per_rank, size):
            indices = [group.rank + group.size * i for i in range(first, min(first + size, per_rank))]
            micro = {k: v.to(trainer.device) for k, v in collate([evaluation[i] for i in indices]).items()}
            self.criterion(trainer.booster.forward(micro), micro)
        if isinstance(self.criterion, PreferenceCriterion):
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


def _save_replacing(trainer, step: int, path: str) -> None:
    """``trainer.save(step, path=path)``; an older checkpoint at ``path`` (an earlier attempt of this run) is moved
    aside first and deleted only once the new one has committed."""
    import shutil

    from colo.comm import barrier

    aside = f"{path}.replaced"
    if trainer.rank == 0 and os.path.exists(path):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
    barrier()
    trainer.save(step, path=path)
    if trainer.rank == 0:
        shutil.rmtree(aside, ignore_errors=True)
