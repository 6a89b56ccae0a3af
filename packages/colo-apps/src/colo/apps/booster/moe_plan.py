"""`HybridParallel`'s plan for `MoELlama`: the Llama plan with the mixture-of-experts blocks composed in.

- Tensor parallelism (1D ``tp``) splits the attention and the dense MLPs (a dense first layer) as for Llama; an MoE
  block's input is replicated over tp, so its router, shared experts and experts stay whole on every tp rank, which
  route and compute the same tokens (the experts are split over ``ep`` only, `HybridParallel.ep`), or, with
  ``expert_tensor_parallel``, each expert's FFN split over tp too (`colo.tensor.moe.split_expert_ffns`).
- A pipeline cuts the layers as for Llama; each stage's output carries its MoE blocks' aux losses into backward
  (`colo.tensor.moe.attach_aux_loss`, weighted ``1 / num_microbatches`` like the microbatch's loss, times the loss
  scale under fp16: `set_aux_loss_scale`), so the stage that computes the loss needs nothing from the others. The
  reported loss is the next-token loss of the last stage.
- Multi-head latent attention under tp: its heads split, its latents replicated
  (`colo.apps.models.moe_llama.parallelize`).
- Ulysses or ring sequence parallelism with ``ep > 1`` and ``pp=1``: each sp rank routes its piece of every
  sequence (contiguous under Ulysses, ring attention's zigzag chunks under ring: routing is per token, so which
  tokens a rank holds does not matter); the sp ranks are data ranks of the experts' gradient groups
  (`colo.tensor.moe.parallel`), the load-balancing loss counts the whole sequences' assignments
  (`colo.tensor.moe.route_sequence_pieces`), and the aux losses enter each rank's loss unweighted by the shard's
  next-token weight (`MoELlamaPlan.prepare_batch`).
- Refused: other sequence parallelism (Megatron-SP, Ulysses or ring without ``ep`` or with ``pp``), an expert capacity
  with ``sp`` (each rank would drop by its own piece's count), a grid
  ``tp_mode`` with multi-head latent attention, and ``ep`` not dividing the experts.
"""

from __future__ import annotations

import functools

from torch import nn

from colo.comm import Mesh
from colo.tensor.moe import attach_aux_loss, moe_aux_loss

from ..models.moe_llama.model import init_moe_llama_module
from .llama_plan import LlamaPlan, materialize_fn_of, set_materialize_fn
from .parallel_dims import LayoutError, UnsupportedLayout
from .plans import PipelinePart


