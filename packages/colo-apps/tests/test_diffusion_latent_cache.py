"""The latent cache (``diffusion.cache_latents``): training from the cached posterior mean / std, with a fresh latent
drawn per step from the same per-step generator, gives the losses of encoding on the fly (same noise seeds); the
cache is reused when its images and VAE are unchanged (resume) and rebuilt when either changed.

Not bit-identical (losses within rtol 1e-6): the VAE's convolutions round differently with the batch they run in
(~1e-7 on the posterior mean: the cache encodes the images in batches of 32, training encodes the step's rows), and
the same draws then move the latents by that much.
"""

from __future__ import annotations

import os

import pytest
import torch

from colo.apps.diffusion.testing import GLOBAL_BATCH, LR, SEED, components, tiny_run_config
from colo.comm.testing import run_distributed

pytest.importorskip("diffusers")

NUM_STEPS = 5
OBJECTIVE = {"prediction_type": "v_prediction", "snr_gamma": 5.0, "noise_offset": 0.05, "condition_dropout": 0.25}


def _losses(cache=None) -> list[float]:
    """5 AdamW steps of the recipe in one process: encoding on the fly (``cache=None``) or from ``cache``."""
    from colo.apps.diffusion import DenoiserLoss, DiffusionBatchBuilder, DiffusionObjective, ShapesDataset, collate

    _, tokenizer, text_encoder, vae, unet = components()
    builder = DiffusionBatchBuilder(
        DiffusionObjective(**OBJECTIVE),
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=None if cache is not None else vae,
        scaling_factor=cache.scaling_factor if cache is not None else None,
        seed=SEED,
    )
    dataset = ShapesDataset(64, image_size=16, seed=0)
    model = DenoiserLoss(unet)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(NUM_STEPS):
        indices = [(GLOBAL_BATCH * step + i) % len(dataset) for i in range(GLOBAL_BATCH)]
        rows = {"step": step, "rows": slice(0, GLOBAL_BATCH), "global_rows": GLOBAL_BATCH}
        if cache is None:
            images = collate([dataset[i] for i in indices])
            batch = builder(captions=images["caption"], pixel_values=images["pixel_values"], **rows)
        else:
            mean, std = cache.rows(indices)
            batch = builder(captions=[dataset.caption(i) for i in indices], latent_mean=mean, latent_std=std, **rows)
        loss = model(**batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_cached_latents_give_the_same_losses_as_on_the_fly_latents(tmp_path):
    from colo.apps.diffusion import ShapesDataset
    from colo.apps.diffusion.latent_cache import build_latent_cache

    vae = components()[3]
    cache = build_latent_cache(str(tmp_path / "latents"), ShapesDataset(64, image_size=16, seed=0), vae)
    assert cache.mean.shape == (64, 4, 8, 8) and cache.scaling_factor == vae.config.scaling_factor
    expected = _losses()
    assert _losses(cache) == pytest.approx(expected, rel=1e-6)
    assert len(set(expected)) == NUM_STEPS  # five different steps, not one repeated


def test_the_cache_is_reused_unchanged_and_rebuilt_for_other_images_or_another_vae(tmp_path):
    from colo.apps.diffusion import ShapesDataset
    from colo.apps.diffusion.latent_cache import build_latent_cache, read_fingerprint

    directory = str(tmp_path / "latents")
    vae, images = components()[3], ShapesDataset(8, image_size=16, seed=0)
    first = build_latent_cache(directory, images, vae)
    (tmp_path / "latents" / "marker").write_text("a rebuilt cache would not hold me")
    again = build_latent_cache(directory, images, vae)  # resume: read, not rebuilt
    assert (tmp_path / "latents" / "marker").exists() and again.fingerprint == first.fingerprint
    assert torch.equal(again.mean, first.mean) and torch.equal(again.std, first.std)

    with pytest.warns(UserWarning, match="built from other images or another VAE .* rebuilding it"):
        other = build_latent_cache(directory, ShapesDataset(8, image_size=16, seed=1), vae)
    assert not (tmp_path / "latents" / "marker").exists() and not torch.equal(other.mean, first.mean)
    with torch.no_grad():
        vae.encoder.conv_in.weight[0, 0, 0, 0] += 1e-3  # another VAE, same architecture
    with pytest.warns(UserWarning, match="rebuilding it"):
        build_latent_cache(directory, ShapesDataset(8, image_size=16, seed=1), vae)
    assert read_fingerprint(directory) not in (first.fingerprint, other.fingerprint)
    assert sorted(os.listdir(tmp_path)) == ["latents"]  # no staging or stale directory left behind


def _train(output_dir, cache_latents):
    from colo.apps.train import Trainer

    trainer = Trainer(tiny_run_config(output_dir, cache_latents=cache_latents))
    result = trainer.fit()
    grid = trainer.task.sample_grid(trainer.ctx, 3)  # loads the VAE for the grid only
    return [result.losses[step] for step in sorted(result.losses)], trainer.task.vae is None, grid


def test_the_trainer_with_cached_latents_matches_on_the_fly_latents(tmp_path):
    on_the_fly = run_distributed(_train, str(tmp_path / "fly"), False, world_size=2, timeout=240)
    cached = run_distributed(_train, str(tmp_path / "cached"), True, world_size=2, timeout=240)
    (expected, kept_no_vae, _), (losses, holds_no_vae, grid) = on_the_fly[0], cached[0]
    assert losses == pytest.approx(expected, rel=1e-6)  # see the module docstring: batch composition of the VAE
    assert not kept_no_vae and holds_no_vae and os.path.exists(grid)
    parts = sorted(os.listdir(tmp_path / "cached" / "latents"))
    assert parts == ["part-00000-of-00002.safetensors", "part-00001-of-00002.safetensors"]  # each rank its share
