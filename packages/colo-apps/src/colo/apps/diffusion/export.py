"""`colo convert CKPT --to diffusers OUT`: a ``StableDiffusionPipeline`` directory from a diffusion checkpoint (any
layout): the EMA weights when the run kept them, the run's VAE and caption tokenizer, no safety checker. A run of
colo's diffusion transformer (``diffusion.denoiser: dit``) exports a ``PixArtAlphaPipeline`` instead: its weights
saved as diffusers' ``PixArtTransformer2DModel`` (the same names and shapes), with DPM-Solver++ on the run's DDPM
schedule or, for flow matching, on the flow sigmas (`colo.apps.diffusion.sampling.flow_dpm_solver`).

A LoRA run (``lora.enabled``) exports its frozen base UNet in the pipeline and the trained adapters (EMA ones when
kept) beside it as ``OUT/pytorch_lora_weights.safetensors``: ``pipeline.load_lora_weights(OUT)`` applies them."""

from __future__ import annotations

import os
import warnings

import torch

from colo.tensor.checkpoint import load_checkpoint, read_index

from .ema import PREFIX as EMA_PREFIX
from .ema import ema_checkpoint

LEGACY_RUN_KEY = "diffusion_run"
"""Where checkpoints of colo's earlier diffusion trainer kept their run metadata (now the trainer's ``run``)."""

SAMPLEABLE = ("epsilon", "v_prediction")
"""Objectives ``StableDiffusionPipeline``'s schedulers can sample (their ``prediction_type``)."""


def export_diffusers(checkpoint: str, out: str, *, use_ema: bool = True, overwrite: bool = False) -> list[str]:
    """Write ``out`` as a ``StableDiffusionPipeline`` (``denoiser: dit``: ``PixArtAlphaPipeline``) directory that
    ``DiffusionPipeline.from_pretrained`` loads.

    Raises:
        ValueError: the checkpoint is not of a ``data.task: diffusion`` run, its objective cannot be sampled by the
            pipeline, or ``out`` exists (without ``overwrite``).
    """
    from ..train.config import RunConfig
    from .lora import add_unet_lora, lora_settings, save_unet_lora, unet_lora_state
    from .models import build_unet
    from .sampling import build_pipeline

    run = diffusion_run(checkpoint)
    config = RunConfig.model_validate(run["config"])
    section = config.diffusion
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise ValueError(f"{out} exists and is not empty; pass --overwrite to replace it")
    if section.denoiser == "dit" and section.num_frames > 1:
        raise ValueError(
            f"diffusion.num_frames={section.num_frames}: no diffusers pipeline samples colo's video DiT (a "
            "PixArtAlphaPipeline makes images); its weights are in the checkpoint under PixArtTransformer2DModel's "
            "names (transformer.*), and the run's sample grids show its clips"
        )
    if section.denoiser == "dit":
        return [_export_pixart(checkpoint, out, run, config, use_ema=use_ema)]
    if section.objective == "flow_matching":
        raise ValueError(
            "diffusion.objective='flow_matching' cannot be sampled by StableDiffusionPipeline (the UNet's pipeline: "
            "its schedulers are DDPM ones); export the UNet weights with --to hf instead, or train "
            "diffusion.denoiser='dit' (exported as a PixArtAlphaPipeline with a flow DPM-Solver)"
        )
    if section.prediction_type not in SAMPLEABLE:  # room for objectives (flow matching) the pipeline cannot run
        raise ValueError(
            f"diffusion.prediction_type={section.prediction_type!r} cannot be sampled by StableDiffusionPipeline "
            f"(its schedulers take {SAMPLEABLE}); export the UNet weights with --to hf instead"
        )
    model_config = section.model_config_object()
    tokenizer, text_encoder, vae = frozen_side(run, config)
    # the architecture (of diffusion.unet_from, or the sizes); every weight comes from the checkpoint
    unet = build_unet(model_config, seed=0) if section.unet_from is None else _unet_like(section.unet_from)
    lora = config.lora.enabled
    if lora:  # the names of a LoRA run's tensors: X.base_layer.weight, X.lora_A.default.weight, ...
        add_unet_lora(unet, **lora_settings(config.lora))
    state = {name: torch.empty_like(value) for name, value in unet.state_dict().items()}
    load_checkpoint(checkpoint, {"unet." + name: value for name, value in state.items()}, strict=False)
    ema_path = ema_checkpoint(checkpoint)
    # the averaged trainable weights (a LoRA run's: the adapters)
    if use_ema and os.path.isfile(os.path.join(ema_path, "index.json")):
        averaged = set(read_index(ema_path).tensors)
        prefix = EMA_PREFIX + "unet."
        targets = {prefix + name: value for name, value in state.items() if prefix + name in averaged}
        load_checkpoint(ema_path, targets, strict=False)
    elif use_ema and section.ema_decay is not None:
        warnings.warn(
            f"the run of {checkpoint} kept an EMA but {ema_path} is missing (copy it along with the checkpoint): "
            "exporting the trained weights instead",
            stacklevel=2,
        )
    adapters = None
    if lora:  # the frozen base into the pipeline, the adapters beside it
        adapters = unet_lora_state({"unet." + name: value for name, value in state.items()})
        unet = build_unet(model_config, seed=0) if section.unet_from is None else _unet_like(section.unet_from)
        state = {name.replace(".base_layer.", "."): value for name, value in state.items() if ".lora_" not in name}
    unet.load_state_dict(state)
    pipeline = build_pipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, objective=section.training_objective()
    )
    pipeline.save_pretrained(out)
    if adapters is None:
        return [out]
    return [out, save_unet_lora(out, adapters, **_adapter_config(config.lora))]


