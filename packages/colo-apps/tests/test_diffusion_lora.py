"""LoRA on the UNet's attention (to_q / to_k / to_v / to_out.0) through peft: DDP dp2 and ZeRO-2 dp2 match the
single-process peft model (diffusers' ``unet.add_adapter``, as ``train_text_to_image_lora.py`` adds it) over 5 steps,
only the adapters train, and a LoRA run's export holds adapters that ``StableDiffusionPipeline.load_lora_weights``
applies at the trained scale.

Tolerances (fp32): losses rtol 1e-5; adapters rtol 1e-5 / atol 1e-4. Not bit-identical for the reason of
test_diffusion_parallel.py: each rank runs half the batch (other summation order), gradients are averaged over ranks.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from colo.apps.diffusion.testing import GLOBAL_BATCH, LR, SEED, components, step_images, tiny_run_config
from colo.comm.testing import run_distributed

pytest.importorskip("diffusers")
pytest.importorskip("peft")

NUM_STEPS = 5
RANK, ALPHA = 4, 8.0  # scaling 2: an export that dropped alpha would load at scale 1 and fail the pipeline check
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def _builder(tokenizer, text_encoder, vae):
    from colo.apps.diffusion import DiffusionBatchBuilder, DiffusionObjective

    return DiffusionBatchBuilder(
        DiffusionObjective(prediction_type="epsilon", snr_gamma=5.0),
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
    )


def _batch(builder, step, rows):
    images = step_images(step)
    return builder(
        step=step,
        captions=images["caption"][rows],
        pixel_values=images["pixel_values"][rows],
        rows=rows,
        global_rows=GLOBAL_BATCH,
    )


@torch.no_grad()
def _set_adapters(unet):
    """Both halves of every adapter drawn from one seed (B nonzero: A gets gradients from the first step on)."""
    generator = torch.Generator().manual_seed(SEED)
    for name, p in unet.named_parameters():
        if ".lora_" in name:
            p.copy_(torch.randn(p.shape, generator=generator) / RANK)


def single_process_peft():
    """The UNet with peft adapters added the diffusers way, trained alone on the whole batch."""
    from peft import LoraConfig

    from colo.apps.diffusion import DenoiserLoss

    _, tokenizer, text_encoder, vae, unet = components()
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    _set_adapters(unet)
    builder, model = _builder(tokenizer, text_encoder, vae), DenoiserLoss(unet)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=LR)
    losses = []
    for step in range(NUM_STEPS):
        loss = model(**_batch(builder, step, slice(0, GLOBAL_BATCH)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in trainable.items()}, model.state_dict()


def _plugin(plugin_name):
    from colo.apps.booster import DDP, Gemini, Zero

    if plugin_name == "ddp":
        return DDP()
    if plugin_name == "gemini":  # adapters' optimizer state on the host tier
        return Gemini(placement="static", optim_fractions={"host": 1.0}, device_capacity="64MiB", chunk_numel=4096)
    return Zero(stage=int(plugin_name[-1]), chunk_numel=4096)


def _boosted_lora(plugin_name):
    from colo.apps.booster import Booster
    from colo.apps.diffusion import DenoiserLoss
    from colo.apps.diffusion.lora import add_unet_lora

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _, tokenizer, text_encoder, vae, unet = components()
    torch.manual_seed(SEED + 1 + rank)  # adapters drawn differently per rank: boost makes them all rank 0's...
    add_unet_lora(unet, r=RANK, alpha=ALPHA)
    if rank == 0:  # ...which are the reference's
        _set_adapters(unet)
    builder, model = _builder(tokenizer, text_encoder, vae), DenoiserLoss(unet)
    trainable = [p for p in model.parameters() if p.requires_grad]
    booster = Booster(_plugin(plugin_name))
    booster.boost(model, torch.optim.AdamW(trainable, lr=LR))
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = [booster.train_step(_batch(builder, step, rows)).loss for step in range(NUM_STEPS)]
    return losses, *_adapters_and_base(booster)


def _adapters_and_base(booster):
    """``(adapters, frozen base)`` by name, whole (`Booster.full_state_dict`: gathered from the chunks' shards under
    ZeRO-3 / Gemini, a collective; the adapters as the fp32 masters the optimizer steps)."""
    weights = booster.full_state_dict()
    adapters = {name: value for name, value in weights.items() if ".lora_" in name}
    return adapters, {name: value for name, value in weights.items() if name not in adapters}


@pytest.fixture(scope="module")
def reference():
    return single_process_peft()


@pytest.mark.parametrize("plugin_name", ["ddp", "zero2", "zero3", "gemini"])
def test_lora_under_each_plugin_matches_single_process_peft(plugin_name, reference):
    expected_losses, expected_adapters, initial_state = reference
    for losses, adapters, frozen in run_distributed(_boosted_lora, plugin_name, world_size=2, timeout=180):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert set(adapters) == set(expected_adapters)
        for name, value in expected_adapters.items():
            torch.testing.assert_close(adapters[name], value, rtol=1e-5, atol=1e-4, msg=name)
        assert set(frozen) == set(initial_state) - set(expected_adapters)
        for name, value in frozen.items():  # the base never moves
            assert torch.equal(value, initial_state[name]), name
    assert len(set(expected_losses)) == NUM_STEPS
    num_attentions = sum(name.endswith(".to_q.base_layer.weight") for name in initial_state)
    assert num_attentions == 8 and len(expected_adapters) == num_attentions * 4 * 2  # (q, k, v, out) x (A, B)


def _lora_resume_run(output_dir, plugin, stop_at_step):
    from colo.apps.train import Trainer

    schedule = {"total_steps": 4, **({"stop_at_step": stop_at_step} if stop_at_step else {})}
    lora = {"enabled": True, "r": RANK, "alpha": ALPHA}
    config = tiny_run_config(output_dir, lora=lora, plugin=plugin, schedule=schedule, checkpoint_every=2)
    trainer = Trainer(config)
    result = trainer.fit()
    adapters, base = _adapters_and_base(trainer.booster)
    return result, adapters, trainer.task.ema.full(), base


@pytest.mark.parametrize("plugin", [{"name": "ddp"}, {"name": "zero", "stage": 3}], ids=["ddp", "zero3"])
def test_a_resumed_lora_run_reproduces_the_uninterrupted_one_exactly(plugin, tmp_path):
    """2 processes, fp32: stopped after step 3 (last checkpoint: step 2) and resumed, the losses, the adapters, their
    EMA and the frozen base equal the uninterrupted run's bit for bit."""
    whole = run_distributed(_lora_resume_run, str(tmp_path / "whole"), plugin, None, world_size=2, timeout=240)
    run_distributed(_lora_resume_run, str(tmp_path / "cut"), plugin, 3, world_size=2, timeout=240)
    resumed = run_distributed(_lora_resume_run, str(tmp_path / "cut"), plugin, None, world_size=2, timeout=240)
    for (whole_result, *whole_tensors), (resumed_result, *resumed_tensors) in zip(whole, resumed):
        assert resumed_result.start_step == 2
        assert sorted(whole_result.losses) == [1, 2, 3, 4]
        assert resumed_result.losses == {step: whole_result.losses[step] for step in (3, 4)}
        for kind, expected, got in zip(("adapters", "ema", "base"), whole_tensors, resumed_tensors):
            assert expected and set(got) == set(expected), kind
            for name, value in expected.items():
                assert torch.equal(got[name], value), f"{kind} {name}"
        adapters, ema, base = whole_tensors
        assert set(ema) == set(adapters) and all(".lora_" in name for name in adapters)
        assert not any(".lora_" in name for name in base)


