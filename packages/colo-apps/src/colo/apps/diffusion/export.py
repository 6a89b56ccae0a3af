"""`colo convert CKPT --to diffusers OUT`: a ``StableDiffusionPipeline`` directory from a diffusion checkpoint (any
layout): the EMA weights when the run kept them, the run's VAE and caption tokenizer, no safety checker."""

from __future__ import annotations

import os

import torch

from colo.tensor.checkpoint import load_checkpoint, read_index

from .ema import PREFIX as EMA_PREFIX

SAMPLEABLE = ("epsilon", "v_prediction")
"""Objectives ``StableDiffusionPipeline``'s schedulers can sample (their ``prediction_type``)."""


def export_diffusers(checkpoint: str, out: str, *, use_ema: bool = True, overwrite: bool = False) -> list[str]:
    """Write ``out`` as a ``StableDiffusionPipeline`` directory that ``DiffusionPipeline.from_pretrained`` loads.

    Raises:
        ValueError: the checkpoint is not of a ``data.task: diffusion`` run, its objective cannot be sampled by the
            pipeline, or ``out`` exists (without ``overwrite``).
    """
    from transformers import CLIPTokenizer

    from ..train.config import RunConfig
    from .models import build_text_encoder, build_unet, build_vae, require_diffusers
    from .sampling import build_pipeline
    from .trainer import EMA_DIR, RUN_KEY

    run = read_index(checkpoint).metadata.get(RUN_KEY)
    if run is None:
        raise ValueError(f"{checkpoint} is not a checkpoint of a data.task=diffusion run; use --to hf or --to peft")
    config = RunConfig.model_validate(run["config"])
    section = config.diffusion
    if section.prediction_type not in SAMPLEABLE:  # room for objectives (flow matching) the pipeline cannot run
        raise ValueError(
            f"diffusion.prediction_type={section.prediction_type!r} cannot be sampled by StableDiffusionPipeline "
            f"(its schedulers take {SAMPLEABLE}); export the UNet weights with --to hf instead"
        )
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise ValueError(f"{out} exists and is not empty; pass --overwrite to replace it")
    model_config = section.model_config_object()
    tokenizer = CLIPTokenizer.from_pretrained(run["tokenizer_dir"])
    text_encoder = build_text_encoder(
        model_config, tokenizer, seed=config.seed + 1, pretrained=section.text_encoder_from
    )
    vae_dir = section.vae_from or run["vae_dir"]
    if os.path.isdir(vae_dir):
        vae = require_diffusers().AutoencoderKL.from_pretrained(vae_dir)
    else:
        vae = build_vae(model_config, seed=config.seed + 2)
    unet = build_unet(model_config, seed=0)
    ema_path = os.path.join(checkpoint, EMA_DIR)
    if use_ema and os.path.isdir(ema_path):
        source, prefix = ema_path, EMA_PREFIX + "unet."
    else:
        source, prefix = checkpoint, "unet."
    targets = {prefix + name: torch.empty_like(p) for name, p in unet.state_dict().items()}
    load_checkpoint(source, targets, strict=False)
    unet.load_state_dict({name.removeprefix(prefix): value for name, value in targets.items()})
    pipeline = build_pipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, objective=section.objective()
    )
    pipeline.save_pretrained(out)
    return [out]
