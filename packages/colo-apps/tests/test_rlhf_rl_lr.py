"""``grpo.lr`` (`colo.apps.rlhf.rl_lr`): the SFT warm-up steps keep the run's warmup + cosine schedule, the RL steps
run at the constant ``grpo.lr`` (layer-wise scales kept), and the schedule's state round-trips through JSON (colo
checkpoints hold no pickle), so a run resumed after the switch continues at the RL LR."""

from __future__ import annotations

import json

import pytest
import torch


def _scheduler(sft_steps: int, *, rl_lr: float | None):
    from colo.apps.rlhf.rl_lr import use_rl_lr
    from colo.apps.train.config import ScheduleSection
    from colo.apps.train.optim import build_scheduler

    weights = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW([{"params": weights[:1], "lr": 1e-2}, {"params": weights[1:], "lr": 5e-3}])
    schedule = ScheduleSection(total_steps=20, warmup_steps=2, min_lr=1e-3)
    scheduler = build_scheduler(optimizer, schedule, peak_lr=1e-2)
    if rl_lr is not None:
        use_rl_lr(scheduler, from_step=sft_steps, ratio=rl_lr / 1e-2)
    return optimizer, scheduler


def _lrs(optimizer, scheduler, steps: int) -> list[list[float]]:
    seen = []
    for _ in range(steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


def test_sft_steps_keep_the_schedule_and_rl_steps_run_at_grpo_lr():
    plain = _lrs(*_scheduler(6, rl_lr=None), 12)
    split = _lrs(*_scheduler(6, rl_lr=2e-4), 12)
    assert split[:6] == plain[:6]
    for lrs in split[6:]:
        assert lrs == pytest.approx([2e-4, 1e-4], rel=1e-12)  # the second group's 0.5 scale kept
    assert plain[6] != pytest.approx([2e-4, 1e-4])


def test_the_rl_schedule_resumes_from_its_json_state():
    optimizer, scheduler = _scheduler(4, rl_lr=3e-4)
    _lrs(optimizer, scheduler, 7)
    state = json.loads(json.dumps(scheduler.state_dict()))
    fresh_optimizer, fresh = _scheduler(4, rl_lr=None)  # a resumed run: the plain schedule, then the saved state
    fresh.load_state_dict(state)
    from colo.apps.rlhf.rl_lr import use_rl_lr

    use_rl_lr(fresh, from_step=4, ratio=3e-4 / 1e-2)  # what the task's _attach does after the resume
    assert [group["lr"] for group in fresh_optimizer.param_groups] == pytest.approx([3e-4, 1.5e-4], rel=1e-12)
    assert _lrs(fresh_optimizer, fresh, 2) == _lrs(optimizer, scheduler, 2)
