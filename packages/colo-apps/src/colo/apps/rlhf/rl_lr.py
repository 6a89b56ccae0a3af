"""A learning rate of its own for the RL steps of an online-RL run (``grpo.lr`` / ``ppo.lr``).

An online-RL run (`colo.apps.rlhf.grpo_task`) first trains ``sft_steps`` of next-token loss on the prompts' answers,
then the RL steps, with one optimizer and one LR schedule (``optimizer.lr``, warmup + cosine over
``schedule.total_steps``). The SFT warm-up wants the high LR a tiny model learns its answers with; the RL update,
whose gradient is a noisy estimate from a few sampled groups, wants a lower one (verl and OpenRLHF train the actor
at ~1e-6 after an SFT at ~1e-5, in separate runs). `RLPhaseLR` is the run's warmup + cosine multiplier for the SFT
steps and a constant ``rl_lr / optimizer.lr`` from the first RL step on (layer-wise LR scales kept, as the schedule
keeps them): one run, one optimizer, its Adam moments carried over.
"""

from __future__ import annotations

import torch

from ..train.optim import WarmupCosine


class RLPhaseLR(WarmupCosine):
    """LR multiplier of step ``t``: ``WarmupCosine``'s before ``from_step``, ``ratio`` from it on.

    Plain numbers only, so `torch.optim.lr_scheduler.LambdaLR` keeps it in its JSON-able ``state_dict``.
    """

    def __init__(self, *, warmup_steps: int, total_steps: int, min_ratio: float, from_step: int, ratio: float) -> None:
        super().__init__(warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio)
        self.from_step = from_step
        self.ratio = ratio

    def __call__(self, step: int) -> float:
        if step >= self.from_step:
            return self.ratio
        return super().__call__(step)


def use_rl_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, *, from_step: int, ratio: float) -> None:
    """Replace each `WarmupCosine` multiplier of ``scheduler`` by its `RLPhaseLR` (constant ``ratio`` from
    ``from_step`` on), and set the optimizer's current LR from it (a run resumed after ``from_step`` steps at once)."""
    multipliers = []
    for multiplier in scheduler.lr_lambdas:
        if isinstance(multiplier, WarmupCosine):
            multiplier = RLPhaseLR(
                warmup_steps=multiplier.warmup_steps,
                total_steps=multiplier.total_steps,
                min_ratio=multiplier.min_ratio,
                from_step=from_step,
                ratio=ratio,
            )
        multipliers.append(multiplier)
    scheduler.lr_lambdas = multipliers
    step = scheduler.last_epoch
    for group, base, multiplier in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, multipliers):
        group["lr"] = base * multiplier(step)
