"""colo's native diffusion transformer (PixArt-alpha / DiT style): config and presets, the model (architecture
only, weights named as diffusers' ``PixArtTransformer2DModel``'s), and its initialization."""

from .config import PRESETS, DiTConfig, get_preset
from .model import DiffusionTransformer, caption_document_mask, sincos_positions, timestep_features

__all__ = [
    "PRESETS",
    "DiTConfig",
    "DiffusionTransformer",
    "caption_document_mask",
    "get_preset",
    "sincos_positions",
    "timestep_features",
]
