"""``diffusion.denoiser: dit``: colo's diffusion transformer in the diffusion recipe.

The trainer trains it (2 processes, ZeRO-2, flow matching, with the caption mask), a stopped run resumes bit for bit,
the export is a ``PixArtAlphaPipeline`` whose transformer gives colo's output on the same inputs and which samples;
the config refuses the other denoiser's fields; the GPU preset builds PixArt-alpha's size on the meta device.
"""

from __future__ import annotations

import os

import pytest
import torch

from colo.apps.diffusion.testing import LR, components
from colo.comm.testing import run_distributed

pytest.importorskip("diffusers")


def _dit_config(output_dir: str, total_steps: int, plugin: dict | None = None, **diffusion):
    from colo.apps.diffusion.testing import tiny_run_config

    return tiny_run_config(
        output_dir,
        plugin=plugin,
        **diffusion,
        denoiser="dit",
        objective="flow_matching",
        prediction_type="epsilon",
        flow_shift=1.0,
        schedule={"total_steps": total_steps, "warmup_steps": 0, "min_lr": LR},  # constant LR: 2 + 2 steps = 4
        checkpoint_every=2,
    )


def _train(output_dir: str, total_steps: int, plugin: dict | None = None, **diffusion):
    """Every rank: the run's `TrainResult`, its gathered EMA (rank 0), the batch keys and the description."""
    from colo.apps.train import Trainer

    trainer = Trainer(_dit_config(output_dir, total_steps, plugin, **diffusion))
    result = trainer.fit()
    ema = trainer.task.ema.full(to_rank=0)
    keys = sorted(trainer.task.step_batch(trainer.ctx, 0))
    return result, ema, keys, trainer.task.describe(trainer.ctx)


def test_the_trainer_trains_resumes_and_exports_the_dit(tmp_path):
    """4 steps in one run equal 2 steps, then a run resuming there for 2 more: losses and EMA bit for bit (fp32, the
    same layout); a bf16 ZeRO-2 run with gradient checkpointing follows the fp32 losses (rel 1e-2). The export loads
    as a PixArtAlphaPipeline whose transformer, holding the EMA weights, equals colo's DiffusionTransformer with them
    on the same inputs, and samples end to end."""
    from diffusers import DiffusionPipeline

    from colo.apps.diffusion.export import export_diffusers
    from colo.apps.diffusion.sampling import sample_images
    from colo.apps.models.dit import DiffusionTransformer
    from colo.tensor.checkpoint import load_checkpoint

    whole = run_distributed(_train, str(tmp_path / "whole"), 4, world_size=2, timeout=240)
    first = run_distributed(_train, str(tmp_path / "cut"), 2, world_size=2, timeout=240)
    resumed = run_distributed(_train, str(tmp_path / "cut"), 4, world_size=2, timeout=240)
    whole_result, whole_ema, keys, described = whole[0]
    assert "encoder_attention_mask" in keys and "model: DiT (2 x 32, 2 heads, patch 2, 16 tokens)" in described[0]
    assert len(whole_result.losses) == 4 and all(torch.isfinite(torch.tensor(list(whole_result.losses.values()))))
    assert first[0][0].losses == {step: whole_result.losses[step] for step in (1, 2)}
    assert resumed[0][0].start_step == 2
    assert resumed[0][0].losses == {step: whole_result.losses[step] for step in (3, 4)}  # bit for bit
    assert whole_ema and all(name.startswith("transformer.") for name in whole_ema)
    for name, value in whole_ema.items():
        assert torch.equal(resumed[0][1][name], value), name
    # bf16 compute under ZeRO-2 with the blocks checkpointed: the same batches, losses within bf16 rounding
    bf16 = {"name": "zero", "stage": 2, "precision": "bf16"}
    half = run_distributed(_train, str(tmp_path / "bf16"), 2, bf16, gradient_checkpointing=True, world_size=2)
    assert half[0][0].losses == pytest.approx({step: whole_result.losses[step] for step in (1, 2)}, rel=1e-2)

    checkpoint = str(tmp_path / "whole" / "checkpoints" / "step-00000004")
    out = str(tmp_path / "export")
    assert export_diffusers(checkpoint, out) == [out]
    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == "PixArtAlphaPipeline"
    assert pipeline.scheduler.config.prediction_type == "flow_prediction" and pipeline.scheduler.config.flow_shift == 1
    config = _dit_config(str(tmp_path / "whole"), 4).diffusion.dit_config_object()
    ours = DiffusionTransformer(config)
    state = {"ema/transformer." + name: torch.empty_like(value) for name, value in ours.state_dict().items()}
    load_checkpoint(os.path.join(tmp_path, "whole", "checkpoints", "ema", "step-00000004"), state, strict=False)
    ours.load_state_dict({name.removeprefix("ema/transformer."): value for name, value in state.items()})
    generator = torch.Generator().manual_seed(0)
    latents, caption = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 16, 16, generator=generator)
    mask, timesteps = torch.tensor([[1] * 5 + [0] * 11, [1] * 16]), torch.tensor([999.0, 250.0])
    with torch.no_grad():
        exported = pipeline.transformer(
            latents, encoder_hidden_states=caption, timestep=timesteps, encoder_attention_mask=mask, return_dict=False
        )[0]
        torch.testing.assert_close(ours(latents, caption, timesteps, encoder_attention_mask=mask), exported)
    pipeline.set_progress_bar_config(disable=True)
    images = sample_images(pipeline, ["a red circle on white"], seeds=[0, 1], steps=2, guidance_scale=3.0, size=16)
    assert images.shape == (2, 3, 16, 16) and 0 <= images.min() and images.max() <= 1