def frozen_side(run: dict, config) -> tuple:
    """``(tokenizer, text_encoder, vae)`` of a diffusion run's checkpoint metadata."""
    from transformers import CLIPTokenizer

    from .models import build_text_encoder, build_vae, require_diffusers

    section = config.diffusion
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
    return tokenizer, text_encoder, vae


def _export_pixart(checkpoint: str, out: str, run: dict, config, *, use_ema: bool) -> str:
    """A ``PixArtAlphaPipeline`` directory of a ``denoiser: dit`` run (see the module docstring)."""
    from .sampling import pixart_pipeline, pixart_transformer

    section = config.diffusion
    tokenizer, text_encoder, vae = frozen_side(run, config)
    transformer = pixart_transformer(section.dit_config_object())
    state = {name: torch.empty_like(value) for name, value in transformer.state_dict().items()}
    load_checkpoint(checkpoint, {"transformer." + name: value for name, value in state.items()}, strict=False)
    ema_path = ema_checkpoint(checkpoint)
    if use_ema and os.path.isfile(os.path.join(ema_path, "index.json")):
        prefix = EMA_PREFIX + "transformer."
        load_checkpoint(ema_path, {prefix + name: value for name, value in state.items()}, strict=False)
    elif use_ema and section.ema_decay is not None:
        warnings.warn(
            f"the run of {checkpoint} kept an EMA but {ema_path} is missing (copy it along with the checkpoint): "
            "exporting the trained weights instead",
            stacklevel=3,
        )
    transformer.load_state_dict(state, strict=True)
    pipeline = pixart_pipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        objective=section.training_objective(),
    )
    pipeline.save_pretrained(out)
    return out


def diffusion_run(checkpoint: str) -> dict:
    """The run metadata of a ``data.task: diffusion`` checkpoint (its config, ``vae_dir``, ``tokenizer_dir``); a
    `ValueError` for any other checkpoint."""
    from ..runs import RUN_KEY

    metadata = read_index(checkpoint).metadata
    run = metadata.get(RUN_KEY)
    if not (isinstance(run, dict) and (run.get("config") or {}).get("data", {}).get("task") == "diffusion"):
        run = metadata.get(LEGACY_RUN_KEY)
    if run is None:
        raise ValueError(f"{checkpoint} is not a checkpoint of a data.task=diffusion run; use --to hf or --to peft")
    return run


def _unet_like(directory: str):
    """A `UNet2DConditionModel` with the configuration saved in ``directory`` (weights: initialised, not read)."""
    from .models import require_diffusers

    diffusers = require_diffusers()
    return diffusers.UNet2DConditionModel.from_config(diffusers.UNet2DConditionModel.load_config(directory))


def _adapter_config(section) -> dict:
    from .lora import UNET_ATTENTION_TARGETS

    return {
        "r": section.r,
        "alpha": section.alpha,
        "use_rslora": section.use_rslora,
        "target_modules": section.target_modules or UNET_ATTENTION_TARGETS,
    }
