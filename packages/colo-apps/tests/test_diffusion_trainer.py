"""``data.task: diffusion`` on the one training loop (`colo.apps.train.Trainer`), 2 processes, ZeRO-2:

- a run preempted by SIGTERM (sent to one rank mid-step, as a scheduler does) checkpoints at the step every rank
  agrees on, and the next run resumes there and reproduces the uninterrupted losses and EMA exactly (fp32, same
  layout);
- every checkpoint is saved in the background (``checkpoint.async_save``: the save returns a handle before its
  commit), commits with its EMA beside it, and is what the resumed run loads;
- the run's ``optimizer`` section reaches the boosted optimizer: ``fused``, decay / no-decay groups and layer-wise LR
  decay over the UNet's blocks (`UNetDepth`);
- evals write a sample grid, and the checkpoint exports as a diffusers pipeline that samples.
"""

from __future__ import annotations

import os

import pytest
import torch

from colo.comm.testing import run_distributed

pytest.importorskip("diffusers")

OPTIMIZER = {"lr": 1e-3, "weight_decay": 0.01, "layerwise_lr_decay": 0.8, "fused": True}


def run_config(output_dir: str, **schedule):
    from colo.apps.train.config import RunConfig

    return RunConfig(
        output_dir=output_dir,
        seed=0,
        plugin={"name": "zero", "stage": 2},
        optimizer=OPTIMIZER,
        schedule={"total_steps": 6, "warmup_steps": 1, "min_lr": 1e-4, **schedule},
        data={"task": "diffusion", "global_batch_size": 4},
        checkpoint={"every_steps": 2, "resume": "auto", "async_save": True},
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


def _train(output_dir, preempt_at_step=None):
    """Every rank: the run (with rank 1 sent SIGTERM during ``preempt_at_step``); returns its `TrainResult`, the
    gathered EMA, each save's (checkpoint, what `Booster.save` returned), the committed checkpoints and EMAs when
    it returned, and the boosted optimizer's groups."""
    import signal

    from colo.apps.train import Trainer
    from colo.apps.train.state import committed_checkpoints

    trainer = Trainer(run_config(output_dir))
    booster, task = trainer.booster, trainer.task
    saves, save = [], booster.save

    def recorded_save(path, **kwargs):
        handle = save(path, **kwargs)
        saves.append((os.path.basename(path), type(handle).__name__))
        return handle

    booster.save = recorded_save
    if preempt_at_step is not None:
        step_of_task = task.train_step

        def train_step(ctx, step):
            if step + 1 == preempt_at_step and ctx.rank == 1:
                if signal.getsignal(signal.SIGTERM) != trainer.guard._on_sigterm:  # never kill the pool's rank
                    raise AssertionError("the trainer's SIGTERM handler is not installed")
                os.kill(os.getpid(), signal.SIGTERM)
            return step_of_task(ctx, step)

        task.train_step = train_step
    result = trainer.fit()
    root = trainer.config.checkpoint_dir
    committed = [
        [os.path.basename(path) for _, path in committed_checkpoints(directory)]
        for directory in (root, os.path.join(root, "ema"))
    ]
    groups = [
        {key: group[key] for key in ("name", "initial_lr", "weight_decay", "fused")}
        for group in booster.engine.torch_optimizer.param_groups
    ]
    return result, task.ema.full(), saves, committed, groups


def _expected_groups():
    """The groups `build_optimizer` makes of the run's `DenoiserLoss` in one process, by name."""
    from colo.apps.diffusion import DenoiserLoss
    from colo.apps.diffusion.components import initial_unet
    from colo.apps.diffusion.task import UNetDepth
    from colo.apps.train.optim import param_groups

    config = run_config("unused")
    model = DenoiserLoss(initial_unet(config))
    depth = UNetDepth(model.unet)
    groups = param_groups(model, config.optimizer, num_layers=depth.num_layers, depth=depth)
    return depth.num_layers, {group["name"]: group for group in groups}


def test_a_preempted_run_resumes_exactly_from_its_background_checkpoint(tmp_path):
    whole = run_distributed(_train, str(tmp_path / "whole"), None, world_size=2, timeout=240)
    preempted = run_distributed(_train, str(tmp_path / "cut"), 3, world_size=2, timeout=240)
    resumed = run_distributed(_train, str(tmp_path / "cut"), None, world_size=2, timeout=240)
    whole_result, whole_ema, whole_saves, whole_kept, groups = whole[0]
    cut_result, _, cut_saves, cut_kept, _ = preempted[0]
    resumed_result, resumed_ema, *_ = resumed[0]

    # SIGTERM on rank 1 during step 3: every rank stopped after step 3 and checkpointed there (not a multiple of
    # checkpoint.every_steps), in the background like every save
    assert cut_result.preempted and cut_result.last_step == 3 and preempted[1][0].preempted
    assert cut_saves == [("step-00000002", "SaveHandle"), ("step-00000003", "SaveHandle")]
    assert whole_saves == [(f"step-{step:08d}", "SaveHandle") for step in (2, 4, 6)]
    # committed before the run returned, each with its EMA beside it (checkpoint.keep_last 2)
    assert cut_kept == [["step-00000002", "step-00000003"]] * 2
    assert whole_kept == [["step-00000004", "step-00000006"]] * 2  # the pruned checkpoints' averages went with them

    checkpoint = tmp_path / "cut" / "checkpoints" / "step-00000003"
    assert resumed_result.start_step == 3 and resumed_result.resumed_from == str(checkpoint)
    assert resumed_result.losses == {step: whole_result.losses[step] for step in (4, 5, 6)}  # bit for bit
    assert {step: whole_result.losses[step] for step in (1, 2, 3)} == cut_result.losses
    for name, value in whole_ema.items():
        assert torch.equal(resumed_ema[name], value), name
    grid = tmp_path / "whole" / "samples" / "step-00000006.png"
    assert grid.exists() and whole_result.sample == str(grid) and whole[1][0].sample is None

    # optimizer.fused, the no-decay groups and layer-wise LR decay reached the ZeRO-2 optimizer's groups
    num_layers, expected = _expected_groups()
    assert {group["name"] for group in groups} == set(expected)
    assert {"decay/depth0", "no_decay/depth0", f"no_decay/depth{num_layers + 1}"} <= set(expected)
    for group in groups:
        kind, depth = group["name"].split("/depth")
        assert group["fused"] is True
        assert group["weight_decay"] == (OPTIMIZER["weight_decay"] if kind == "decay" else 0.0)
        assert group["initial_lr"] == pytest.approx(OPTIMIZER["lr"] * 0.8 ** (num_layers + 1 - int(depth)))

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
    # a checkpoint copied without the EMA beside it exports the trained weights, and says so
    from colo.apps.diffusion.export import export_diffusers

    (checkpoint.parent / "ema").rename(tmp_path / "ema-elsewhere")
    with pytest.warns(UserWarning, match="kept an EMA but .* is missing"):
        export_diffusers(str(checkpoint), str(out), overwrite=True)


def test_the_unet_depth_orders_its_blocks_from_input_to_output():
    """Layer-wise LR decay over the UNet: input side 0, each down block, the mid block, each up block, output side
    num_layers + 1 (the full LR); 1-D parameters (norms, biases) in the no-decay groups."""
    from colo.apps.diffusion.components import initial_unet
    from colo.apps.diffusion.task import UNetDepth

    num_layers, groups = _expected_groups()
    assert num_layers == 5  # 2 down blocks, the mid block, 2 up blocks
    assert {int(name.split("/depth")[1]) for name in groups} == set(range(num_layers + 2))
    for group in groups.values():
        assert all((p.dim() < 2) == group["name"].startswith("no_decay") for p in group["params"])
    depth = UNetDepth(initial_unet(run_config("unused")))
    names = {
        "unet.conv_in.weight": 0,
        "unet.time_embedding.linear_1.weight": 0,
        "unet.down_blocks.0.resnets.0.conv1.weight": 1,
        "unet.down_blocks.1.attentions.0.proj_in.weight": 2,
        "unet.mid_block.resnets.0.conv1.weight": 3,
        "unet.up_blocks.0.resnets.0.conv1.weight": 4,
        "unet.up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.default.weight": 5,
        "unet.conv_norm_out.weight": 6,
        "unet.conv_out.bias": 6,
    }
    assert {name: depth(name) for name in names} == names


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
