"""``colo train`` of the diffusion transformer at 2 ranks: tensor parallelism (tp2) and Ulysses sequence parallelism
(sp2) under ``plugin.name: hybrid``, Gemini, and tp2 with its blocks compiled train like one process; the EMA holds
each rank's tensor-parallel shard and saves, gathers and exports the whole average; a tp2 run resumes bit for bit.

The same run config (the tiny DiT of `colo.apps.diffusion.testing`, flow matching with sigma_sqrt weighting and
condition dropout, the caption mask, EMA 0.9) trains 4 AdamW steps in one process (DDP, world 1) and in each layout
at 2 ranks. Losses rtol 1e-5; the checkpointed weights and the EMA rtol 1e-5 / atol 1e-4, as test_dit_parallel.py's
and for its reasons: the row-parallel projections sum partial products over the ranks (tp), the token split sums
weight gradients per rank before the average (sp), data ranks average their halves' gradients (Gemini, DDP), so fp32
additions run in another order, and AdamW's normalisation turns rounding of near-zero gradients into steps of ~lr.
The key biases are left out of the weight check: their exact gradient is 0 (softmax ignores ``q . b_k``), so AdamW
steps on rounding noise. A layout mistake (a wrong shard, a missing reduction, the caption
split) moves the losses by O(1) relative.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from colo.apps.diffusion.testing import LR
from colo.comm.testing import run_distributed

pytest.importorskip("diffusers")

STEPS = 4
TP2 = {"name": "hybrid", "tp": 2, "zero_stage": 1}
SP2 = {"name": "hybrid", "sp": 2, "sp_mode": "ulysses", "zero_stage": 2}
GEMINI = {
    "name": "gemini", "placement": "static", "optim_fractions": {"host": 1.0}, "device_capacity": "64MiB",
    "chunk_numel": 8192,
}  # fmt: skip
COMPILED = {"compile_blocks": True, "compile_options": {"backend": "aot_eager"}}
LAYOUTS = {
    "tp2": TP2,
    "sp2-ulysses": SP2,
    "gemini-dp2": GEMINI,
    "tp2-compiled": {**TP2, **COMPILED},
}


def _config(output_dir: str, plugin: dict, total_steps: int = STEPS, **diffusion):
    from colo.apps.diffusion.testing import tiny_run_config

    return tiny_run_config(
        output_dir,
        plugin=plugin,
        denoiser="dit",
        objective="flow_matching",
        prediction_type="epsilon",
        loss_weighting="sigma_sqrt",
        flow_shift=1.0,
        schedule={"total_steps": total_steps, "warmup_steps": 0, "min_lr": LR},
        checkpoint_every=2,
        **diffusion,
    )


def _train(output_dir: str, plugin: dict, total_steps: int = STEPS):
    """Every rank: the run's losses, its start step, the gathered EMA (rank 0 only) and what the layout did to the
    transformer: how many of its parameters are tensor-parallel shards, whether block 0's self-attention core has
    the Ulysses all-to-all hooks, and the elements of this rank's EMA against the model's."""
    from colo.apps.train import Trainer
    from colo.tensor import layout_of

    trainer = Trainer(_config(output_dir, plugin, total_steps))
    result = trainer.fit()
    dit = trainer.ctx.booster.unwrap().transformer
    layout = {
        "tp_shards": sum(
            layout_of(p) is not None and tuple(layout_of(p).global_shape) != p.shape for p in dit.parameters()
        ),
        "ulysses": len(dit.transformer_blocks[0].attn1.core._forward_pre_hooks) > 0,
        "compiled": [getattr(block, "_compiled_call_impl", None) is not None for block in dit.transformer_blocks],
        "ema_numel": sum(value.numel() for value, _ in trainer.task.ema.shadow.values()),
        "model_numel": trainer.task._num_parameters,
    }
    return result.losses, result.start_step, trainer.task.ema.full(to_rank=0), layout


def _checkpointed_weights(output_dir: str) -> tuple[dict, dict]:
    """``(weights, EMA)`` of the run's step-4 checkpoint, whole (any layout), by ``transformer.*`` name."""
    from colo.apps.models.dit import DiffusionTransformer
    from colo.tensor.checkpoint import load_checkpoint

    dit = DiffusionTransformer(_config(output_dir, {"name": "ddp"}).diffusion.dit_config_object())
    names = {f"transformer.{name}": value for name, value in dit.state_dict().items()}
    root = os.path.join(output_dir, "checkpoints")
    weights = {name: torch.empty_like(value) for name, value in names.items()}
    load_checkpoint(os.path.join(root, "step-00000004"), weights, strict=False)
    ema = {f"ema/{name}": torch.empty_like(value) for name, value in names.items()}
    load_checkpoint(os.path.join(root, "ema", "step-00000004"), ema, strict=False)
    return weights, {name.removeprefix("ema/"): value for name, value in ema.items()}