def test_the_dit_batch_carries_the_caption_mask():
    """With ``caption_mask`` the builder returns the tokenizer's mask and the text states of the encoder called with
    it (as PixArt's pipeline calls it); CLIP's causal attention makes the kept tokens' states those without it."""
    from colo.apps.diffusion import FlowMatchingBatchBuilder, FlowMatchingObjective
    from colo.apps.diffusion.testing import step_images

    _, tokenizer, text_encoder, vae, _ = components()
    objective = FlowMatchingObjective(condition_dropout=0.0)
    images = step_images(0)
    batches = [
        FlowMatchingBatchBuilder(objective, tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, caption_mask=mask)(
            step=0, captions=images["caption"], pixel_values=images["pixel_values"], rows=slice(0, 4), global_rows=4
        )
        for mask in (False, True)
    ]  # fmt: skip
    assert "encoder_attention_mask" not in batches[0]
    mask = batches[1]["encoder_attention_mask"]
    words = [len(caption.split()) for caption in images["caption"]]
    assert mask.sum(dim=1).tolist() == [count + 2 for count in words]  # BOS, one token a word, EOS
    kept = mask.bool()
    torch.testing.assert_close(
        batches[1]["encoder_hidden_states"][kept], batches[0]["encoder_hidden_states"][kept], rtol=1e-5, atol=1e-6
    )
    for key in ("noisy_latents", "timesteps", "target", "loss_weights"):
        assert torch.equal(batches[0][key], batches[1][key]), key


def test_the_config_refuses_the_other_denoisers_fields():
    from colo.apps.train.config import RunConfig

    def section(**fields):
        return RunConfig(data={"task": "diffusion"}, diffusion=fields).diffusion

    with pytest.raises(ValueError, match="diffusion.unet_channels=.* does not apply to diffusion.denoiser='dit'"):
        section(denoiser="dit", unet_channels=[16, 32])
    with pytest.raises(ValueError, match="diffusion.dit_layers=8 does not apply to diffusion.denoiser='unet'"):
        section(dit_layers=8)
    with pytest.raises(ValueError, match=r"diffusion.dit_config names \['depth'\], which are not DiTConfig fields"):
        section(denoiser="dit", dit_config={"depth": 28})
    with pytest.raises(ValueError, match="diffusion.dit_\\* sizes: DiTConfig.patch_size=3 must divide sample_size"):
        section(denoiser="dit", dit_patch_size=3)
    with pytest.raises(ValueError, match="has no LoRA path yet"):
        RunConfig(data={"task": "diffusion"}, diffusion={"denoiser": "dit"}, lora={"enabled": True})
    dit = section(denoiser="dit", text_hidden_size=48).dit_config_object()
    assert (dit.sample_size, dit.in_channels, dit.caption_channels, dit.hidden_size) == (8, 4, 48, 128)


def test_the_pixart_preset_builds_a_pixart_alpha_sized_dit_for_8_gpus():
    """``pixart-dit``: PixArt-alpha XL/2's transformer (28 blocks of 1152, 16 heads, patch 2, adaLN-single) on SD-1.5's
    VAE latents (64 x 64 at 512 px) and CLIP-L captions (768 wide), built on the meta device: ~607M parameters."""
    from colo.apps.diffusion.models import build_dit
    from colo.apps.train import load_config

    config = load_config(preset="pixart-dit")
    section = config.diffusion
    assert (config.plugin.name, config.plugin.stage, config.plugin.precision) == ("zero", 2, "bf16")
    assert config.data.global_batch_size % (8 * config.schedule.num_microbatches) == 0
    assert section.denoiser == "dit" and section.objective == "flow_matching" and section.gradient_checkpointing
    dit = section.dit_config_object()
    assert (dit.num_layers, dit.hidden_size, dit.num_attention_heads, dit.patch_size) == (28, 1152, 16, 2)
    assert (dit.sample_size, dit.caption_channels) == (64, 768)
    with torch.device("meta"):
        model = build_dit(dit)
    count = sum(p.numel() for p in model.parameters())
    assert all(p.device.type == "meta" for p in model.parameters())
    assert 600e6 < count < 615e6, count


