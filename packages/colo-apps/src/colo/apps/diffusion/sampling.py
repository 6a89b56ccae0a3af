"""Sampling: a diffusers ``StableDiffusionPipeline`` around the run's UNet (a few-step DPM-Solver++), a
``PixArtAlphaPipeline`` around the run's diffusion transformer (DPM-Solver++ on the DDPM schedule, or on the flow
sigmas for flow matching), Euler flow sampling of a flow-matching UNet and of a video DiT, sample grids as PNG, and the
pipeline directories `colo convert --to diffusers` writes."""

from __future__ import annotations

import os

import torch

from .models import require_diffusers


def build_pipeline(*, unet, vae, text_encoder, tokenizer, objective, num_train_timesteps: int = 1000):
    """A ``StableDiffusionPipeline`` (no safety checker) with a DPM-Solver++ scheduler of the training schedule."""
    diffusers = require_diffusers()
    scheduler = diffusers.DPMSolverMultistepScheduler.from_config(objective.scheduler().config)
    return diffusers.StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def flow_dpm_solver(objective):
    """The DPM-Solver++ (2nd order) that samples a flow-matching denoiser in a pipeline built for DPM-Solver
    (``PixArtAlphaPipeline``), as diffusers' Sana pipelines do: ``prediction_type="flow_prediction"`` (``x_0 = x_t -
    sigma * v``), ``use_flow_sigmas`` with the objective's static shift, timesteps ``sigma * num_train_timesteps`` (the
    conditioning the denoiser was trained on). Its first-order step is exactly the Euler flow step.

    diffusers' ``FlowMatchEulerDiscreteScheduler`` does not fit that pipeline: it has no ``init_noise_sigma`` or
    ``scale_model_input``, which the pipeline calls.
    """
    if objective.use_dynamic_shifting:
        raise ValueError(
            "a PixArtAlphaPipeline samples with a static flow shift; use_dynamic_shifting (Flux's resolution-dependent "
            "mu) has no DPMSolverMultistepScheduler equivalent"
        )
    diffusers = require_diffusers()
    return diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=objective.num_train_timesteps,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=objective.shift,
    )


def pixart_transformer(config, state: dict | None = None):
    """diffusers' ``PixArtTransformer2DModel`` of the `colo.apps.models.dit.DiTConfig` ``config``, holding ``state``
    (colo's `DiffusionTransformer` state dict, loaded strictly: the names and shapes are the same) when given."""
    diffusers = require_diffusers()
    model = diffusers.PixArtTransformer2DModel(**config.diffusers_config())
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model.eval()


def pixart_pipeline(*, transformer, vae, text_encoder, tokenizer, objective):
    """A ``PixArtAlphaPipeline`` around the run's diffusers transformer, VAE, CLIP text encoder and tokenizer, with
    DPM-Solver++ on the DDPM schedule (`DiffusionObjective`) or on the flow sigmas (`flow_dpm_solver`). Call it
    through `sample_images` (or with `pipeline_call_arguments`): PixArt's defaults assume T5's 120 tokens and its
    trained resolutions."""
    diffusers = require_diffusers()
    if hasattr(objective, "timestep_density"):  # FlowMatchingObjective
        scheduler = flow_dpm_solver(objective)
    else:
        scheduler = diffusers.DPMSolverMultistepScheduler.from_config(objective.scheduler().config)
    return diffusers.PixArtAlphaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )


def pipeline_call_arguments(pipeline) -> dict:
    """Arguments a ``PixArtAlphaPipeline`` over the run's models needs (none for other pipelines): captions padded
    to the tokenizer's length (PixArt's default is T5's 120), no resolution binning (PixArt's bins are its trained
    1024 / 512 / 256 px sizes), no caption cleaning (the captions are the training captions)."""
    if type(pipeline).__name__ not in ("PixArtAlphaPipeline", "PixArtSigmaPipeline"):
        return {}
    return {
        "max_sequence_length": pipeline.tokenizer.model_max_length,
        "use_resolution_binning": False,
        "clean_caption": False,
    }


@torch.no_grad()
def sample_images(
    pipeline, prompts: list[str], *, seeds: list[int], steps: int, guidance_scale: float, size: int
) -> torch.Tensor:
    """``(len(prompts) * len(seeds), 3, size, size)`` images in [0, 1]: every prompt with every seed (row-major)."""
    images = []
    for prompt in prompts:
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        out = pipeline(
            [prompt] * len(seeds),
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=generators,
            height=size,
            width=size,
            output_type="pt",
            **pipeline_call_arguments(pipeline),
        )
        images.append(out.images.float().cpu())
    return torch.cat(images)


