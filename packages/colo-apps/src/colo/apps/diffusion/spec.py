"""The registry entry of ``data.task: diffusion`` (registered by `colo.apps.recipes`): its section and rules; the
task class (`colo.apps.diffusion.task.DiffusionTask`) is imported only when a run builds it."""

from __future__ import annotations

from ..train.task import TaskRule, TaskSpec
from .config import DiffusionSection

_RULES = (
    TaskRule(
        "plugin.name",
        lambda c: c.plugin.name not in ("ddp", "zero", "gemini"),
        lambda c: (
            f"data.task='diffusion' trains the UNet under plugin.name 'ddp', 'zero' (stage 0-3) or 'gemini': "
            f"plugin.name={c.plugin.name!r} has no plan for it (no tensor, pipeline or expert layout of the UNet); "
            "choose one of those"
        ),
        summary="plugin.name other than ddp, zero, gemini (no UNet layout for tp / pp / experts)",
    ),
    TaskRule(
        "model.init_from",
        lambda c: c.model.init_from is not None,
        lambda c: (
            "model.init_from starts a Llama; data.task='diffusion' reads diffusion.unet_from (and vae_from, "
            "text_encoder_from): set model.init_from=null"
        ),
        summary="model.init_from set (the UNet starts from diffusion.unet_from)",
    ),
    TaskRule(
        "lora.enabled",
        lambda c: c.lora.enabled and c.diffusion.denoiser == "dit",
        lambda c: (
            "lora.enabled adapts the UNet's attention; diffusion.denoiser='dit' has no LoRA path yet: set "
            "lora.enabled=false or diffusion.denoiser='unet'"
        ),
        summary="lora.enabled with diffusion.denoiser dit (LoRA adapts the UNet only)",
    ),
)


def _diffusion_task():
    from .task import DiffusionTask

    return DiffusionTask


DIFFUSION_TASK = TaskSpec(
    name="diffusion",
    summary="a text-to-image UNet on captioned images (the diffusion section, colo.apps.diffusion)",
    load=_diffusion_task,
    section="diffusion",
    section_type=DiffusionSection,
    rules=_RULES,
    trains_llama=False,
    reads_data_files=False,
)
"""The diffusion task's registry entry."""
