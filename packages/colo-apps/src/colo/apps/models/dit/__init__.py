"""colo's native diffusion transformer (PixArt-alpha / DiT style): config and presets, the model (architecture
only, weights named as diffusers' ``PixArtTransformer2DModel``'s), its initialization and its tensor-parallel plan
(`parallelize_dit`)."""

from .config import PRESETS, DiTConfig, get_preset
from .model import DiffusionTransformer, caption_document_mask, sincos_positions, timestep_features
from .parallelize import check_dit_tp_size, dit_tp_plan, parallelize_dit

__all__ = [
    "PRESETS",
    "DiTConfig",
    "DiffusionTransformer",
    "caption_document_mask",
    "check_dit_tp_size",
    "dit_tp_plan",
    "get_preset",
    "parallelize_dit",
    "sincos_positions",
    "timestep_features",
]
