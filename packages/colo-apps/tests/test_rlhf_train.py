"""``data.task: rm | dpo`` in the one trainer: validation, the tiny presets as a short 2-process smoke run, an exact
resume of a DPO run (the reference table travels in the checkpoint), and a reward model that starts from the policy
its recipe SFTs first (resumed exactly from either stage; the same run under ZeRO-3 and HybridParallel tp2)."""

from __future__ import annotations

import pytest

from colo.comm.testing import run_distributed


def test_validation_names_the_fields():
    from colo.apps.train import ConfigError, load_config

    assert load_config(preset="tiny-rm").data.task == "rm"
    assert load_config(preset="tiny-dpo").preference.sft_steps > 0
    cases = [
        (["preference.synthetic_records=0"], "needs data.paths"),
        (["preference.margin=0.2"], "only with data.task"),  # a pre-training run takes no preference settings
        (["preference.beta=0.2"], "DPO setting"),
        (["preference.sft_steps=500"], "leaves no RM step"),
        (["checkpoint.dir=runs/tiny-rm"], "is output_dir itself"),
        (["data.task=dpo", "preference.margin=1"], "reward-model setting"),
        (
            ["plugin.name=hybrid", "plugin.pp=2", "plugin.sp=2", "plugin.sp_mode=ring", "schedule.num_microbatches=2"],
            "use sp=1 with pp > 1",
        ),
        (["plugin.name=hybrid", "plugin.tp=2", "plugin.sp_mode=megatron"], "drop sp_mode='megatron'"),
    ]
    for overrides, message in cases:
        preset = "tiny-llama" if message == "only with data.task" else "tiny-rm"
        with pytest.raises(ConfigError, match=message):
            load_config(preset=preset, overrides=overrides)


def short(preset: str, output_dir: str, **changes) -> dict:
    from colo.apps.train import load_config

    overrides = [
        f"output_dir={output_dir}",
        "preference.synthetic_records=96",
        "data.global_batch_size=8",
        "eval.num_sequences=16",
        "eval.batch_size=8",
        "logging.every_steps=2",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "sample.max_new_tokens=0",
        "checkpoint.every_steps=3",
        *[f"{key}={value}" for key, value in changes.items()],
    ]
    return load_config(preset=preset, overrides=overrides).model_dump(mode="json")


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {"losses": result.losses, "eval_losses": result.eval_losses, "start_step": result.start_step}


@pytest.mark.slow
def test_tiny_presets_smoke_and_dpo_resumes_exactly(tmp_path):
    settings = {"schedule.total_steps": 8, "schedule.warmup_steps": 1, "preference.sft_steps": 2, "eval.every_steps": 4}
    straight = run_distributed(_train, short("tiny-dpo", str(tmp_path / "a"), **settings), world_size=2, timeout=120)[0]
    stopped = short("tiny-dpo", str(tmp_path / "b"), **settings, **{"schedule.stop_at_step": 7})
    run_distributed(_train, stopped, world_size=2, timeout=120)
    resumed = run_distributed(_train, short("tiny-dpo", str(tmp_path / "b"), **settings), world_size=2, timeout=120)[0]
    assert resumed["start_step"] == 6  # the checkpoint after step 6 (every 3 steps); the reference came with it
    for step in (7, 8):
        assert resumed["losses"][step] == straight["losses"][step]  # bit for bit, fp32


def _checkpoint_tensors(path) -> dict:
    """Every model tensor of a committed checkpoint, whole (whatever layout saved it)."""
    import torch

    from colo.tensor.checkpoint import load_checkpoint, read_index

    index = read_index(path)
    targets = {
        name: torch.empty(entry.shape, dtype=entry.dtype)
        for name, entry in index.tensors.items()
        if not name.startswith("optim/")
    }
    load_checkpoint(path, targets, strict=False)
    return targets


RM_SETTINGS = {
    "schedule.total_steps": 8,
    "schedule.warmup_steps": 1,
    "preference.sft_steps": 4,
    "eval.every_steps": 4,
    "optimizer.lr": 1e-3,
}


