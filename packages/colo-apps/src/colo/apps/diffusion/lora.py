"""LoRA on the denoiser's attention through ``peft`` (the run config's ``lora`` section with ``data.task: diffusion``).

`add_unet_lora` injects ``peft`` LoRA layers into the UNet's attention projections (``to_q``, ``to_k``, ``to_v``,
``to_out.0`` of every self- and cross-attention block, as diffusers' ``train_text_to_image_lora.py`` does) with
`colo.apps.lora.add_lora`, which freezes the rest, so every plugin trains, reduces and shards only the adapters.
`save_unet_lora` writes them as ``pytorch_lora_weights.safetensors`` through diffusers' own
``StableDiffusionPipeline.save_lora_weights``, with the ``LoraConfig`` (rank, alpha) in the file's metadata, so
``pipeline.load_lora_weights(directory)`` applies them at the trained scale.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

UNET_ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""The UNet modules that get adapters by default: the projections of every attention block."""
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""The file ``load_lora_weights`` looks for in a directory (diffusers' name)."""


def add_unet_lora(
    unet: torch.nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
    target_modules: Sequence[str] | None = None,
) -> torch.nn.Module:
    """Add LoRA adapters to ``unet``'s attention in place and freeze the rest (`colo.apps.lora.add_lora`).

    Args:
        unet: a diffusers ``UNet2DConditionModel``.
        r, alpha, dropout, use_rslora: the adapters' settings (``scaling = alpha / r``).
        target_modules: module-name suffixes to adapt; ``None``: `UNET_ATTENTION_TARGETS`.

    Returns:
        ``unet``, with only the adapters trainable (``B`` is zero: the function is unchanged until trained).
    """
    from ..lora import add_lora

    targets = list(target_modules) if target_modules is not None else list(UNET_ATTENTION_TARGETS)
    return add_lora(unet, r=r, alpha=alpha, dropout=dropout, target_modules=targets, use_rslora=use_rslora)


def lora_settings(section) -> dict:
    """`add_unet_lora`'s keyword arguments from the run config's ``lora`` section."""
    return {
        "r": section.r,
        "alpha": section.alpha,
        "dropout": section.dropout,
        "use_rslora": section.use_rslora,
        "target_modules": section.target_modules,
    }


def unet_lora_state(tensors: Mapping[str, torch.Tensor], *, prefix: str = "unet.") -> dict[str, torch.Tensor]:
    """The UNet adapters of ``tensors`` (``<prefix><module>.lora_A.<adapter>.weight``, one adapter) named as peft's
    ``get_peft_model_state_dict`` names them on the UNet: ``<module>.lora_A.weight``."""
    from ..lora import peft_adapter_state

    unet = {name.removeprefix(prefix): value for name, value in tensors.items() if name.startswith(prefix)}
    return peft_adapter_state(unet, prefix="")


def save_unet_lora(
    directory: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    *,
    r: int,
    alpha: float,
    use_rslora: bool = False,
    target_modules: Sequence[str] | None = None,
) -> str:
    """Write ``state`` (from `unet_lora_state`) as ``directory/pytorch_lora_weights.safetensors``, the file a
    ``StableDiffusionPipeline``'s ``load_lora_weights(directory)`` reads, with the adapters' ``LoraConfig`` fields
    in its metadata (without them diffusers would assume ``alpha = r``). Returns the file's path."""
    from .models import require_diffusers

    if not state:
        raise ValueError("no UNet LoRA adapters to write (no '<module>.lora_A.weight' tensors)")
    targets = list(target_modules) if target_modules is not None else list(UNET_ATTENTION_TARGETS)
    metadata = {"r": r, "lora_alpha": alpha, "use_rslora": use_rslora, "target_modules": targets}
    require_diffusers().StableDiffusionPipeline.save_lora_weights(
        os.fspath(directory),
        unet_lora_layers={name: value.contiguous() for name, value in state.items()},
        unet_lora_adapter_metadata=metadata,
        safe_serialization=True,
    )
    return os.path.join(os.fspath(directory), LORA_WEIGHT_NAME)
