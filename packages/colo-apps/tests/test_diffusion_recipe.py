"""The diffusion recipe in one process equals a plain diffusers training loop (`train_text_to_image.py`'s logic)
written here: same models, scheduler, seeds, data and optimizer, over 5 steps, losses within 1e-5.

Not bit-identical: the recipe averages per-sample MSEs (``mean`` of row means) where the script's plain branch takes
one ``mean`` over every element, a different summation order (~1e-7 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colo.apps.diffusion.testing import GLOBAL_BATCH, LR, SEED, components, step_images

pytest.importorskip("diffusers")

CASES = {
    "epsilon": {"prediction_type": "epsilon"},
    "v_snr_offset_dropout": {
        "prediction_type": "v_prediction",
        "snr_gamma": 5.0,
        "noise_offset": 0.1,
        "condition_dropout": 0.25,
    },
}


def diffusers_reference(objective_fields, num_steps=5):
    """train_text_to_image.py's step, written with diffusers' own calls."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    from colo.apps.diffusion import step_generator

    _, tokenizer, text_encoder, vae, unet = components()
    prediction_type = objective_fields["prediction_type"]
    snr_gamma = objective_fields.get("snr_gamma")
    noise_offset, dropout = objective_fields.get("noise_offset", 0.0), objective_fields.get("condition_dropout", 0.0)
    noise_scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type=prediction_type,
    )
    optimizer = torch.optim.AdamW(unet.parameters(), lr=LR)
    losses = []
    for step in range(num_steps):
        batch = step_images(step)
        generator = step_generator(SEED, step)
        latents = vae.encode(batch["pixel_values"]).latent_dist.sample(generator=generator)
        latents = latents * vae.config.scaling_factor
        noise = torch.randn(latents.shape, generator=generator)
        bsz = latents.shape[0]
        if noise_offset:
            noise += noise_offset * torch.randn((bsz, latents.shape[1], 1, 1), generator=generator)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), generator=generator).long()
        captions = batch["caption"]
        if dropout:
            drop = torch.rand(bsz, generator=generator) < dropout
            captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        input_ids = tokenizer(
            captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True, return_tensors="pt"
        ).input_ids
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
        if prediction_type == "epsilon":
            target = noise
        else:
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        if snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
            if prediction_type == "epsilon":
                mse_loss_weights = mse_loss_weights / snr
            else:
                mse_loss_weights = mse_loss_weights / (snr + 1)
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in unet.named_parameters()}


def recipe_single_process(objective_fields, num_steps=5):
    from colo.apps.diffusion import DenoiserLoss, DiffusionBatchBuilder, DiffusionObjective

    _, tokenizer, text_encoder, vae, unet = components()
    builder = DiffusionBatchBuilder(
        DiffusionObjective(**objective_fields), tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, seed=SEED
    )
    model = DenoiserLoss(unet)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(num_steps):
        batch = step_images(step)
        loss = model(
            **builder(
                step=step,
                captions=batch["caption"],
                pixel_values=batch["pixel_values"],
                rows=slice(0, GLOBAL_BATCH),
                global_rows=GLOBAL_BATCH,
            )
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name.removeprefix("unet."): p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_equals_a_plain_diffusers_training_loop(case):
    expected, expected_params = diffusers_reference(CASES[case])
    losses, params = recipe_single_process(CASES[case])
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert len(set(losses)) == len(losses)  # five different steps, not one repeated
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=name)
