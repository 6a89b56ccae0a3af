"""colo.apps.diffusion: text-to-image denoiser training under colo's plugins (diffusers in the ``diffusion`` extra).

Only the denoiser (a diffusers ``UNet2DConditionModel``, or colo's diffusion transformer
`colo.apps.models.dit.DiffusionTransformer` with ``diffusion.denoiser: dit``, inside `DenoiserLoss`) is boosted; the
frozen CLIP text encoder and ``AutoencoderKL`` run beside it on every rank (`DiffusionBatchBuilder`), or the VAE
encodes the images once into a `LatentCache`; `add_unet_lora` trains peft LoRA adapters on the UNet's attention
instead of the UNet.
`FlowMatchingObjective` / `FlowMatchingBatchBuilder` / `euler_flow_sample` are SD3's flow-matching objective and
Euler sampler (``diffusion.objective: flow_matching``).
``data.task: diffusion`` runs on the one training loop (`colo.apps.train.Trainer`) as
`colo.apps.diffusion.task.DiffusionTask` (imported when a run builds it). diffusers is imported lazily:
``import colo.apps.diffusion`` works without it, building a model needs it.
"""

from .data import COLORS, SHAPES, ImageCaptionFolder, ShapesDataset, caption_vocabulary, collate
from .ema import ShardedEMA
from .flow_matching import FlowMatchingBatchBuilder, FlowMatchingObjective, euler_flow_sample, flow_matching_inputs
from .latent_cache import LatentCache, build_latent_cache, load_latent_cache
from .lora import UNET_ATTENTION_TARGETS, add_unet_lora, save_unet_lora, unet_lora_state
from .models import (
    DiffusionModelConfig,
    build_text_encoder,
    build_unet,
    build_vae,
    save_caption_tokenizer,
    tokenize_captions,
)
from .objective import DenoiserLoss, DiffusionBatchBuilder, DiffusionObjective, step_generator

__all__ = [
    "COLORS",
    "SHAPES",
    "UNET_ATTENTION_TARGETS",
    "DenoiserLoss",
    "DiffusionBatchBuilder",
    "DiffusionModelConfig",
    "DiffusionObjective",
    "FlowMatchingBatchBuilder",
    "FlowMatchingObjective",
    "ImageCaptionFolder",
    "LatentCache",
    "ShapesDataset",
    "ShardedEMA",
    "add_unet_lora",
    "build_latent_cache",
    "build_text_encoder",
    "build_unet",
    "build_vae",
    "caption_vocabulary",
    "collate",
    "euler_flow_sample",
    "flow_matching_inputs",
    "load_latent_cache",
    "save_caption_tokenizer",
    "save_unet_lora",
    "step_generator",
    "tokenize_captions",
    "unet_lora_state",
]
