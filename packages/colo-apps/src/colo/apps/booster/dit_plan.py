"""`HybridParallel`'s plan for colo's diffusion transformer (`colo.apps.models.dit.DiffusionTransformer`), alone or
as the ``transformer`` of the diffusion recipe's boosted `DenoiserLoss`: tensor parallelism by `parallelize_dit`
over ``tp`` and Ulysses sequence parallelism over the image (or video) tokens by `parallelize_dit_sequence` over
``sp``, both applied to the transformer in place; no pipeline.

Every sequence-parallel rank gets the same samples (``sp`` is not a sample axis) and computes the whole loss from
the prediction the plan gathers after ``proj_out``; the gradients averaged over the data axes ``("dp", "sp")`` are
then the one-process gradients (`colo.apps.models.dit.sequence_parallel`), so a batch needs no cutting and weighs 1.
Parameter names do not change (tensor-parallel shards keep the ``PixArtTransformer2DModel`` names), so
checkpoints, the EMA and the diffusers export read the same names at every layout.

A `DenoiserLoss` around diffusers' UNet has no tensor or sequence layout: `DiTPlan.check` refuses it, naming the
fix.
"""

from __future__ import annotations

from torch import nn

from colo.comm import Mesh

from ..models.dit import (
    DiffusionTransformer,
    check_dit_sp_size,
    check_dit_tp_size,
    parallelize_dit,
    parallelize_dit_sequence,
)
from .parallel_dims import LayoutError, UnsupportedLayout
from .plans import ModelPlan


def dit_of(model: nn.Module) -> DiffusionTransformer | None:
    """The `DiffusionTransformer` a boosted model is or holds as ``transformer`` (the recipe's `DenoiserLoss`)."""
    if isinstance(model, DiffusionTransformer):
        return model
    inner = getattr(model, "transformer", None)
    return inner if isinstance(inner, DiffusionTransformer) else None


class DiTPlan(ModelPlan):
    """Tensor and Ulysses sequence parallelism of the diffusion transformer (module docstring)."""

    def check(self, model: nn.Module, plugin) -> None:
        dit = dit_of(model)
        if dit is None:
            raise UnsupportedLayout(
                f"HybridParallel has no tensor, sequence or pipeline layout of {type(model).__name__}'s "
                f"{type(getattr(model, 'denoiser', model)).__name__} (the UNet); train it under the ddp, zero or "
                "gemini plugin, or train the diffusion transformer (diffusion.denoiser='dit') under hybrid",
                field="name",
            )
        if plugin.pp > 1:
            raise UnsupportedLayout(
                f"HybridParallel.pp={plugin.pp}: the diffusion transformer has no pipeline stages; use pp=1 (tp, sp "
                "and ZeRO 0-3 over dp)",
                field="pp",
            )
        if plugin.ep > 1:
            raise UnsupportedLayout(
                f"HybridParallel.ep={plugin.ep}: the diffusion transformer has no experts; use ep=1", field="ep"
            )
        if plugin.tp_mode != "1d":
            raise UnsupportedLayout(
                f"HybridParallel.tp_mode={plugin.tp_mode!r}: the diffusion transformer's plan is 1D (Megatron); use "
                "tp_mode='1d'",
                field="tp_mode",
            )
        if plugin.sp_mode in ("megatron", "ring"):
            raise UnsupportedLayout(
                f"HybridParallel.sp_mode={plugin.sp_mode!r}: the diffusion transformer splits its tokens with Ulysses "
                "only; use sp_mode='ulysses' with sp > 1 (or sp_mode=None)",
                field="sp_mode",
            )
        config = dit.config
        if plugin.tp > 1:
            try:
                check_dit_tp_size(config, plugin.tp)
            except ValueError as error:
                raise LayoutError(f"HybridParallel.tp: {error}", field="tp") from None
        if plugin.sp > 1:
            heads = config.num_attention_heads // plugin.tp
            if heads % plugin.sp:
                raise LayoutError(
                    f"HybridParallel.sp={plugin.sp} does not divide the {heads} heads each of the tp={plugin.tp} ranks "
                    f"holds (DiTConfig.num_attention_heads={config.num_attention_heads}; Ulysses gives each rank "
                    "heads / sp of them); choose sp dividing it",
                    field="sp",
                )
            check_dit_sp_size(config, plugin.sp)

    def apply(self, model: nn.Module, *, mesh: Mesh, plugin) -> nn.Module:
        dit = dit_of(model)
        if any(p.is_meta for p in dit.parameters()):
            raise ValueError(
                "DiTPlan: the diffusion transformer is on the meta device; build it with its weights "
                "(colo.apps.diffusion.models.build_dit) before boosting"
            )
        if plugin.tp > 1:
            parallelize_dit(dit, mesh=mesh)
        if plugin.sp > 1:
            parallelize_dit_sequence(dit, mesh=mesh)
        return model
