"""colo.apps.diffusion: text-to-image denoiser training under colo's plugins (diffusers in the ``diffusion`` extra).

Only the denoiser (a diffusers ``UNet2DConditionModel`` inside `DenoiserLoss`) is boosted; the frozen CLIP text
encoder and ``AutoencoderKL`` run beside it on every rank (`DiffusionBatchBuilder`). diffusers is imported lazily:
``import colo.apps.diffusion`` works without it, building a model needs it.
"""

from .data import COLORS, SHAPES, ImageCaptionFolder, ShapesDataset, caption_vocabulary, collate
from .ema import ShardedEMA
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
    "DenoiserLoss",
    "DiffusionBatchBuilder",
    "DiffusionModelConfig",
    "DiffusionObjective",
    "ImageCaptionFolder",
    "ShapesDataset",
    "ShardedEMA",
    "build_text_encoder",
    "build_unet",
    "build_vae",
    "caption_vocabulary",
    "collate",
    "save_caption_tokenizer",
    "step_generator",
    "tokenize_captions",
]