@torch.no_grad()
def sample_flow_images(
    *,
    unet,
    vae,
    text_encoder,
    tokenizer,
    objective,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    guidance_scale: float,
    size: int,
) -> torch.Tensor:
    """`sample_images` for a flow-matching denoiser: `euler_flow_sample` through ``unet`` (guided against the empty
    caption), decoded by ``vae``. Each image's noise is drawn from ``Generator().manual_seed(seed)``, as the
    pipeline's per-image generators draw it. Returns ``(len(prompts) * len(seeds), 3, size, size)`` in [0, 1]."""
    from .flow_matching import euler_flow_sample
    from .models import tokenize_captions

    device = next(unet.parameters()).device
    side = size // 2 ** (len(vae.config.block_out_channels) - 1)
    shape = (1, unet.config.in_channels, side, side)
    noise = torch.cat([torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for seed in seeds])

    def encode(captions: list[str]) -> torch.Tensor:
        return text_encoder(tokenize_captions(tokenizer, captions).to(device), return_dict=False)[0].float()

    shift_factor = getattr(vae.config, "shift_factor", None) or 0.0
    images = []
    for prompt in prompts:
        latents = euler_flow_sample(
            lambda x, t, c: unet(x, t, c, return_dict=False)[0],
            noise.to(device),
            objective=objective,
            num_steps=steps,
            condition=encode([prompt] * len(seeds)),
            uncondition=encode([""] * len(seeds)),
            guidance_scale=guidance_scale,
        )
        decoded = vae.decode(latents / vae.config.scaling_factor + shift_factor, return_dict=False)[0]
        images.append((decoded.float() / 2 + 0.5).clamp(0, 1).cpu())
    return torch.cat(images)


@torch.no_grad()
def sample_flow_video(
    *,
    transformer,
    vae,
    text_encoder,
    tokenizer,
    objective,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    guidance_scale: float,
    size: int,
    num_frames: int,
) -> torch.Tensor:
    """Clips of colo's diffusion transformer (`colo.apps.models.dit.DiffusionTransformer`) trained on video latents:
    `euler_flow_sample` of ``(channels, num_frames, side, side)`` latents with the caption mask (guided against the
    empty caption), each frame decoded by the image ``vae``. Each clip's noise is ``Generator().manual_seed(seed)``'s.
    Returns ``(len(prompts) * len(seeds), 3, num_frames, size, size)`` in [0, 1]."""
    from .data import frames_as_images, images_as_frames
    from .flow_matching import euler_flow_sample
    from .models import tokenize_captions

    device = next(transformer.parameters()).device
    side = size // 2 ** (len(vae.config.block_out_channels) - 1)
    shape = (1, transformer.config.in_channels, num_frames, side, side)
    noise = torch.cat([torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for seed in seeds])
    shift_factor = getattr(vae.config, "shift_factor", None) or 0.0
    clips = []
    for prompt in prompts:
        captions = [prompt] * len(seeds) + [""] * len(seeds)
        ids, mask = tokenize_captions(tokenizer, captions, return_mask=True)
        ids, mask = ids.to(device), mask.to(device)
        states = text_encoder(ids, attention_mask=mask, return_dict=False)[0].float()

        def velocity(x, t, rows, states=states, mask=mask):  # rows index the captions: the prompt's, the empty one's
            return transformer(x, states[rows], t, encoder_attention_mask=mask[rows])

        rows = torch.arange(2 * len(seeds), device=device)
        latents = euler_flow_sample(
            velocity,
            noise.to(device),
            objective=objective,
            num_steps=steps,
            condition=rows[: len(seeds)],
            uncondition=rows[len(seeds) :],
            guidance_scale=guidance_scale,
        )
        frames = frames_as_images(latents / vae.config.scaling_factor + shift_factor)
        decoded = vae.decode(frames, return_dict=False)[0]
        clips.append(images_as_frames((decoded.float() / 2 + 0.5).clamp(0, 1).cpu(), num_frames))
    return torch.cat(clips)


def grid_tensor(images: torch.Tensor, *, columns: int) -> torch.Tensor:
    """``images`` ([0, 1], NCHW) tiled ``columns`` wide with 1-pixel white borders, as one CHW tensor."""
    n, _, h, w = images.shape
    rows = -(-n // columns)
    grid = torch.ones(3, rows * (h + 1) + 1, columns * (w + 1) + 1)
    for index, image in enumerate(images):
        r, c = divmod(index, columns)
        grid[:, 1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = image
    return grid


def save_grid(images: torch.Tensor, path: str, *, columns: int, scale: int = 4) -> str:
    """Write ``images`` ([0, 1], NCHW) as one PNG grid, each image upscaled ``scale`` x (nearest)."""
    from PIL import Image

    array = (
        (grid_tensor(images, columns=columns).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).contiguous().numpy()
    )
    picture = Image.fromarray(array).resize((array.shape[1] * scale, array.shape[0] * scale), Image.NEAREST)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    picture.save(path)
    return path