@pytest.mark.slow
def test_reward_model_starts_from_the_sft_policy_and_resumes_exactly_from_either_stage(tmp_path):
    import shutil

    import torch

    lr = RM_SETTINGS["optimizer.lr"]
    config = short(
        "tiny-rm", str(tmp_path / "a"), **RM_SETTINGS, **{"checkpoint.every_steps": 1, "checkpoint.keep_last": "null"}
    )
    straight = run_distributed(_train, config, world_size=2, timeout=120)[0]
    assert sorted(straight["losses"]) == list(range(1, 9))
    # the warm-up is next-token loss (~log 320 per token), the second stage a Bradley-Terry loss (~log 2 at first)
    assert all(straight["losses"][step] > 4 for step in range(1, 5))
    assert all(abs(straight["losses"][step] - 0.693) < 0.05 for step in (5, 6))
    checkpoints = tmp_path / "a" / "checkpoints"
    policy = _checkpoint_tensors(tmp_path / "a" / "sft-policy")
    assert policy["lm_head.weight"].shape[0] > 1  # the policy's vocabulary head
    reward = _checkpoint_tensors(checkpoints / "step-00000008")
    assert reward["lm_head.weight"].shape[0] == 1  # the scalar head
    first_rm_step = _checkpoint_tensors(checkpoints / "step-00000005")
    backbone = [name for name in policy if name != "lm_head.weight"]
    assert backbone and set(backbone) <= set(first_rm_step)
    # one Adam step moves an element by at most lr: the reward model started from the SFT'd policy ...
    moved = max((first_rm_step[name] - policy[name]).abs().max().item() for name in backbone)
    assert moved <= lr * 1.001
    # ... which is the policy after the 4 warm-up steps (its own checkpoint of step 4), 3 steps on from step 1's
    at_step_4, after_one = (_checkpoint_tensors(checkpoints / f"step-0000000{step}") for step in (4, 1))
    assert all(torch.equal(policy[name], at_step_4[name]) for name in policy)
    assert max((policy[name] - after_one[name]).abs().max().item() for name in backbone) > 2 * lr
    # PPO takes the reward model from a checkpoint of the second stage only
    from colo.apps.rlhf.ppo_task import check_reward_model
    from colo.apps.train import validate_config

    check_reward_model(str(checkpoints / "step-00000008"), validate_config(config))
    with pytest.raises(ValueError, match="SFT warm-up of a reward-model run"):
        check_reward_model(str(checkpoints / "step-00000004"), validate_config(config))

    # killed after step 7 (checkpoints after steps 3 and 6): resumed from 6 (the reward model) and from 3 (the
    # policy, crossing the switch again): the uninterrupted losses, bit for bit (fp32)
    stopped = short("tiny-rm", str(tmp_path / "b"), **RM_SETTINGS, **{"schedule.stop_at_step": 7})
    run_distributed(_train, stopped, world_size=2, timeout=120)
    shutil.copytree(tmp_path / "b", tmp_path / "b3")
    shutil.rmtree(tmp_path / "b3" / "checkpoints" / "step-00000006")
    for directory, start_step in (("b", 6), ("b3", 3)):
        resumed = run_distributed(
            _train, short("tiny-rm", str(tmp_path / directory), **RM_SETTINGS), world_size=2, timeout=120
        )[0]
        assert resumed["start_step"] == start_step
        for step in range(start_step + 1, 9):
            assert resumed["losses"][step] == straight["losses"][step], (directory, step)


@pytest.mark.slow
@pytest.mark.parametrize(
    "plugin",
    [["plugin.name=zero", "plugin.stage=3"], ["plugin.name=hybrid", "plugin.tp=2"]],
    ids=["zero3", "hybrid-tp2"],
)
def test_reward_model_from_the_sft_policy_under_zero3_and_tp2(tmp_path, plugin):
    """The two-stage run under a sharded layout: the reward model starts from the SFT'd policy (the same Adam-step
    bound), and under ZeRO-3 every loss equals the DDP run's (rtol 1e-5: ZeRO-3 reduces in another order)."""
    lr = RM_SETTINGS["optimizer.lr"]
    changes = {**RM_SETTINGS, "schedule.total_steps": 6, "checkpoint.every_steps": 5}
    changes.update(dict(item.split("=") for item in plugin))
    result = run_distributed(_train, short("tiny-rm", str(tmp_path / "x"), **changes), world_size=2, timeout=120)[0]
    checkpoints = tmp_path / "x" / "checkpoints"
    policy = _checkpoint_tensors(tmp_path / "x" / "sft-policy")
    first_rm_step = _checkpoint_tensors(checkpoints / "step-00000005")
    assert first_rm_step["lm_head.weight"].shape[0] == 1
    backbone = [name for name in policy if name != "lm_head.weight"]
    assert max((first_rm_step[name] - policy[name]).abs().max().item() for name in backbone) <= lr * 1.001
    if plugin[0] == "plugin.name=zero":
        ddp = {**RM_SETTINGS, "schedule.total_steps": 6, "checkpoint.enabled": False}
        reference = run_distributed(_train, short("tiny-rm", str(tmp_path / "d"), **ddp), world_size=2, timeout=120)
        assert result["losses"] == pytest.approx(reference[0]["losses"], rel=1e-5)