class MoELlamaPlan(LlamaPlan):
    """`LlamaPlan` for `MoELlama` with ``ep``, ``tp`` and ``pp`` (see the module docstring)."""

    def check(self, model: nn.Module, plugin) -> None:
        config = model.config
        sp, sp_mode, ep = getattr(plugin, "sp", 1), getattr(plugin, "sp_mode", None), getattr(plugin, "ep", 1)
        if (sp > 1 or sp_mode is not None) and not (sp_mode in ("ulysses", "ring") and ep > 1):
            raise UnsupportedLayout(
                f"HybridParallel.sp={sp} (sp_mode={sp_mode!r}): {type(model).__name__} has mixture-of-experts blocks, "
                "which compose with Ulysses or ring sequence parallelism under expert parallelism only (the sp ranks "
                "join the experts' gradient groups); set ep > 1 with sp_mode='ulysses' or 'ring', or sp=1 and "
                "sp_mode=None",
                field="sp",
            )
        if sp > 1 and config.capacity_factor is not None:
            raise UnsupportedLayout(
                f"HybridParallel.sp={sp} with model.capacity_factor={config.capacity_factor}: each sequence-parallel "
                "rank would drop assignments by its own piece's count, not the whole sequences'; use "
                "capacity_factor=None (dropless) with sp",
                field="sp",
            )
        if plugin.tp > 1 and config.latent_attention and plugin.tp_mode != "1d":
            raise UnsupportedLayout(
                f"HybridParallel.tp_mode={plugin.tp_mode!r}: multi-head latent attention (model.kv_lora_rank) has a "
                "1D tensor-parallel plan only; use tp_mode='1d'",
                field="tp_mode",
            )
        width = config.expert_intermediate_size
        if getattr(plugin, "expert_tensor_parallel", False) and width % plugin.tp:
            raise LayoutError(
                f"HybridParallel.tp={plugin.tp} with expert_tensor_parallel=True does not divide the experts' "
                f"intermediate size {width} (model.moe_intermediate_size); choose tp dividing it, or "
                "expert_tensor_parallel=False",
                field="tp",
            )
        ep = getattr(plugin, "ep", 1)
        experts = config.num_local_experts
        if experts % ep:
            choices = [d for d in range(1, experts + 1) if experts % d == 0]
            raise LayoutError(
                f"HybridParallel.ep={ep} does not divide num_local_experts={experts}: each ep rank holds "
                f"num_experts / ep experts; choose ep in {choices}",
                field="ep",
            )
        super().check(model, plugin)

    def prepare_batch(self, batch, *, mesh: Mesh, plugin):
        """`LlamaPlan.prepare_batch`; under sequence parallelism the aux losses are scaled by the inverse of the
        shard's weight (``aux_loss_scale``), so the weighted loss is ``weight * next-token loss + aux loss``: the
        mean over the sp ranks of the aux losses is the whole sequences' (`colo.tensor.moe.load_balancing_loss`)."""
        local, weight = super().prepare_batch(batch, mesh=mesh, plugin=plugin)
        if getattr(plugin, "sp", 1) > 1 and weight and local is not batch:
            local = {**local, "aux_loss_scale": 1.0 / weight}
        return local, weight

    def apply(self, model: nn.Module, *, mesh: Mesh, plugin) -> nn.Module:
        self._materialize_as_moe(model, plugin)
        return super().apply(model, mesh=mesh, plugin=plugin)

    def pipeline(self, model: nn.Module, *, mesh: Mesh, plugin, stage_ids: list[int]) -> PipelinePart:
        self._materialize_as_moe(model, plugin)
        part = super().pipeline(model, mesh=mesh, plugin=plugin, stage_ids=stage_ids)
        hook = functools.partial(_carry_aux_losses, scale=1.0 / plugin.num_microbatches)
        for chunk in part.chunks:
            chunk.register_forward_hook(hook)
        return part

    @staticmethod
    def _materialize_as_moe(model: nn.Module, plugin) -> None:
        """A meta-device model materializes with `init_moe_llama_module` (Llama's initializer skips the router and
        the experts), seeded by the plugin, unless the caller gave an initializer."""
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and materialize_fn_of(model) is None:
            init = functools.partial(init_moe_llama_module, config=model.config, seed=plugin.seed)
            set_materialize_fn(model, init)


_AUX_LOSS_SCALE = "_colo_aux_loss_scale"


def set_aux_loss_scale(stage: nn.Module, scale: float) -> None:
    """Multiply the gradient a pipeline stage's aux losses enter backward with by ``scale`` from its next forward
    on: the loss scaler's scale under fp16, as the schedule's backward starts from it
    (`colo.pipeline.PipelineExecutor.loss_scale`)."""
    stage.__dict__[_AUX_LOSS_SCALE] = float(scale)


def _carry_aux_losses(stage: nn.Module, args, output, *, scale: float):
    """Forward hook of a pipeline stage: its output carries the stage's MoE blocks' aux losses into backward, with
    the microbatch's weight ``scale`` times the loss scale (`set_aux_loss_scale`)."""
    aux = moe_aux_loss(stage)
    scale = scale * stage.__dict__.get(_AUX_LOSS_SCALE, 1.0)
    if isinstance(output, dict):
        return {**output, "x": attach_aux_loss(output["x"], aux, scale)}
    return attach_aux_loss(output, aux, scale)