def _assert_close_weights(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        if not name.endswith("to_k.bias"):  # exact gradient 0: see the module docstring
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-4, msg=f"{what} {name}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dit-one-process"))
    ((losses, _, ema, _),) = run_distributed(_train, out, {"name": "ddp"}, world_size=1, timeout=240)
    return losses, ema, _checkpointed_weights(out)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_dit_trains_like_one_process(name, one_process, tmp_path):
    """Each layout at 2 ranks: tp2 and Ulysses sp2 (hybrid, every rank the whole batch), Gemini dp2 (optimizer state
    on the host tier; each rank half the batch), and hybrid tp2 with every transformer block compiled
    (``compile_blocks``; aot_eager traces each block whole, ``fullgraph=True``, the tp collectives inside: a graph
    break fails the run). DDP's compiled blocks are the same graphs without the collectives (not run here: compiling
    costs ~20-50 s on the shared CPUs)."""
    plugin = LAYOUTS[name]
    expected_losses, expected_ema, (expected_weights, _) = one_process
    out = str(tmp_path / "run")
    results = run_distributed(_train, out, plugin, world_size=2, timeout=240)
    for losses, start, _, layout in results:
        assert start == 0 and len(losses) == STEPS
        assert list(losses.values()) == pytest.approx(list(expected_losses.values()), rel=1e-5)
        assert all(layout["compiled"]) == bool(plugin.get("compile_blocks")), layout
        if plugin.get("tp"):  # q / k / v / out and the MLP of both attentions sharded; the EMA holds those shards
            assert layout["tp_shards"] > 0 and not layout["ulysses"]
            assert layout["ema_numel"] < layout["model_numel"], layout
        elif plugin.get("sp"):  # the tokens split: Ulysses all-to-alls around every self-attention core
            assert layout["tp_shards"] == 0 and layout["ulysses"], layout
        else:
            assert layout["tp_shards"] == 0 and not layout["ulysses"], layout
    ema = results[0][2]
    assert results[1][2] == {}  # assembled on rank 0 alone
    _assert_close_weights(ema, expected_ema, "ema")
    weights, saved_ema = _checkpointed_weights(out)
    _assert_close_weights(weights, expected_weights, "weights")
    for name, value in ema.items():  # the checkpointed EMA is the gathered one
        assert torch.equal(saved_ema[name], value), name
    assert not torch.equal(ema["transformer.proj_out.weight"], weights["transformer.proj_out.weight"])


