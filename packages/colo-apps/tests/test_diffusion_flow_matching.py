"""Flow matching: the objective and the Euler sampler equal diffusers' on the same tensors; a tiny model learns.

The reference for training is a transcription of ``train_dreambooth_sd3.py``'s step (its ``get_sigmas``, the noisy
input, the velocity target, the weighted loss), calling diffusers' ``compute_density_for_timestep_sampling`` and
``compute_loss_weighting_for_sd3`` with the script's arguments; the draws come from the recipe's per-step generator.
The reference for sampling is a loop of ``FlowMatchEulerDiscreteScheduler.step`` with SD3's classifier-free guidance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colo.apps.diffusion.testing import GLOBAL_BATCH, SEED, components, step_images

pytest.importorskip("diffusers")

SHIFT_FACTOR = 0.1  # SD3's VAE has one (0.0609); the tiny VAE has none, so the builder is given one

# (timestep density scheme, loss weighting scheme, other objective fields). The script passes its one
# --weighting_scheme to both functions: the first five rows are its choices (logit_normal / mode / sigma_sqrt /
# cosmap / none), the last two cross a non-uniform density with a weighting, which only separate fields allow.
CASES = {
    "script_logit_normal": ("logit_normal", "logit_normal", {"logit_mean": 0.3, "logit_std": 0.8}),
    "script_mode": ("mode", "mode", {"mode_scale": 1.29}),
    "script_sigma_sqrt": ("sigma_sqrt", "sigma_sqrt", {}),
    "script_cosmap": ("cosmap", "cosmap", {"shift": 1.0}),
    "script_none": ("none", "none", {"condition_dropout": 0.5}),
    "logit_normal_cosmap": ("logit_normal", "cosmap", {"shift": 1.0, "condition_dropout": 0.25}),
    "mode_sigma_sqrt": ("mode", "sigma_sqrt", {"mode_scale": 0.5}),
}
SAMPLING = {"none": "uniform", "sigma_sqrt": "uniform", "cosmap": "uniform"}  # the script's density fallback
WEIGHTING = {"logit_normal": "none", "mode": "none"}  # the script's weighting fallback


@pytest.fixture(autouse=True)
def one_thread():
    """Run each test on one intra-op thread: the ops are tiny, and two threads on the shared 2-core runner spend most
    of the time waiting for each other (measured at load ~6: the learning test 1.9 s on one thread, 18 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    _, tokenizer, text_encoder, vae, unet = components()
    return tokenizer, text_encoder, vae, unet


def sd3_script_step(models, density_scheme, weighting_scheme, fields, *, step=0):
    """``train_dreambooth_sd3.py``'s step on the recipe's step-``step`` images, draws and tiny UNet."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from colo.apps.diffusion import step_generator, tokenize_captions

    tokenizer, text_encoder, vae, unet = models
    noise_scheduler_copy = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=fields.get("shift", 3.0))

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    batch = step_images(step)
    generator = step_generator(SEED, step)
    model_input = vae.encode(batch["pixel_values"]).latent_dist.sample(generator=generator)
    model_input = (model_input - SHIFT_FACTOR) * vae.config.scaling_factor
    noise = torch.randn(model_input.shape, generator=generator)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(
        weighting_scheme=density_scheme,
        batch_size=bsz,
        logit_mean=fields.get("logit_mean", 0.0),
        logit_std=fields.get("logit_std", 1.0),
        mode_scale=fields.get("mode_scale", 1.29),
        generator=generator,
    )
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    captions = batch["caption"]
    dropout = fields.get("condition_dropout", 0.0)
    if dropout:  # the recipe's condition dropout (the DreamBooth script has none): drawn after the timesteps
        drop = torch.rand(bsz, generator=generator) < dropout
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
    prompt_embeds = text_encoder(tokenize_captions(tokenizer, captions), return_dict=False)[0]
    model_pred = unet(noisy_model_input, timesteps, prompt_embeds, return_dict=False)[0]
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    loss = loss.mean()
    return {
        "noisy_latents": noisy_model_input,
        "timesteps": timesteps,
        "encoder_hidden_states": prompt_embeds,
        "target": target,
        "loss_weights": weighting.flatten(),
        "loss": loss,
    }


def colo_step(models, objective, *, step=0, rows=slice(0, GLOBAL_BATCH)):
    from colo.apps.diffusion import DenoiserLoss
    from colo.apps.diffusion.flow_matching import FlowMatchingBatchBuilder

    tokenizer, text_encoder, vae, unet = models
    builder = FlowMatchingBatchBuilder(
        objective, tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, seed=SEED, shift_factor=SHIFT_FACTOR
    )
    images = step_images(step)
    batch = builder(
        step=step,
        captions=images["caption"][rows],
        pixel_values=images["pixel_values"][rows],
        rows=rows,
        global_rows=GLOBAL_BATCH,
    )
    with torch.no_grad():
        batch["loss"] = DenoiserLoss(unet)(**batch)
    return batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_objective_equals_the_sd3_training_script(models, case):
    from colo.apps.diffusion.flow_matching import FlowMatchingObjective

    density_scheme, weighting_scheme, fields = CASES[case]
    objective = FlowMatchingObjective(
        timestep_sampling=SAMPLING.get(density_scheme, density_scheme),
        loss_weighting=WEIGHTING.get(weighting_scheme, weighting_scheme),
        **fields,
    )
    with torch.no_grad():
        expected = sd3_script_step(models, density_scheme, weighting_scheme, fields)
    got = colo_step(models, objective)
    # The timesteps are looked up at the same index (equal); the noisy inputs and targets are the same fp32 products
    # (equal). The loss is not bit-identical: the script weights every element before the row mean, colo weights
    # the row mean (DenoiserLoss), a different rounding order (~1e-7 relative).
    torch.testing.assert_close(got["timesteps"], expected["timesteps"], rtol=0, atol=0)
    for key in ("noisy_latents", "target", "encoder_hidden_states"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(got["loss_weights"], expected["loss_weights"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=0)
    assert len(set(got["timesteps"].tolist())) > 1  # different timesteps across the batch, not one repeated


def test_each_rank_gets_its_rows_of_the_global_draws(models):
    from colo.apps.diffusion.flow_matching import FlowMatchingObjective

    objective = FlowMatchingObjective(loss_weighting="cosmap", condition_dropout=0.5)
    whole = colo_step(models, objective, step=2)
    halves = [colo_step(models, objective, step=2, rows=slice(i, i + GLOBAL_BATCH // 2)) for i in (0, 2)]
    for key in ("noisy_latents", "timesteps", "target", "loss_weights", "encoder_hidden_states"):
        torch.testing.assert_close(torch.cat([half[key] for half in halves]), whole[key], msg=key)


class ToyVelocity(torch.nn.Module):
    """A small velocity MLP on ``(batch, 2, 1, 1)`` points, conditioned on the timestep and a 4-way one-hot label."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(2 + 1 + 4, hidden),
            torch.nn.SiLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.SiLU(),
            torch.nn.Linear(hidden, 2),
        )

    def forward(self, x, timesteps, condition, return_dict=False):
        h = torch.cat([x.flatten(1), timesteps[:, None].float() / 1000, condition.flatten(1)], dim=1)
        return (self.net(h).view_as(x),)


