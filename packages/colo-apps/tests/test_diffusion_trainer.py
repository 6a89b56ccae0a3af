"""``data.task: diffusion`` through the trainer on 2 processes (ZeRO-2): a run stopped after a checkpoint and
resumed reproduces the uninterrupted losses and EMA exactly (fp32, same layout), and evals write a sample grid."""

from __future__ import annotations

import os

import pytest
import torch

from colo.comm.testing import run_distributed

pytest.importorskip("diffusers")


def run_config(output_dir: str, **schedule):
    from colo.apps.train.config import RunConfig

    return RunConfig(
        output_dir=output_dir,
        seed=0,
        plugin={"name": "zero", "stage": 2},
        optimizer={"lr": 1e-3, "weight_decay": 0.0},
        schedule={"total_steps": 6, "warmup_steps": 1, "min_lr": 1e-4, **schedule},
        data={"task": "diffusion", "global_batch_size": 4},
        checkpoint={"every_steps": 2, "resume": "auto"},
        logging={"every_steps": 1, "tensorboard": False, "progress_bar": False},
        eval={"every_steps": 6},
        diffusion={
            "unet_channels": [8, 16],
            "norm_num_groups": 4,
            "text_hidden_size": 16,
            "text_layers": 1,
            "vae_channels": [8, 8],
            "num_images": 32,
            "vae_pretrain_steps": 2,
            "sample_prompts": ["a red circle on white", "a blue square on black"],
            "samples_per_prompt": 2,
            "sample_steps": 2,
            "prediction_type": "v_prediction",
            "snr_gamma": 5.0,
            "condition_dropout": 0.2,
        },
    )


def _train(output_dir, stop_at_step):
    from colo.apps.diffusion.trainer import DiffusionTrainer

    config = run_config(output_dir, **({"stop_at_step": stop_at_step} if stop_at_step else {}))
    trainer = DiffusionTrainer(config)
    result = trainer.fit()
    return result, trainer.ema.full()


def test_resumed_run_reproduces_the_uninterrupted_one_exactly(tmp_path):
    whole = run_distributed(_train, str(tmp_path / "whole"), None, world_size=2, timeout=240)[0]
    run_distributed(_train, str(tmp_path / "cut"), 5, world_size=2, timeout=240)  # killed after step 5
    resumed = run_distributed(_train, str(tmp_path / "cut"), None, world_size=2, timeout=240)[0]
    (whole_result, whole_ema), (resumed_result, resumed_ema) = whole, resumed
    assert resumed_result["start_step"] == 4  # the last checkpoint before the cut
    assert resumed_result["losses"] == whole_result["losses"][4:]  # bit for bit
    for name, value in whole_ema.items():
        assert torch.equal(resumed_ema[name], value), name
    assert os.path.isdir(tmp_path / "whole" / "checkpoints" / "step-00000006" / "ema")
    grid = tmp_path / "whole" / "samples" / "step-00000006.png"
    assert grid.exists() and whole_result["grids"] == [str(grid)]

    # the run exported as a diffusers pipeline (EMA weights) loads in DiffusionPipeline and samples
    from diffusers import DiffusionPipeline
    from typer.testing import CliRunner

    from colo.apps.cli.app import app

    out = tmp_path / "pipeline"
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-00000006"
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(out), "--to", "diffusers"])
    assert result.exit_code == 0, result.output
    pipeline = DiffusionPipeline.from_pretrained(str(out))
    assert type(pipeline).__name__ == "StableDiffusionPipeline" and pipeline.safety_checker is None
    torch.testing.assert_close(pipeline.unet.conv_in.weight, whole_ema["unet.conv_in.weight"], rtol=0, atol=0)
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(
        ["a red circle on white"],
        num_inference_steps=2,
        height=16,
        width=16,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (1, 3, 16, 16) and torch.isfinite(images).all()
    again = CliRunner().invoke(app, ["convert", str(checkpoint), str(out), "--to", "diffusers"])
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_colo_train_prints_the_diffusion_run_like_every_recipe(tmp_path):
    """`colo train --preset tiny-diffusion` (shortened, one process): the header, step lines with loss, images/s and
    memory, where the sample grid went, and the done: summary."""
    import subprocess
    import sys

    sets = {
        "output_dir": str(tmp_path / "run"), "schedule.total_steps": 4, "schedule.warmup_steps": 1,
        "data.global_batch_size": 4, "logging.every_steps": 2, "eval.every_steps": 4, "checkpoint.every_steps": 4,
        "logging.tensorboard": "false", "diffusion.unet_channels": "[8, 16]", "diffusion.norm_num_groups": 4,
        "diffusion.text_hidden_size": 16, "diffusion.text_layers": 1, "diffusion.vae_channels": "[8, 8]",
        "diffusion.num_images": 16, "diffusion.vae_pretrain_steps": 1, "diffusion.samples_per_prompt": 1,
        "diffusion.sample_steps": 2,
    }  # fmt: skip
    command = [sys.executable, "-m", "colo.apps.cli", "train", "--preset", "tiny-diffusion"]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "colo train: tiny-diffusion | 1 process(es)" in out, out
    for step in (2, 4):
        assert f"step {step}/4 | loss " in out and "images/s | mem " in out, out
    assert f"samples at step 4: {tmp_path / 'run' / 'samples' / 'step-00000004.png'}" in out, out
    assert "done: steps 1-4 in " in out and "last checkpoint " in out and "step-00000004" in out, out