def test_the_sd3_medium_sized_preset_builds_a_2b_pixart_style_dit():
    """``sd3-medium-dit``: a PixArt-style DiT (not MMDiT) at SD3-medium's ~2B parameters: 24 blocks of 2304 (36 heads
    of 64), patch 2 on SD3's 16-channel latents at 1024 px (128 x 128: 4096 tokens), CLIP-L's 768-wide captions;
    ZeRO-3 bf16 on 8 GPUs; built on the meta device: ~2.08B parameters."""
    from colo.apps.diffusion.models import build_dit
    from colo.apps.train import load_config

    config = load_config(preset="sd3-medium-dit")
    section = config.diffusion
    assert (config.plugin.name, config.plugin.stage, config.plugin.precision) == ("zero", 3, "bf16")
    assert config.data.global_batch_size % (8 * config.schedule.num_microbatches) == 0
    assert section.objective == "flow_matching" and section.flow_shift == 3.0 and section.gradient_checkpointing
    dit = section.dit_config_object()
    assert (dit.num_layers, dit.hidden_size, dit.num_attention_heads, dit.attention_head_dim) == (24, 2304, 36, 64)
    assert (dit.sample_size, dit.in_channels, dit.output_channels, dit.caption_channels) == (128, 16, 16, 768)
    with torch.device("meta"):
        model = build_dit(dit)
    count = sum(p.numel() for p in model.parameters())
    assert 2.0e9 < count < 2.15e9, count


NUM_STEPS = 5
DIT = {"num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "sample_size": 8, "patch_size": 2}


def _dit_and_builder():
    """The tiny components' frozen side, a flow-matching builder with the caption mask, and colo's seeded DiT."""
    from colo.apps.diffusion import FlowMatchingBatchBuilder, FlowMatchingObjective
    from colo.apps.diffusion.models import build_dit
    from colo.apps.diffusion.testing import SEED
    from colo.apps.models.dit import DiTConfig

    _, tokenizer, text_encoder, vae, _ = components()
    objective = FlowMatchingObjective(loss_weighting="sigma_sqrt", shift=1.0, condition_dropout=0.25)
    builder = FlowMatchingBatchBuilder(
        objective, tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, seed=SEED, caption_mask=True
    )
    config = DiTConfig(**DIT, cross_attention_dim=32, caption_channels=text_encoder.config.hidden_size)
    return builder, build_dit(config, seed=SEED + 3)


def _batch(builder, step: int, rows: slice) -> dict:
    from colo.apps.diffusion.testing import GLOBAL_BATCH, step_images

    images = step_images(step)
    return builder(
        step=step, captions=images["caption"][rows], pixel_values=images["pixel_values"][rows], rows=rows,
        global_rows=GLOBAL_BATCH,
    )  # fmt: skip


def _zero3_run():
    from colo.apps.booster import Booster, Zero
    from colo.apps.diffusion import DenoiserLoss
    from colo.apps.diffusion.testing import GLOBAL_BATCH

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    builder, dit = _dit_and_builder()
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    booster = Booster(Zero(stage=3, chunk_numel=4096))
    model = DenoiserLoss(transformer=dit)
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR), example_batch=_batch(builder, 0, rows))
    losses = [booster.train_step(_batch(builder, step, rows)).loss for step in range(NUM_STEPS)]
    return losses, booster.full_state_dict()


def test_zero3_dit_trains_like_diffusers_pixart_transformer_in_one_process():
    """Flow matching (sigma_sqrt weighting, condition dropout, caption mask), 5 AdamW steps: colo's DiT under ZeRO-3
    dp2 (each rank its half of the batch) equals diffusers' ``PixArtTransformer2DModel`` holding the same initial
    weights, trained in one process by a plain loop on the same batches. Losses rtol 1e-5, parameters rtol 1e-5 /
    atol 1e-4 (the ranks' halves and the averaged gradients round differently; AdamW's normalisation turns rounding of
    near-zero gradients into steps of ~lr). The key biases are left out: their exact gradient is 0 (softmax ignores
    ``q . b_k``, the same for every key), so AdamW steps on rounding noise (see test_dit_parallel.py)."""
    import diffusers

    from colo.apps.diffusion.testing import GLOBAL_BATCH

    builder, dit = _dit_and_builder()
    reference = diffusers.PixArtTransformer2DModel(**dit.config.diffusers_config())
    reference.load_state_dict(dit.state_dict(), strict=True)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    expected_losses = []
    for step in range(NUM_STEPS):
        batch = _batch(builder, step, slice(0, GLOBAL_BATCH))
        pred = reference(
            batch["noisy_latents"], encoder_hidden_states=batch["encoder_hidden_states"], timestep=batch["timesteps"],
            encoder_attention_mask=batch["encoder_attention_mask"], return_dict=False,
        )[0]  # fmt: skip
        per_sample = (pred - batch["target"]).square().mean(dim=(1, 2, 3))
        loss = (per_sample * batch["loss_weights"]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append(loss.item())
    results = run_distributed(_zero3_run, world_size=2, timeout=180)
    expected = {"transformer." + name: value.detach() for name, value in reference.named_parameters()}
    for losses, params in results:
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert set(params) == set(expected)
        for name, value in expected.items():
            if not name.endswith("to_k.bias"):
                torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-4, msg=name)
    moved = expected["transformer.proj_out.weight"]
    assert moved.abs().max() > 0  # PixArt's zero-initialised output layer trained