def _lora_run(output_dir):
    from colo.apps.diffusion.components import initial_unet
    from colo.apps.diffusion.lora import add_unet_lora, lora_settings
    from colo.apps.train import Trainer

    lora = {"enabled": True, "r": RANK, "alpha": ALPHA}
    trainer = Trainer(tiny_run_config(output_dir, lora=lora, cache_latents=True))
    trainer.fit()
    grid = trainer.task.sample_grid(trainer.ctx, 3)  # the base UNet with the averaged adapters (and the VAE loaded)
    assert grid is None or os.path.exists(grid)
    averaged = trainer.task.ema.full()  # the adapters' average: what the export writes
    unet = add_unet_lora(initial_unet(trainer.config), **lora_settings(trainer.config.lora))
    unet.load_state_dict({n.removeprefix("unet."): v for n, v in averaged.items()}, strict=False)
    return sorted(averaged), unet.eval()


def test_a_lora_run_exports_adapters_that_load_lora_weights_applies(tmp_path):
    from diffusers import DiffusionPipeline
    from typer.testing import CliRunner

    from colo.apps.cli.app import app

    averaged_names, trained_unet = run_distributed(_lora_run, str(tmp_path / "run"), world_size=2, timeout=240)[0]
    assert averaged_names and all(".lora_" in name for name in averaged_names)  # the EMA holds the adapters only
    out = tmp_path / "pipeline"
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    result = CliRunner().invoke(app, ["convert", str(checkpoint), str(out), "--to", "diffusers"])
    assert result.exit_code == 0, result.output
    assert os.path.exists(out / "pytorch_lora_weights.safetensors")

    pipeline = DiffusionPipeline.from_pretrained(str(out))
    pipeline.set_progress_bar_config(disable=True)
    latents, timesteps = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([500])
    text = pipeline.text_encoder(pipeline.tokenizer(["a red circle on white"], return_tensors="pt").input_ids)[0]

    def unet_out(unet):
        with torch.no_grad():
            return unet(latents, timesteps, text, return_dict=False)[0]

    def image():
        return pipeline(
            ["a red circle on white"],
            num_inference_steps=2,
            height=16,
            width=16,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
        ).images

    base_out, base_image = unet_out(pipeline.unet), image()
    pipeline.load_lora_weights(str(out))
    # the pipeline's UNet with the loaded adapters is the trained one (the scale alpha / r included)
    torch.testing.assert_close(unet_out(pipeline.unet), unet_out(trained_unet), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(unet_out(pipeline.unet), base_out, atol=1e-6)
    assert not torch.equal(image(), base_image)


def _bf16_lora_losses(plugin_names):
    from colo.apps.booster import Booster, Gemini, Zero
    from colo.apps.diffusion import DenoiserLoss, DiffusionBatchBuilder, DiffusionObjective
    from colo.apps.diffusion.lora import add_unet_lora
    from colo.apps.diffusion.testing import components, step_images

    results = {}
    for name in plugin_names:
        _, tokenizer, text_encoder, vae, unet = components()
        torch.manual_seed(0)
        add_unet_lora(unet, r=4, alpha=8)
        builder = DiffusionBatchBuilder(DiffusionObjective(), tokenizer=tokenizer, text_encoder=text_encoder, vae=vae)
        if name == "gemini":
            plugin = Gemini(
                placement="static", optim_fractions={"host": 1.0}, device_capacity="64MiB", chunk_numel=4096,
                precision="bf16",
            )  # fmt: skip
        else:
            plugin = Zero(stage=int(name[-1]), precision="bf16", chunk_numel=4096)
        booster = Booster(plugin)
        trainable = [p for p in unet.parameters() if p.requires_grad]
        booster.boost(DenoiserLoss(unet, compute_dtype=torch.bfloat16), torch.optim.AdamW(trainable, lr=1e-3))
        rank = torch.distributed.get_rank()
        rows = slice(2 * rank, 2 * rank + 2)
        losses = []
        for step in range(3):
            images = step_images(step)
            batch = builder(
                step=step, captions=images["caption"][rows], pixel_values=images["pixel_values"][rows], rows=rows,
                global_rows=4,
            )  # fmt: skip
            losses.append(booster.train_step(batch).loss)
        results[name] = losses
    return results


def test_bf16_lora_trains_under_zero3_and_gemini_like_zero2():
    # peft casts a LoRA layer's input to its weight's dtype, read before the chunk is gathered: the empty placeholder
    # of a released parameter must carry the compute dtype (bf16), not the chunk's fp32 storage dtype (it did: the
    # first forward failed with "expected m1 and m2 to have the same dtype")
    results = run_distributed(_bf16_lora_losses, ["zero2", "zero3", "gemini"], world_size=2, timeout=180)[0]
    assert all(math.isfinite(loss) for loss in results["zero2"])
    for name in ("zero3", "gemini"):
        torch.testing.assert_close(results[name], results["zero2"], rtol=2e-3, atol=0, msg=name)
