"""The `ExpertParallel` plugin: a mixture-of-experts model with its experts split over an ``ep`` axis and ZeRO 0-2.

The world is a ``Mesh(dp=world / ep, ep=ep)``: every rank is a data rank with its own samples; the experts of each
`colo.tensor.moe.MoEBlock` are split over ``ep`` (`colo.tensor.moe.shard_experts`, tokens reach them by all-to-all)
and the optimizer is `colo.zero.ExpertParallelZero` (dense gradients averaged over ``dp x ep``, expert gradients over
``dp``). To compose experts with tensor or pipeline parallelism use `HybridParallel` with ``ep`` (the same optimizer
and expert-bias updates; `colo.apps.booster.moe_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colo.comm import Mesh, all_gather_object, init_distributed
from colo.tensor.moe import check_expert_parallel, moe_blocks, shard_experts, update_expert_biases
from colo.zero import ExpertParallelZero, MixedPrecision

from ..plans import find_plan
from ..replicas import broadcast_model_state, model_tensors
from .base import Engine, Plugin
from .driver import OptimizerDriver


@dataclass(kw_only=True)
class ExpertParallel(Plugin):
    """Expert parallelism over ``ep`` with ZeRO over the data ranks (see the module docstring).

    Example::

        booster = Booster(ExpertParallel(ep=2, stage=2, max_grad_norm=1.0))
        model, optimizer, *_ = booster.boost(MoELlama(get_moe_preset("tiny-moe")), torch.optim.AdamW(...))
    """

    ep: int = 2
    """Expert-parallel size: each group of ``ep`` neighbouring ranks splits every MoE block's experts; must divide
    the world size and the number of experts (1: experts replicated, plain data parallelism)."""
    stage: int = 2
    """ZeRO stage 0, 1 or 2 (dense and expert parameters in separate chunks and groups)."""
    chunk_numel: int | None = None
    """Chunk capacity in elements (``None``: searched for the least padding)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ExpertParallel.ep={self.ep!r} must be a positive integer (1: experts replicated)")
        if self.stage not in (0, 1, 2):
            raise ValueError(
                f"ExpertParallel.stage={self.stage!r}: this plugin runs ZeRO stages 0, 1 and 2; choose one of those, "
                "or HybridParallel(ep=..., zero_stage=3) for ZeRO-3 (dense parameters over dp x ep, experts over dp)"
            )

    def mesh_shape(self, world_size: int) -> dict[str, int]:
        if world_size % self.ep:
            raise ValueError(
                f"ExpertParallel.ep={self.ep} does not divide the world size {world_size}: experts are split over a "
                f"sub-axis of the data ranks; choose ep dividing {world_size}"
            )
        return {"dp": world_size // self.ep, "ep": self.ep}

    def data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        return ("dp", "ep")

    def mixed_precision(self) -> MixedPrecision | None:
        return None if self.precision == "fp32" else MixedPrecision(param_dtype=self.compute_dtype)

    def configure(self, model, optimizer, *, criterion=None, param_order=None) -> Engine:
        blocks = moe_blocks(model)
        if not blocks:
            raise ValueError(
                f"ExpertParallel: {type(model).__name__} has no colo.tensor.moe.MoEBlock; use the Zero plugin for a "
                "dense model"
            )
        init_distributed()
        # before any group is built: ep must divide the experts and the data ranks
        world = torch.distributed.get_world_size()
        check_expert_parallel(num_experts=blocks[0][1].config.num_experts, ep=self.ep, data_parallel_size=world)
        mesh = Mesh(**self.mesh_shape(world))
        broadcast_model_state(model_tensors(model), group=mesh.group("dp", "ep"))  # rank 0's values, before sharding
        before = dict(model.named_parameters())
        shard_experts(model, mesh=mesh)
        _swap_optimizer_params(optimizer, before, dict(model.named_parameters()))
        self.maybe_checkpoint_activations(model)
        self.maybe_compile(model)
        plan = find_plan(model)
        zero = ExpertParallelZero(
            model,
            optimizer,
            mesh=mesh,
            stage=self.stage,
            chunk_numel=self.chunk_numel,
            mixed_precision=self.mixed_precision(),
            checkpoint_names=plan.checkpoint_names(model) if plan is not None else None,
        )
        return ExpertParallelEngine(self, model=model, optimizer=zero, mesh=mesh, criterion=criterion)


class ExpertBiases:
    """Mix in before an engine over a model with MoE blocks: after every optimizer step, the aux-loss-free expert
    biases' update from the step's token counts summed over the engine's data group (every rank routing its own
    tokens: ``dp x ep``); the biases (training state outside autograd and the optimizer, the same on every data rank)
    go into the checkpoint metadata as exact fp32 values, each pipeline stage's blocks gathered over ``pp``."""

    uses_expert_bias: bool = False
    """Whether the model's MoE blocks route with an expert bias (set by the engine's constructor)."""

    def step(self) -> tuple[float | None, bool]:
        norm, skipped = super().step()
        if self.uses_expert_bias:
            update_expert_biases(self.model, self.data_group)
        return norm, skipped

    def checkpoint_state(self) -> tuple[dict, dict]:
        tensors, own = super().checkpoint_state()
        if self.uses_expert_bias:
            biases = {name: block.gate.expert_bias.tolist() for name, block in moe_blocks(self.model)}
            if "pp" in self.mesh.axis_names and self.mesh.size("pp") > 1:  # each stage knows its own blocks
                merged = {}
                for stage_biases in all_gather_object(biases, group=self.mesh.group("pp")):
                    merged.update(stage_biases)
                biases = merged
            own[EXPERT_BIAS_KEY] = biases
        return tensors, own

    def load(self, path: str) -> dict:
        metadata = super().load(path)
        saved = metadata.get(EXPERT_BIAS_KEY)
        if self.uses_expert_bias and saved is not None:
            for name, block in moe_blocks(self.model):
                if name not in saved:
                    raise ValueError(f"{path}: the checkpoint has no expert bias for the MoE block {name!r}")
                block.gate.expert_bias.copy_(torch.tensor(saved[name], dtype=torch.float32))
        return metadata


def uses_expert_bias(model: torch.nn.Module) -> bool:
    """Whether any MoE block of ``model`` routes with the aux-loss-free expert bias."""
    return any(block.config.expert_bias for _, block in moe_blocks(model))


class ExpertParallelEngine(ExpertBiases, OptimizerDriver, Engine):
    """Runs steps for `ExpertParallel`: the Booster's microbatch loop over `ExpertParallelZero`, then the
    aux-loss-free expert biases' update (`ExpertBiases`)."""

    def __init__(self, plugin: ExpertParallel, *, model, optimizer: ExpertParallelZero, mesh, criterion) -> None:
        # stage 1 accumulates in full buffers and reduces in the last microbatch's backward; 0 and 2 every microbatch
        super().__init__(
            plugin,
            model=model,
            optimizer=optimizer,
            mesh=mesh,
            criterion=criterion,
            sync_every_microbatch=optimizer.reduces_every_microbatch,
        )
        self.uses_expert_bias = uses_expert_bias(model)


EXPERT_BIAS_KEY = "expert_bias"
"""Checkpoint metadata key: MoE block name -> its router's expert bias (a list of fp32 values)."""


def _swap_optimizer_params(optimizer: torch.optim.Optimizer, before: dict, after: dict) -> None:
    """Point ``optimizer``'s param groups at the parameters `shard_experts` put in place of the whole expert
    tensors (the optimizer was built over the model as the user made it)."""
    replaced = {id(before[name]): after[name] for name in before if after.get(name) is not before[name]}
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