def test_tp2_resumes_bit_for_bit_and_exports_the_whole_average(tmp_path):
    """A tp2 run stopped after its step-2 checkpoint and resumed gives the uninterrupted run's losses and EMA bit for
    bit (fp32, same layout); the export of the tp2 checkpoint is a PixArtAlphaPipeline whose transformer holds the
    whole gathered EMA."""
    from diffusers import DiffusionPipeline

    from colo.apps.diffusion.export import export_diffusers

    whole = str(tmp_path / "whole")
    (losses, _, ema, _), _ = run_distributed(_train, whole, TP2, world_size=2, timeout=240)
    cut = str(tmp_path / "cut")
    shutil.copytree(whole, cut)
    for path in ("step-00000004", os.path.join("ema", "step-00000004")):
        shutil.rmtree(os.path.join(cut, "checkpoints", path))
    (resumed, start, resumed_ema, _), _ = run_distributed(_train, cut, TP2, world_size=2, timeout=240)
    assert start == 2
    assert resumed == {step: losses[step] for step in (3, 4)}
    assert set(resumed_ema) == set(ema) and all(torch.equal(resumed_ema[n], v) for n, v in ema.items())

    out = str(tmp_path / "export")
    export_diffusers(os.path.join(whole, "checkpoints", "step-00000004"), out)
    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == "PixArtAlphaPipeline"
    exported = pipeline.transformer.state_dict()
    for name, value in ema.items():
        assert torch.equal(exported[name.removeprefix("transformer.")], value), name


def test_hybrid_refuses_the_unet_and_layouts_the_dit_lacks():
    from colo.apps.train.config import RunConfig

    def config(plugin: dict, denoiser: str = "dit"):
        fields = {"denoiser": denoiser}
        if denoiser == "dit":
            fields.update({"objective": "flow_matching", "flow_shift": 1.0})
        schedule = {"num_microbatches": 2}
        return RunConfig(data={"task": "diffusion"}, plugin=plugin, diffusion=fields, schedule=schedule)

    with pytest.raises(ValueError, match="set diffusion.denoiser='dit', or train the UNet under plugin.name 'ddp'"):
        config({"name": "hybrid", "tp": 2}, denoiser="unet")
    with pytest.raises(ValueError, match=r"not pp=2 \(no pipeline stages\)"):
        config({"name": "hybrid", "pp": 2})
    with pytest.raises(ValueError, match=r"not sp_mode='ring' \(the tokens split with Ulysses only\)"):
        config({"name": "hybrid", "sp": 2, "sp_mode": "ring"})
    assert config({"name": "hybrid", "tp": 2, "sp": 2, "sp_mode": "ulysses"}).plugin.tp == 2


def _train_video(output_dir: str, plugin: dict):
    """Every rank: 3 steps on 2-frame clips of the moving shapes; the losses, the EMA (rank 0), the batch's latent
    shape and, on rank 0, the size of the sample grid of the EMA."""
    from PIL import Image

    from colo.apps.train import Trainer

    trainer = Trainer(_config(output_dir, plugin, 3, num_frames=2))
    result = trainer.fit()
    shape = tuple(trainer.task.step_batch(trainer.ctx, 0)["noisy_latents"].shape)
    grid = trainer.task.sample_grid(trainer.ctx, 3)  # every rank gathers the EMA; rank 0 samples and writes
    return result.losses, trainer.task.ema.full(to_rank=0), shape, Image.open(grid).size if grid else None


def test_video_clips_train_under_ulysses_like_one_process(tmp_path):
    """``diffusion.num_frames: 2``: clips of the moving shapes (each frame through the image VAE) give the DiT
    ``(batch, 4, 2, 8, 8)`` latents, 32 tokens over both frames; Ulysses sp2 (the split falls between the frames,
    attention spans both) equals one process over 3 AdamW steps (losses rtol 1e-5, EMA rtol 1e-5 / atol 1e-4), and
    the sample grid (Euler flow steps through colo's DiT, each frame decoded) shows one clip a row, its 2 frames side
    by side."""
    ((expected, expected_ema, shape, grid),) = run_distributed(
        _train_video, str(tmp_path / "one"), {"name": "ddp"}, world_size=1, timeout=240
    )
    assert shape == (4, 4, 2, 8, 8)
    assert grid == (4 * (2 * 17 + 1), 4 * (1 * 17 + 1))  # 2 frames x 1 prompt x 1 seed, 16 px + borders, x4
    results = run_distributed(_train_video, str(tmp_path / "sp2"), SP2, world_size=2, timeout=240)
    for losses, _, _, _ in results:
        assert list(losses.values()) == pytest.approx(list(expected.values()), rel=1e-5)
    _assert_close_weights(results[0][1], expected_ema, "ema")