SAMPLER_CASES = {
    "sd3_shift3": ({"shift": 3.0}, 1.0, None),
    "shift1_guided": ({"shift": 1.0}, 4.0, None),
    "flux_dynamic_guided": ({"use_dynamic_shifting": True}, 3.5, 1024),
}


@pytest.mark.parametrize("case", sorted(SAMPLER_CASES))
def test_euler_sampler_equals_the_diffusers_scheduler_loop(case):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from colo.apps.diffusion.flow_matching import FlowMatchingObjective, euler_flow_sample

    fields, guidance_scale, image_seq_len = SAMPLER_CASES[case]
    objective = FlowMatchingObjective(**fields)
    torch.manual_seed(0)
    model = ToyVelocity().eval()
    num_steps, rows = 8, 6
    noise = torch.randn(rows, 2, 1, 1, generator=torch.Generator().manual_seed(1))
    condition = torch.nn.functional.one_hot(torch.arange(rows) % 4, 4).float().view(rows, 1, 4)
    uncondition = torch.zeros_like(condition)

    # SD3's / Flux's denoising loop around FlowMatchEulerDiscreteScheduler.step
    scheduler = objective.scheduler()
    if objective.use_dynamic_shifting:
        mu = calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    else:
        scheduler.set_timesteps(num_steps)
    latents = noise.clone()
    with torch.no_grad():
        for t in scheduler.timesteps:
            if guidance_scale > 1:
                latent_model_input = torch.cat([latents] * 2)
                timestep = t.expand(latent_model_input.shape[0])
                noise_pred = model(latent_model_input, timestep, torch.cat([uncondition, condition]))[0]
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            else:
                noise_pred = model(latents, t.expand(rows), condition)[0]
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]

    sample = euler_flow_sample(
        lambda x, t, c: model(x, t, c)[0],
        noise,
        objective=objective,
        num_steps=num_steps,
        condition=condition,
        uncondition=uncondition,
        guidance_scale=guidance_scale,
        image_seq_len=image_seq_len,
    )
    # Same sigmas, same fp32 operations in the same order: expected equal; 1e-6 leaves room for a reordered sum.
    torch.testing.assert_close(sample, latents, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(sample, noise, atol=1e-2)


CENTRES = torch.tensor([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])


def toy_batch(objective, scheduler, num_rows, generator, *, dropout=True):
    """Flow-matching inputs of points near one of four centres, labelled by their centre (dropped to zeros)."""
    from colo.apps.diffusion.flow_matching import flow_matching_inputs

    labels = torch.randint(0, 4, (num_rows,), generator=generator)
    points = (CENTRES[labels] + 0.1 * torch.randn(num_rows, 2, generator=generator)).view(num_rows, 2, 1, 1)
    noise = torch.randn(points.shape, generator=generator)
    u = objective.timestep_density(num_rows, generator=generator)
    condition = torch.nn.functional.one_hot(labels, 4).float()
    if dropout:
        condition = condition * (torch.rand(num_rows, generator=generator) >= objective.condition_dropout)[:, None]
    batch = flow_matching_inputs(objective, scheduler, points, noise, u)
    del batch["sigmas"]
    batch["encoder_hidden_states"] = condition.view(num_rows, 1, 4)
    return batch


def test_a_tiny_model_learns_a_conditional_2d_distribution():
    """200 Adam steps of flow matching on four labelled clusters: the held-out loss falls, and Euler samples land on
    the cluster of their label (the untrained model's do not)."""
    from colo.apps.diffusion import DenoiserLoss
    from colo.apps.diffusion.flow_matching import FlowMatchingObjective, euler_flow_sample

    objective = FlowMatchingObjective(timestep_sampling="logit_normal", shift=1.0, condition_dropout=0.2)
    scheduler = objective.scheduler()
    torch.manual_seed(0)
    model = ToyVelocity()
    loss_fn = DenoiserLoss(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    held_out = toy_batch(objective, scheduler, 1024, torch.Generator().manual_seed(1), dropout=False)
    labels = torch.arange(256) % 4
    condition = torch.nn.functional.one_hot(labels, 4).float().view(-1, 1, 4)
    noise = torch.randn(256, 2, 1, 1, generator=torch.Generator().manual_seed(2))

    def evaluate():
        with torch.no_grad():
            loss = loss_fn(**held_out).item()
        sample = euler_flow_sample(
            lambda x, t, c: model(x, t, c)[0], noise, objective=objective, num_steps=20, condition=condition
        ).view(-1, 2)
        on_centre = ((sample - CENTRES[labels]).norm(dim=1) < 0.5).float().mean().item()
        return loss, on_centre

    loss_before, on_centre_before = evaluate()
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        loss = loss_fn(**toy_batch(objective, scheduler, 256, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    loss_after, on_centre_after = evaluate()
    # Measured: held-out loss 4.87 -> 0.31 (the floor is not 0: the velocity of a point is uncertain given x_t),
    # samples within 0.5 of their label's centre 0.4% -> 74% (cluster std 0.1, so ~all within 0.5 at convergence).
    assert loss_after < 0.2 * loss_before, (loss_before, loss_after)
    assert on_centre_before < 0.05 and on_centre_after > 0.5, (on_centre_before, on_centre_after)


def test_bad_settings_name_the_field():
    from colo.apps.diffusion.flow_matching import FlowMatchingObjective, euler_flow_sample, flow_matching_inputs

    with pytest.raises(ValueError, match=r"timestep_sampling='cosmap' is unknown; use one of"):
        FlowMatchingObjective(timestep_sampling="cosmap")
    with pytest.raises(ValueError, match=r"loss_weighting='mode' is unknown; use one of"):
        FlowMatchingObjective(loss_weighting="mode")
    with pytest.raises(ValueError, match=r"condition_dropout=1.0 must be in \[0, 1\)"):
        FlowMatchingObjective(condition_dropout=1.0)
    with pytest.raises(ValueError, match="use_dynamic_shifting needs image_seq_len"):
        euler_flow_sample(
            lambda x, t, c: x,
            torch.zeros(1, 2),
            objective=FlowMatchingObjective(use_dynamic_shifting=True),
            num_steps=2,
        )
    with pytest.raises(ValueError, match="needs both condition and uncondition"):
        euler_flow_sample(
            lambda x, t, c: x, torch.zeros(1, 2), objective=FlowMatchingObjective(), num_steps=2, guidance_scale=2.0
        )
    objective = FlowMatchingObjective()
    scheduler = objective.scheduler()
    scheduler.set_timesteps(4)
    with pytest.raises(ValueError, match="set_timesteps was called on it"):
        flow_matching_inputs(objective, scheduler, torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1))


def test_the_config_refuses_settings_of_the_other_objective():
    from pydantic import ValidationError

    from colo.apps.diffusion.config import DiffusionSection
    from colo.apps.diffusion.flow_matching import FlowMatchingObjective

    section = DiffusionSection(objective="flow_matching", loss_weighting="cosmap", flow_shift=1.0)
    objective = section.training_objective()
    assert isinstance(objective, FlowMatchingObjective)
    assert (objective.loss_weighting, objective.shift, objective.timestep_sampling) == ("cosmap", 1.0, "logit_normal")
    with pytest.raises(ValidationError, match=r"diffusion.snr_gamma=5.0 does not apply to diffusion.objective="):
        DiffusionSection(objective="flow_matching", snr_gamma=5.0)
    with pytest.raises(ValidationError, match=r"diffusion.loss_weighting='cosmap' does not apply to .*'ddpm'"):
        DiffusionSection(loss_weighting="cosmap")


def test_flow_sample_images_are_seeded_images_of_the_run_size(models):
    from colo.apps.diffusion.flow_matching import FlowMatchingObjective
    from colo.apps.diffusion.sampling import sample_flow_images

    tokenizer, text_encoder, vae, unet = models
    settings = dict(
        unet=unet.eval(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        objective=FlowMatchingObjective(),
        steps=2,
        guidance_scale=3.0,
        size=16,
    )
    images = sample_flow_images(prompts=["a red circle on white", "a blue square on black"], seeds=[0, 1], **settings)
    assert images.shape == (4, 3, 16, 16) and 0 <= images.min() and images.max() <= 1
    again = sample_flow_images(prompts=["a blue square on black"], seeds=[1], **settings)
    torch.testing.assert_close(again[0], images[3])  # image (prompt, seed) does not depend on the others
    assert not torch.allclose(images[0], images[1])


def _train_flow_matching(output_dir):
    from colo.apps.diffusion.flow_matching import FlowMatchingBatchBuilder
    from colo.apps.diffusion.testing import tiny_run_config
    from colo.apps.train import Trainer

    config = tiny_run_config(output_dir, objective="flow_matching", prediction_type="epsilon", loss_weighting="cosmap")
    trainer = Trainer(config)
    result = trainer.fit()
    grid = trainer.task.sample_grid(trainer.ctx, 3)
    losses = [result.losses[step] for step in sorted(result.losses)]
    return losses, isinstance(trainer.task.builder, FlowMatchingBatchBuilder), grid, trainer.task.describe(trainer.ctx)


def test_the_trainer_runs_the_flow_matching_objective(tmp_path):
    """``diffusion.objective: flow_matching`` through the one training loop, 2 processes, ZeRO-2: the flow-matching
    batches train 3 steps, the sample grid is drawn with Euler steps, and the diffusers export refuses the run."""
    import math
    import os

    from colo.apps.diffusion.export import export_diffusers
    from colo.comm.testing import run_distributed

    results = run_distributed(_train_flow_matching, str(tmp_path / "run"), world_size=2, timeout=240)
    losses, uses_flow_matching, grid, described = results[0]
    assert uses_flow_matching and len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    assert results[1][0] == losses  # every rank logs the same (averaged) loss
    assert os.path.exists(grid) and results[1][2] is None
    assert "objective: flow matching (logit_normal timesteps, cosmap weighting, shift 3)" in described[1]
    checkpoint = os.path.join(tmp_path, "run", "checkpoints", "step-00000003")
    with pytest.raises(ValueError, match="objective='flow_matching' cannot be sampled by StableDiffusionPipeline"):
        export_diffusers(checkpoint, str(tmp_path / "export"))
