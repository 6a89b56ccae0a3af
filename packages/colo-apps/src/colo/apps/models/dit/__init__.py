"""colo's native diffusion transformer (PixArt-alpha / DiT style): config and presets, the model (architecture
only, weights named as diffusers' ``PixArtTransformer2DModel``'s), its initialization, its tensor-parallel plan
(`parallelize_dit`) and its Ulysses sequence-parallel plan (`parallelize_dit_sequence`)."""

from .config import PRESETS, DiTConfig, get_preset
from .model import (
    DiffusionTransformer,
    caption_document_mask,
    frame_positions,
    sincos_positions,
    timestep_features,
)
from .parallelize import check_dit_tp_size, dit_tp_plan, parallelize_dit
from .sequence_parallel import check_dit_sp_size, dit_ulysses_plan, parallelize_dit_sequence

__all__ = [
    "PRESETS",
    "DiTConfig",
    "DiffusionTransformer",
    "caption_document_mask",
    "check_dit_sp_size",
    "check_dit_tp_size",
    "dit_tp_plan",
    "dit_ulysses_plan",
    "frame_positions",
    "get_preset",
    "parallelize_dit",
    "parallelize_dit_sequence",
    "sincos_positions",
    "timestep_features",
]
