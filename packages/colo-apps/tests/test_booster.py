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


def reference_run(steps, world_size, max_grad_norm, initial=None):
    """The single-process run; ``initial``: the parameters to start from (default: the seeded model's)."""
    model, optimizer, scheduler = make_training()
    if initial is not None:
        model.load_state_dict(initial)
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
    from colo.apps.booster import DDP, Gemini, Zero

    common = {"num_microbatches": 2, "max_grad_norm": 0.5}
    if name == "ddp":
        return DDP(**common)
    if name == "gemini":
        return Gemini(placement="static", chunk_numel=64, **common)
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


def _unseeded_run(plugin_name, steps):
    from colo.apps.booster import Booster

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, optimizer, scheduler = make_training(seed=1000 + rank)  # every rank initialises another model
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    booster = Booster(make_plugin(plugin_name))
    booster.boost(model, optimizer, lr_scheduler=scheduler)
    losses = [booster.train_step(local_batch(global_batch(step, world_size), rank)).loss for step in steps]
    return initial, losses, full_params(booster, model)


@pytest.mark.parametrize("plugin_name", ["ddp", "zero1", "zero2", "zero3", "gemini"])
def test_ranks_that_initialise_differently_train_rank_0s_model(plugin_name):
    """Like DDP, every plugin starts from rank 0's parameters: the run equals the single-process run of the model
    rank 0 built (same tolerances as above), though every rank built another one."""
    steps = range(3)
    results = run_distributed(_unseeded_run, plugin_name, steps, world_size=2)
    rank_0_initial = results[0][0]
    assert not torch.equal(results[1][0]["head.weight"], rank_0_initial["head.weight"])  # they did differ
    expected, expected_params = reference_run(steps, 2, 0.5, initial=rank_0_initial)
    for _, losses, params in results:
        assert losses == pytest.approx([loss for loss, _, _ in expected], rel=1e-5)
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


def _read_parameters_right_after(plugin_name, path):
    """Parameters read at once by user code after `load`, after a step (`model.state_dict()`) and through `unwrap`,
    each with the values the optimizer holds (the ZeRO-1/2 parameter all-gather is overlapped with the next
    forward, so whatever hands parameters out must first wait for it)."""
    from colo.apps.booster import Booster

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, optimizer, scheduler = make_training()
    booster = Booster(make_plugin(plugin_name))
    booster.boost(model, optimizer, lr_scheduler=scheduler)
    booster.train_step(local_batch(global_batch(0, world_size), rank))
    booster.save(path)
    saved = full_params(booster, model)

    model, optimizer, scheduler = make_training(seed=1)  # another initialisation: all state must come from disk
    booster = Booster(make_plugin(plugin_name))
    booster.boost(model, optimizer, lr_scheduler=scheduler)
    booster.load(path)
    after_load = {name: p.detach().clone() for name, p in model.named_parameters()}  # no forward in between

    booster.train_step(local_batch(global_batch(1, world_size), rank))
    state_dict = {name: t.clone() for name, t in model.state_dict().items()}
    after_step = full_params(booster, model)

    booster.train_step(local_batch(global_batch(2, world_size), rank))
    unwrapped = {name: p.detach().clone() for name, p in booster.unwrap().named_parameters()}
    after_unwrap = full_params(booster, model)
    return saved, after_load, state_dict, after_step, unwrapped, after_unwrap


@pytest.mark.parametrize("plugin_name", ["zero1", "zero2"])
def test_parameters_handed_out_are_current_right_after_load_and_step(plugin_name, tmp_path):
    for saved, after_load, state_dict, after_step, unwrapped, after_unwrap in run_distributed(
        _read_parameters_right_after, plugin_name, str(tmp_path / "ckpt"), world_size=2
    ):
        assert set(after_load) == set(saved) == set(state_dict) == set(unwrapped)
        stale = [name for name in saved if not torch.equal(after_load[name], saved[name])]
        assert not stale, f"parameters read right after load differ from the checkpoint: {stale}"
        stale = [name for name in after_step if not torch.equal(state_dict[name], after_step[name])]
        assert not stale, f"model.state_dict() right after a step is stale: {stale}"
        stale = [name for name in after_unwrap if not torch.equal(unwrapped[name], after_unwrap[name])]
        assert not stale, f"booster.unwrap()'s parameters right after a step are stale: {stale}"


def _single_rank_ddp_run(steps):
    from colo.apps.booster import Booster

    model, optimizer, scheduler = make_training()
    booster = Booster(make_plugin("ddp"))  # two microbatches (the no_sync path) and clipping, as above
    boosted, *_ = booster.boost(model, optimizer, lr_scheduler=scheduler)
    losses = [booster.train_step(global_batch(step, 1)).loss for step in steps]
    tensors, _ = booster.engine.checkpoint_state()  # what a checkpoint holds
    wrapped = isinstance(boosted, torch.nn.parallel.DistributedDataParallel)
    return wrapped, boosted is model and booster.unwrap() is model, sorted(tensors), losses, full_params(booster, model)


def test_ddp_on_one_rank_does_not_wrap_the_model_and_trains_as_the_single_process_run():
    # one data-parallel rank has nothing to average: DDP's wrapper would only add its hooks and bucket copies to
    # every step. The run still equals the eager model + AdamW (same tolerances as above: microbatches are averaged
    # in another order than the whole batch), and checkpoints keep the model's own names (no "module." prefix).
    steps = range(3)
    expected, expected_params = reference_run(steps, 1, 0.5)
    wrapped, unwrapped, names, losses, params = run_distributed(_single_rank_ddp_run, steps, world_size=1)[0]
    assert not wrapped and unwrapped
    assert [name for name in names if not name.startswith("optim/")] == sorted(expected_params)
    assert losses == pytest.approx([loss for loss, _, _ in expected], rel=1e-5)
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, **TOLERANCE, msg=name)
