"""The parts of a ``data.task: diffusion`` run built from its config: the captioned images, the frozen tokenizer,
text encoder and VAE (the tokenizer and a pre-trained VAE written to ``output_dir`` by rank 0), the UNet before
training, and the checks that the pretrained parts fit together. `colo.apps.diffusion.task.DiffusionTask` trains
with them; the export and the tests build from them too."""

from __future__ import annotations

import os

import torch.distributed as dist

from .data import (
    ImageCaptionFolder,
    MovingShapesDataset,
    ShapesDataset,
    caption_vocabulary,
    video_caption_vocabulary,
)
from .models import build_dit, build_text_encoder, build_unet, build_vae, require_diffusers, save_caption_tokenizer


def build_dataset(section):
    """The run's captioned images: an image folder (``diffusion.image_dir``), the procedural shapes, or with
    ``diffusion.num_frames > 1`` the procedural moving-shape clips."""
    if section.image_dir is not None:
        return ImageCaptionFolder(section.image_dir, resize=section.resize)
    if section.num_frames > 1:
        return MovingShapesDataset(section.num_images, image_size=section.image_size, num_frames=section.num_frames)
    return ShapesDataset(section.num_images, image_size=section.image_size)


def captions_vocabulary(dataset) -> list[str]:
    """The words of the dataset's captions (the caption tokenizer's vocabulary)."""
    if isinstance(dataset, MovingShapesDataset):
        return video_caption_vocabulary()
    if isinstance(dataset, ShapesDataset):
        return caption_vocabulary()
    return sorted({w for _, text in dataset.records for w in text.lower().split()})


def load_vae(config):
    """The run's frozen VAE: ``diffusion.vae_from``, the one pre-trained into ``output_dir/vae``, or the seeded one."""
    section, vae_dir = config.diffusion, os.path.join(config.output_dir, "vae")
    if section.vae_from is not None or os.path.isdir(vae_dir):
        vae = require_diffusers().AutoencoderKL.from_pretrained(section.vae_from or vae_dir)
    else:
        vae = build_vae(section.model_config_object(), seed=config.seed + 2)
    return vae.requires_grad_(False).eval()


def initial_denoiser(config):
    """The denoiser before training: `initial_unet`, or with ``diffusion.denoiser: dit`` colo's diffusion transformer
    built from the dit_* sizes (seeded), its blocks checkpointed when ``diffusion.gradient_checkpointing``."""
    section = config.diffusion
    if section.denoiser == "unet":
        return initial_unet(config)
    model = build_dit(section.dit_config_object(), seed=config.seed + 3)
    if section.gradient_checkpointing:
        from ..checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, mode="full", blocks=["transformer_blocks"])
    return model


def initial_unet(config):
    """The denoiser before training: ``diffusion.unet_from`` or built from the sizes (seeded); without adapters;
    with gradient checkpointing when ``diffusion.gradient_checkpointing`` (active only in training with grads)."""
    section = config.diffusion
    if section.unet_from is not None:
        unet = require_diffusers().UNet2DConditionModel.from_pretrained(section.unet_from)
    else:
        unet = build_unet(section.model_config_object(), seed=config.seed + 3)
    if section.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return unet


def frozen_components(config, dataset, *, rank: int, world_size: int):
    """``(tokenizer, text_encoder, vae)`` of the run whose images are ``dataset``: the tokenizer and a pre-trained
    VAE are written to ``output_dir`` by rank 0 (reused on resume) and read by every rank (a barrier: call it once
    the process group exists, on every rank)."""
    section, out = config.diffusion, config.output_dir
    model_config = section.model_config_object()
    tokenizer_dir, vae_dir = os.path.join(out, "tokenizer"), os.path.join(out, "vae")
    if rank == 0:  # the run's tokenizer lives in output_dir/tokenizer (the export and the grids read it there)
        if section.tokenizer_from is not None:
            from transformers import CLIPTokenizer

            CLIPTokenizer.from_pretrained(section.tokenizer_from).save_pretrained(tokenizer_dir)
        else:
            save_caption_tokenizer(captions_vocabulary(dataset), tokenizer_dir, max_length=section.max_caption_tokens)
        if section.vae_from is None and section.vae_pretrain_steps and not os.path.isdir(vae_dir):
            from .vae_pretrain import pretrain_vae

            vae = build_vae(model_config, seed=config.seed + 2)
            pretrain_vae(vae, dataset, steps=section.vae_pretrain_steps, lr=section.vae_lr, seed=config.seed)
            vae.save_pretrained(vae_dir + ".tmp")
            os.replace(vae_dir + ".tmp", vae_dir)
    if world_size > 1:
        dist.barrier()
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_dir)
    text_encoder = build_text_encoder(
        model_config, tokenizer, seed=config.seed + 1, pretrained=section.text_encoder_from
    )
    check_text_side(tokenizer, text_encoder, section)
    return tokenizer, text_encoder, load_vae(config)


def check_text_side(tokenizer, text_encoder, section) -> None:
    """A pretrained text encoder needs its own tokenizer (vocabulary, maximum length): refuse a mismatch."""
    text = text_encoder.config
    if len(tokenizer) > text.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the text encoder ({section.text_encoder_from or 'built'}) "
            f"embeds {text.vocab_size}; set diffusion.tokenizer_from to the CLIPTokenizer directory the encoder was "
            "trained with (e.g. the tokenizer/ beside a pipeline's text_encoder/)"
        )
    if tokenizer.model_max_length > text.max_position_embeddings:
        raise ValueError(
            f"the tokenizer pads captions to {tokenizer.model_max_length} tokens but the text encoder has "
            f"{text.max_position_embeddings} positions; use the encoder's own tokenizer (diffusion.tokenizer_from)"
        )


def check_cross_attention(unet, text_encoder) -> None:
    """The denoiser (UNet or DiT) attends to the text encoder's hidden states: their widths must agree."""
    width = text_encoder.config.hidden_size
    if hasattr(unet.config, "text_width"):  # colo's DiT
        if width != unet.config.text_width:
            raise ValueError(
                f"the text encoder's hidden_size is {width} but the DiT reads {unet.config.text_width}-wide captions; "
                "set diffusion.text_hidden_size (or diffusion.dit_config.caption_channels) to the encoder's width"
            )
        return
    expected = unet.config.cross_attention_dim
    if width != expected:
        raise ValueError(
            f"the text encoder's hidden_size is {width} but the UNet's cross_attention_dim is {expected}; set "
            "diffusion.text_hidden_size (or diffusion.unet_config.cross_attention_dim) to the encoder's width"
        )
