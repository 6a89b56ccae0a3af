"""The registry entry of ``data.task: diffusion`` (registered by `colo.apps.recipes`): its section and rules; the
task class (`colo.apps.diffusion.task.DiffusionTask`) is imported only when a run builds it."""

from __future__ import annotations

from ..train.task import TaskRule, TaskSpec
from .config import DiffusionSection


def _hybrid_dit_refusal(config) -> str | None:
    """Why ``plugin.name: hybrid`` cannot train this run's denoiser, or ``None``."""
    plugin = config.plugin
    if plugin.name != "hybrid":
        return None
    if config.diffusion.denoiser != "dit":
        return (
            "data.task='diffusion' under plugin.name='hybrid' trains the diffusion transformer only (the UNet has no "
            "tensor or sequence layout): set diffusion.denoiser='dit', or train the UNet under plugin.name 'ddp', "
            "'zero' or 'gemini'"
        )
    refused = []
    if plugin.pp > 1:
        refused.append(f"pp={plugin.pp} (no pipeline stages)")
    if plugin.ep > 1:
        refused.append(f"ep={plugin.ep} (no experts)")
    if plugin.sp_mode in ("megatron", "ring"):
        refused.append(f"sp_mode={plugin.sp_mode!r} (the tokens split with Ulysses only)")
    if plugin.tp_mode != "1d":
        refused.append(f"tp_mode={plugin.tp_mode!r} (a 1D plan)")
    if not refused:
        return None
    return (
        "data.task='diffusion' with diffusion.denoiser='dit' under plugin.name='hybrid' runs tp (1D), sp "
        f"(sp_mode='ulysses') and ZeRO 0-3 over dp; not {', '.join(refused)}: set pp=1, ep=1, sp_mode='ulysses' or "
        "null, tp_mode='1d'"
    )


_RULES = (
    TaskRule(
        "plugin.name",
        lambda c: c.plugin.name not in ("ddp", "zero", "gemini", "hybrid"),
        lambda c: (
            f"data.task='diffusion' trains under plugin.name 'ddp', 'zero' (stage 0-3), 'gemini' or, the diffusion "
            f"transformer, 'hybrid': plugin.name={c.plugin.name!r} has no layout of the denoiser; choose one of those"
        ),
        summary="plugin.name other than ddp, zero, gemini, hybrid (no expert layout of a denoiser)",
    ),
    TaskRule(
        "plugin.name",
        lambda c: c.plugin.name == "hybrid" and c.diffusion.denoiser != "dit",
        lambda c: _hybrid_dit_refusal(c),
        summary="plugin.name='hybrid' with diffusion.denoiser unet (no UNet tp / sp plan)",
    ),
    TaskRule(
        "plugin",
        lambda c: c.plugin.name == "hybrid" and c.diffusion.denoiser == "dit" and _hybrid_dit_refusal(c) is not None,
        lambda c: _hybrid_dit_refusal(c),
        summary="plugin.name='hybrid' with pp > 1, ep > 1, sp_mode megatron / ring or a 2D-3D tp_mode (the DiT)",
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
    summary="a text-to-image UNet or diffusion transformer on captioned images (the diffusion section)",
    load=_diffusion_task,
    section="diffusion",
    section_type=DiffusionSection,
    rules=_RULES,
    trains_llama=False,
    reads_data_files=False,
)
"""The diffusion task's registry entry."""
