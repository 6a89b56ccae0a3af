"""The Booster with the DDP and Zero plugins matches a single-process AdamW run step by step (loss, gradient norm,
learning rate, and parameters at the end), with gradient accumulation, clipping and an LR scheduler; checkpoints
saved under one plugin load under another.

Tolerances (fp32): rtol 1e-5 on losses and norms, rtol = atol = 1e-5 on parameters. Not bit-identical: the
reference averages the whole batch at once, the plugins average microbatches and then ranks (another summation
order), and AdamW's normalisation carries those last bits into the parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colo.comm.testing import run_distributed

VOCAB, DIM, ROWS_PER_RANK, SEQ = 13, 8, 4, 6
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class TinyLM(nn.Module):
    """embedding -> MLP -> head; returns the mean next-token loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        logits = self.head(h + self.down(F.gelu(self.up(h))))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def global_batch(step: int, world_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    rows = world_size * ROWS_PER_RANK
    return {
        "input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
        "labels": torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
    }


def local_batch(batch: dict, rank: int) -> dict:
    return {k: v[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for k, v in batch.items()}


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=3)
    return model, optimizer, scheduler


def reference_run(steps, world_size, max_grad_norm):
    model, optimizer, scheduler = make_training()
    results = []
    for step in steps:
        loss = model(**global_batch(step, world_size))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        results.append((loss.item(), norm.item(), optimizer.param_groups[0]["lr"]))
    return results, {name: p.detach().clone() for name, p in model.named_parameters()}


def make_plugin(name: str):
    from colo.apps.booster import DDP, Zero

    common = {"num_microbatches": 2, "max_grad_norm": 0.5}
    if name == "ddp":
        return DDP(**common)
    return Zero(stage=int(name[-1]), chunk_numel=64, **common)


def full_params(booster, model):
    optimizer = booster.engine.optimizer
    if hasattr(optimizer, "full_params"):
        return optimizer.full_params()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _boosted_run(plugin_name, steps):
    from colo.apps.booster import Booster

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, optimizer, scheduler = make_training()
    booster = Booster(make_plugin(plugin_name))
    booster.boost(model, optimizer, lr_scheduler=scheduler)
    results = []
    for step in steps:
        result = booster.train_step(local_batch(global_batch(step, world_size), rank))
        results.append((result.loss, result.grad_norm, result.lr, result.skipped))
    return results, full_params(booster, model)


@pytest.mark.parametrize("plugin_name", ["ddp", "zero1", "zero2", "zero3"])
def test_plugin_matches_the_single_process_run(plugin_name):
    steps = range(5)
    expected, expected_params = reference_run(steps, 2, 0.5)
    for results, params in run_distributed(_boosted_run, plugin_name, steps, world_size=2):
        for (loss, norm, lr, skipped), (ref_loss, ref_norm, ref_lr) in zip(results, expected):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
            assert lr == pytest.approx(ref_lr) and not skipped
        assert expected[0][1] > 0.5  # the norm is above max_grad_norm: clipping was exercised
        for name, value in expected_params.items():
            torch.testing.assert_close(params[name], value, **TOLERANCE, msg=name)


def _save_then_continue(plugin_name, path):
    from colo.apps.booster import Booster

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, optimizer, scheduler = make_training()
    booster = Booster(make_plugin(plugin_name))
    booster.boost(model, optimizer, lr_scheduler=scheduler)
    for step in range(2):
        booster.train_step(local_batch(global_batch(step, world_size), rank))
    booster.save(path, metadata={"note": "two steps"})
    saved = full_params(booster, model)
    losses = [booster.train_step(local_batch(global_batch(s, world_size), rank)).loss for s in range(2, 5)]
    return saved, losses


def _load_then_continue(plugin_name, path):
    from colo.apps.booster import Booster

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, optimizer, scheduler = make_training(seed=1)  # another initialisation: all state must come from disk
    booster = Booster(make_plugin(plugin_name))
    booster.boost(model, optimizer, lr_scheduler=scheduler)
    metadata = booster.load(path)
    step_count = booster.step_count
    loaded = full_params(booster, model)
    lr = booster.engine.torch_optimizer.param_groups[0]["lr"]
    losses = [booster.train_step(local_batch(global_batch(s, world_size), rank)).loss for s in range(2, 5)]
    return loaded, losses, metadata["note"], step_count, lr


@pytest.mark.parametrize("saved_with, loaded_with", [("zero3", "zero2"), ("ddp", "zero1"), ("zero2", "ddp")])
def test_a_checkpoint_saved_under_one_plugin_loads_under_another(saved_with, loaded_with, tmp_path):
    path = str(tmp_path / "ckpt")
    saved, uninterrupted = run_distributed(_save_then_continue, saved_with, path, world_size=2)[0]
    loaded, resumed, note, step_count, lr = run_distributed(_load_then_continue, loaded_with, path, world_size=2)[0]
    assert note == "two steps" and step_count == 2
    assert lr == pytest.approx(1e-2 * (0.5 + 0.5 * 2 / 3))  # LinearLR restored after two steps
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)


def test_invalid_plugin_settings_name_the_field():
    from colo.apps.booster import DDP, Zero, split_batch

    with pytest.raises(ValueError, match=r"Zero.stage=4 is not a ZeRO stage"):
        Zero(stage=4)
    with pytest.raises(ValueError, match=r"DDP.precision='fp8' is not supported"):
        DDP(precision="fp8")
    with pytest.raises(ValueError, match=r"Zero.num_microbatches=0 must be a positive integer"):
        Zero(num_microbatches=0)
    with pytest.raises(ValueError, match=r"DDP.max_grad_norm=-1.0 must be positive"):
        DDP(max_grad_norm=-1.0)
    with pytest.raises(ValueError, match=r"batch size 6 does not divide into num_microbatches=4.*\[1, 2, 3, 6\]"):
        split_batch({"input_ids": torch.zeros(6, 3)}, 4)
    with pytest.raises(ValueError, match=r"disagree on dim 0"):
        split_batch({"input_ids": torch.zeros(6, 3), "labels": torch.zeros(4, 3)}, 2)
