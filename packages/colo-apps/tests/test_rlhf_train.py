"""``data.task: rm | dpo`` in the one trainer: validation, the tiny presets as a short 2-process smoke run, and an
exact resume of a DPO run (the reference table travels in the checkpoint)."""

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
        (["data.task=dpo", "preference.margin=1"], "reward-model setting"),
        (["plugin.name=hybrid", "plugin.pp=2", "schedule.num_microbatches=2"], "supports tp and dp"),
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
    rm = short(
        "tiny-rm",
        str(tmp_path / "rm"),
        **{"schedule.total_steps": 4, "schedule.warmup_steps": 1, "eval.every_steps": 4},
    )
    assert len(run_distributed(_train, rm, world_size=2, timeout=120)[0]["losses"]) == 4
    settings = {"schedule.total_steps": 8, "schedule.warmup_steps": 1, "preference.sft_steps": 2, "eval.every_steps": 4}
    straight = run_distributed(_train, short("tiny-dpo", str(tmp_path / "a"), **settings), world_size=2, timeout=120)[0]
    stopped = short("tiny-dpo", str(tmp_path / "b"), **settings, **{"schedule.stop_at_step": 7})
    run_distributed(_train, stopped, world_size=2, timeout=120)
    resumed = run_distributed(_train, short("tiny-dpo", str(tmp_path / "b"), **settings), world_size=2, timeout=120)[0]
    assert resumed["start_step"] == 6  # the checkpoint after step 6 (every 3 steps); the reference came with it
    for step in (7, 8):
        assert resumed["losses"][step] == straight["losses"][step]  # bit for bit, fp32
