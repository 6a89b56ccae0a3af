"""The `HybridParallel` plugin: tensor, pipeline and data parallelism (with ZeRO 0-3) over one `Mesh(pp, dp, tp)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from colo.comm import Mesh, all_gather_object, init_distributed, world_group
from colo.pipeline import GENERATORS, PipelineExecutor, make_schedule
from colo.tensor import layout_of
from colo.tensor.moe import moe_blocks, route_sequence_pieces, shard_experts, split_expert_ffns
from colo.tensor.tp_grid import GRID_AXES, TP_MODES, check_tp_size
from colo.zero import ExpertParallelZero, ZeroOptimizer
from colo.zero.state import OPTIM_PREFIX, OPTIMIZER_KEY

from ...lora.tensor_parallel import (
    attach_lora_layers,
    detach_lora_layers,
    materialize_lora_adapters,
    restore_lora_layers,
)
from ..grid_plan import grid_plan_for
from ..moe_plan import set_aux_loss_scale
from ..parallel_dims import LayoutError, ParallelDims, UnsupportedLayout
from ..plans import materialize_device, plan_for
from ..replicas import broadcast_model_state, model_tensors
from .base import Engine, Plugin
from .driver import OptimizerDriver
from .expert import ExpertBiases, uses_expert_bias
from .runner import PipelineCriterion, PipelineRunner
from .zero import ZeroEngine

SP_MODES = (None, "megatron", "ulysses", "ring")
PIPELINE_ZERO_SYNCS = ("step", "microbatch")


@dataclass(kw_only=True)
class HybridParallel(Plugin):
    """Tensor (``tp``), pipeline (``pp``) and data parallelism, composed over ``Mesh(pp=, dp=, tp=)``.

    ``dp`` is what is left of the world size (or given, and checked against it). Data parallelism runs through
    `colo.zero.ZeroOptimizer` at ``zero_stage`` 0 (replicated, fp32 masters), 1, 2 or 3, with gradient clipping
    over every axis (tensor-parallel replicas counted once). ``zero_stage=3`` is FSDP x TP: each rank keeps
    1/(dp*sp) of its tensor-parallel shard of every weight, and stage 3's hooks all-gather a chunk of tp shards over
    the data axes only, before the modules that use it (with prefetch, pooled buffers, saved-tensor hooks and the
    root chunk kept for backward, as `colo.zero.stage3` does without tp). With ``pp > 1`` the batch runs as
    ``num_microbatches`` microbatches through ``schedule`` (`colo.pipeline`), and ZeRO's gradient sync is the
    executor's end-of-backward callback, at every stage: gradients accumulate in full over the step's microbatches
    and each chunk is reduce-scattered once after the last backward (`colo.zero.ZeroConfig.grad_reduction`
    ``"step"``; a zero-bubble schedule's W steps fire no gradient hooks). With ``zero_stage=3`` each stage's chunks
    are gathered once per step, at the first microbatch that uses them, and held until that reduction (FSDP x TP x
    PP, torchtitan's layout with ``reshard_after_forward=False``): during the step a stage holds its full parameters
    and gradients as at ZeRO-1, between steps 1/dp of them. The model needs a plan (`colo.apps.booster.plan_for`:
    colo's native Llama and Hugging Face's Llama have one). Every size is checked against the world size and the
    model before any collective runs.

    With ``ep > 1`` (a mixture-of-experts model: `MoELlama`) the data ranks are ``dp x ep`` (mesh
    ``(pp, dp, ep, tp)``): each stage splits its MoE blocks' experts over its ep group (`colo.tensor.moe.shard_experts`)
    and the optimizer is `colo.zero.ExpertParallelZero` (dense parameters over ``dp x ep``, experts over ``dp``, both
    with the tp and pp axes above); the routers' expert biases are updated after every step from the counts of all
    data ranks (`colo.apps.booster.plugins.expert.ExpertBiases`). With Ulysses or ring ``sp`` (``pp=1``) the
    sequence ranks count as data ranks too (mesh ``(pp, dp, ep, sp, tp)``: dense parameters over ``dp x ep x sp``,
    experts over ``dp x sp``, bias counts summed over all of them) and the load-balancing loss counts its assignments
    over the whole sequences (`colo.tensor.moe.route_sequence_pieces`).
    """

    tp: int = 1
    """Tensor-parallel size (Megatron 1D, or the ranks of the 2D / 2.5D grid or 3D cube with ``tp_mode``)."""
    tp_mode: str = "1d"
    """``"1d"`` (Megatron), ``"2d"`` (SUMMA on a q x q grid, tp = q^2), ``"2.5d"`` (Tesseract, tp = tp_depth q^2;
    `colo.tensor.tp2d`) or ``"3d"`` (a q x q x q cube, tp = q^3; `colo.tensor.tp3d`). The grid modes compose with
    dp and ZeRO 0-2 (no pipeline, sequence parallelism or ZeRO-3) on colo's native Llama."""
    tp_depth: int = 1
    """2.5D's number of stacked q x q grids (``tp_mode="2.5d"`` only)."""
    dp: int | None = None
    """Data-parallel size; ``None``: what is left of the world size after tp, pp and sp (given, it must make
    ``dp * tp * pp * sp`` the world size)."""
    pp: int = 1
    """Pipeline-parallel size (stages of contiguous layers)."""
    sp: int = 1
    """Sequence-parallel size for Ulysses / ring attention (Megatron-SP runs on the tp group instead)."""
    ep: int = 1
    """Expert-parallel size for a mixture-of-experts model: each group of ``ep`` data ranks (of one pipeline stage
    and tp coordinate) splits every MoE block's experts (tokens reach them by all-to-all); it must divide the data
    ranks (``dp`` counts them all: the mesh is ``(pp, dp / ep, ep, tp)``) and the experts. Dense parameters are
    averaged and sharded over ``dp x ep``, experts over ``dp`` (`colo.zero.ExpertParallelZero`). Composes with
    ``pp`` (each stage's blocks use the ep group inside the stage), 1D ``tp`` (attention and dense layers split
    over tp, each ep rank's experts whole on its tp ranks, or split with ``expert_tensor_parallel``) and Ulysses
    or ring ``sp`` without ``pp``; not with Megatron ``sp_mode``. fp16: one loss scaler for dense and expert parts
    over every rank, pipeline stages included (`colo.zero.ExpertParallelZero`)."""
    expert_tensor_parallel: bool = False
    """With ``tp > 1`` and a mixture-of-experts model: split each expert's FFN over the tp group as well (its gate and
    up projections by columns, its down projection by rows; Megatron-Core's expert tensor parallelism,
    `colo.tensor.moe.split_expert_ffns`), instead of keeping the experts whole on every tp rank."""
    sp_mode: str | None = None
    """``None``, ``"megatron"`` (over tp), ``"ulysses"`` or ``"ring"`` (over sp)."""
    zero_stage: int = 1
    """ZeRO stage of the data-parallel part: 0, 1, 2 or 3 (3 shards each tensor-parallel shard's parameters over the
    data axes, FSDP x TP; with ``pp > 1`` every stage reduces gradients once per step, after the last microbatch's
    backward, and stage 3 holds a pipeline stage's gathered chunks for the step)."""
    pipeline_zero_sync: str = "step"
    """With ``pp > 1``: when ZeRO reduces gradients and, at stage 3, frees the gathered chunks. ``"step"``: once per
    step, after the last microbatch's backward; full gradients accumulate over the microbatches and stage 3 holds
    each chunk from its first gather to then (the stage's full parameters and gradients during the step, as at
    ZeRO-1; one all-gather and one reduce-scatter per chunk per step). ``"microbatch"`` (``zero_stage`` 2 or 3):
    every microbatch's backward reduce-scatters its gradients from the gradient hooks and stage 3 frees each chunk
    after its forward and its backward, gathering it again for the next (1/dp of the gradients and parameters plus
    the chunks in use and in flight; ``num_microbatches`` reduce-scatters and, at stage 3, 2 x ``num_microbatches``
    all-gathers per chunk per step). Not with ``zero_bubble_h1`` (its W steps fire no gradient hooks) nor with
    embeddings tied across stages (their gradients are summed after the last backward)."""
    schedule: str = "1f1b"
    """Pipeline schedule: a name of `colo.pipeline.GENERATORS` (``gpipe``, ``1f1b``, ``interleaved_1f1b``,
    ``zero_bubble_h1``)."""
    num_model_chunks: int = 1
    """Model chunks per pipeline rank (2 or more for ``interleaved_1f1b``)."""
    chunk_numel: int | None = None
    """ZeRO chunk capacity in elements (``None``: searched)."""
    seed: int = 0
    """Seed materializing a model built on the meta device (each rank initializes only its shards)."""

    materializes_meta_models: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dims  # noqa: B018 - the degrees' own checks (positive integers)
        for rule in _RULES:
            if rule.applies(self):
                raise rule.error(rule.message(self), field=rule.field)
        if self.pp > 1:  # the schedule's own checks (microbatches vs ranks) run now, before any collective
            self.pipeline_schedule = make_schedule(
                self.schedule, self.pp, self.num_microbatches, num_chunks=self.num_model_chunks
            )

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees (`ParallelDims`): mesh shape, data axes and the checks against the world size."""
        return ParallelDims(tp=self.tp, pp=self.pp, sp=self.sp, dp=self.dp)

    def mesh_shape(self, world_size: int) -> dict[str, int]:
        shape = self.dims.mesh_shape(world_size)
        if self.ep > 1:  # ep is the inner factor of the data ranks: (pp, dp / ep, ep, sp, tp)
            if shape["dp"] % self.ep:
                raise LayoutError(
                    f"HybridParallel.ep={self.ep} does not divide the {shape['dp']} data-parallel ranks (world "
                    f"{world_size} / tp={self.tp} x pp={self.pp} x sp={self.sp}): experts are split over a sub-axis of "
                    f"the data ranks; choose ep dividing {shape['dp']}",
                    field="ep",
                )
            shape = {
                "pp": shape["pp"],
                "dp": shape["dp"] // self.ep,
                "ep": self.ep,
                "sp": shape["sp"],
                "tp": shape["tp"],
            }
        if self.tp_mode != "1d":  # the tp axis becomes the grid's axes, in its place (innermost)
            shape.update(check_tp_size(self.tp_mode, shape.pop("tp"), self.tp_depth))
        return shape

    def tensor_parallel_axes(self) -> tuple[str, ...]:
        """The mesh axes tensor parallelism runs over (``("tp",)``, or the grid's axes)."""
        if self.tp == 1:
            return ()
        return ("tp",) if self.tp_mode == "1d" else GRID_AXES[self.tp_mode]

    def data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        if self.ep > 1:  # Ulysses / ring ranks hold pieces of the same sequences: data ranks for gradients and counts
            return ("dp", "ep", "sp") if self.sp > 1 else ("dp", "ep")
        return self.dims.data_axes()

    def sample_axes(self, mesh: Mesh) -> tuple[str, ...]:
        # sequence-parallel ranks share their samples, each holding a piece of every sequence; ep ranks are data ranks
        return ("dp", "ep") if self.ep > 1 else ("dp",)

    def configure(self, model, optimizer, *, criterion=None, param_order=None) -> Engine:
        if criterion is not None and self.pp > 1 and not isinstance(criterion, PipelineCriterion):
            raise ValueError(
                "HybridParallel with pp > 1 computes the model plan's own loss on the last stage, or a criterion's "
                "that runs under a pipeline (colo.apps.booster.PipelineCriterion: pipeline_split, pipeline_loss, "
                "pipeline_outputs); pass criterion=None or such a criterion"
            )
        if criterion is not None and self.pp > 1 and (self.sp > 1 or self.sp_mode is not None):
            raise UnsupportedLayout(
                f"HybridParallel: a criterion under pp={self.pp} takes whole rows on the last stage; sp={self.sp}, "
                f"sp_mode={self.sp_mode!r} split them; use sp=1 and sp_mode=None with a pipelined criterion",
                field="sp",
            )
        plan = plan_for(model)
        if self.tp_mode != "1d":
            plan = grid_plan_for(plan, self)
        init_distributed()
        self.mesh_shape(torch.distributed.get_world_size())  # the sizes against the world, before the model changes
        original_names: dict[int, list[str]] = {}  # a tied parameter has several names; a pipeline stage uses one
        for name, p in model.named_parameters(remove_duplicate=False):
            original_names.setdefault(id(p), []).append(name)
        lora = detach_lora_layers(model)  # the plan shards the base layers; the adapters follow them
        try:
            plan.check(model, self)
        except Exception:
            restore_lora_layers(lora)
            raise
        aliases = _tied_aliases(original_names)
        if aliases and self.pp > 1 and self.pipeline_zero_sync == "microbatch":  # every rank sees it, before any group
            restore_lora_layers(lora)
            raise UnsupportedLayout(
                "HybridParallel.pipeline_zero_sync='microbatch' does not work with parameters tied across pipeline "
                f"stages ({sorted(aliases)}): their gradients are summed after the last backward, after the "
                "microbatches' reductions; use pipeline_zero_sync='step' or untie them",
                field="pipeline_zero_sync",
            )
        checkpoint_names = _names_with_aliases(plan.checkpoint_names(model), aliases)
        mesh = self.build_mesh()
        # every rank holds the whole model: make it rank 0's before the plan cuts it, so that every shard and stage
        # is a piece of one model; a meta-device model is materialized from the seed instead, the same everywhere
        # (of it only adapters that already hold values are broadcast)
        on_meta = any(p.is_meta for p in model.parameters())
        adapters = [item.layer for item in lora]
        replicated = model_tensors(*adapters) if on_meta else model_tensors(model, *adapters)
        broadcast_model_state(replicated, group=world_group())
        if lora and on_meta:  # adapters added to a meta-device model
            materialize_lora_adapters(lora, device=materialize_device(), seed=self.seed)
        part = None
        if self.pp == 1:
            plan.apply(model, mesh=mesh, plugin=self)
            target = model
        else:
            stage_ids = list(self.pipeline_schedule.stages[mesh.rank("pp")])
            part = plan.pipeline(model, mesh=mesh, plugin=self, stage_ids=stage_ids)
            target = part.chunks[0] if len(part.chunks) == 1 else _StageChunks(part.chunks)
        attach_lora_layers(lora, mesh=mesh, axis="tp")
        if self.ep > 1 and moe_blocks(target):  # each stage splits its own blocks' experts over its ep group
            shard_experts(target, mesh=mesh)
        if self.sp > 1 and moe_blocks(target):  # the balance loss counts the whole sequences' assignments
            route_sequence_pieces(target, mesh=mesh)
        if self.expert_tensor_parallel and moe_blocks(target):  # and each expert's FFN over tp
            split_expert_ffns(target, mesh=mesh, axis="tp")
        for module in [model] if part is None else part.chunks:
            self.maybe_checkpoint_activations(module)
            self.maybe_compile(module)
        optimizer = _repoint_optimizer(optimizer, target, original_names)
        tied_here = [p for name, p in target.named_parameters() if name in aliases] if part is not None else []
        zero_settings = dict(
            mesh=mesh,
            stage=self.zero_stage,
            chunk_numel=self.chunk_numel,
            mixed_precision=_mixed_precision(self),
            tensor_parallel_axes=self.tensor_parallel_axes(),
            pipeline_axis="pp" if self.pp > 1 else None,
            grad_reduction="step" if self.pp > 1 and self.pipeline_zero_sync == "step" else "backward",
            checkpoint_names=checkpoint_names,
            norm_replicas=tied_here,  # another stage's parameter: its gradient is counted there
        )
        if self.ep > 1:  # dense parameters over dp x ep, experts over dp
            zero = ExpertParallelZero(target, optimizer, **zero_settings)
        else:
            zero = ZeroOptimizer(target, optimizer, data_axes=self.data_axes(mesh), **zero_settings)
        bias = uses_expert_bias(model)
        if part is None:
            engine_type = MoEHybridEngine if moe_blocks(model) else HybridEngine
            engine = engine_type(self, plan=plan, model=model, optimizer=zero, mesh=mesh, criterion=criterion)
            engine.uses_expert_bias = bias
            return engine
        gatherers = [p.gatherer for p in getattr(zero, "parts", (zero,)) if p.gatherer is not None]
        if len(part.chunks) > 1:  # the executor calls each model chunk, not the container
            for gatherer in gatherers:
                for chunk in part.chunks:
                    gatherer.add_forward_root(chunk)
        tied_copies = [  # the checkpoint names of this rank's tied copies of another stage's parameters
            saved
            for name, p in target.named_parameters()
            if name in aliases
            for saved, _, _ in checkpoint_names(name, p)
        ]
        engine_type = MoEPipelineEngine if moe_blocks(model) else PipelineEngine
        engine = engine_type(
            self,
            plan=plan,
            part=part,
            optimizer=zero,
            mesh=mesh,
            model=target,
            tied_copies=tied_copies,
            criterion=criterion,
        )
        engine.uses_expert_bias = bias
        return engine


def _grid_error(plugin: HybridParallel) -> str | None:
    """Why ``tp`` / ``tp_depth`` do not make ``tp_mode``'s grid (the valid sizes listed), or ``None``."""
    try:
        check_tp_size(plugin.tp_mode, plugin.tp, plugin.tp_depth)
    except ValueError as error:
        return str(error)
    return None


class LayoutRule(NamedTuple):
    """One row of HybridParallel's support matrix: when ``applies``, raise ``error(message)`` naming ``field``."""

    field: str
    error: type[LayoutError]
    applies: Callable[[HybridParallel], bool]
    message: Callable[[HybridParallel], str]
    summary: str | None = None
    """For a layout that is refused (not a malformed value): what is refused, in a few words (`unsupported_table`)."""


def unsupported_table() -> str:
    """The layouts HybridParallel refuses, as a Markdown table (the colo-apps README holds it; ``colo config
    --rules`` prints it)."""
    rows = ["| field | refused |", "|---|---|"]
    rows += [f"| `plugin.{rule.field}` | {rule.summary} |" for rule in _RULES if rule.summary is not None]
    return "\n".join(rows)


def _not_positive(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


_RULES: tuple[LayoutRule, ...] = (
    # checked in this order
    LayoutRule(
        "num_model_chunks",
        LayoutError,
        lambda p: _not_positive(p.num_model_chunks),
        lambda p: f"HybridParallel.num_model_chunks={p.num_model_chunks!r} must be a positive integer",
    ),
    LayoutRule(
        "sp_mode",
        LayoutError,
        lambda p: p.sp_mode not in SP_MODES,
        lambda p: f"HybridParallel.sp_mode={p.sp_mode!r} is unknown; use one of {SP_MODES}",
    ),
    LayoutRule(
        "sp_mode",
        LayoutError,
        lambda p: p.sp_mode == "megatron" and (p.tp == 1 or p.sp != 1),
        lambda p: (
            "HybridParallel.sp_mode='megatron' shards the sequence over the tp group: it needs tp > 1 and sp=1 "
            f"(got tp={p.tp}, sp={p.sp})"
        ),
    ),
    LayoutRule(
        "sp_mode",
        LayoutError,
        lambda p: p.sp > 1 and p.sp_mode not in ("ulysses", "ring"),
        lambda p: f"HybridParallel.sp={p.sp} needs sp_mode='ulysses' or 'ring' (got {p.sp_mode!r})",
    ),
    LayoutRule(
        "sp",
        LayoutError,
        lambda p: p.sp_mode in ("ulysses", "ring") and p.sp == 1,
        lambda p: f"HybridParallel.sp_mode={p.sp_mode!r} needs sp > 1; set sp to the sequence-parallel degree",
    ),
    LayoutRule(
        "loss_weighting",
        UnsupportedLayout,
        lambda p: p.loss_weighting == "token" and p.pp > 1,
        lambda p: (
            "HybridParallel: loss_weighting='token' with pp > 1 is not supported yet (the pipeline averages its "
            "microbatch losses itself); use loss_weighting='microbatch'"
        ),
        summary="`loss_weighting: token` with `pp` > 1",
    ),
    LayoutRule(
        "ep",
        LayoutError,
        lambda p: _not_positive(p.ep),
        lambda p: f"HybridParallel.ep={p.ep!r} must be a positive integer (1: experts replicated)",
    ),
    LayoutRule(
        "ep",
        UnsupportedLayout,
        lambda p: not _not_positive(p.ep) and p.ep > 1 and (p.sp_mode == "megatron" or (p.sp > 1 and p.pp > 1)),
        lambda p: (
            f"HybridParallel.ep={p.ep} with sp={p.sp}, sp_mode={p.sp_mode!r}, pp={p.pp} is not supported: experts "
            "compose with Ulysses or ring sequence parallelism without a pipeline only (Megatron-SP's tp pieces and "
            "a pipeline's stages under sp are not wired to the experts' gradient groups and balance loss); use "
            "sp_mode='ulysses' or 'ring' with pp=1, or sp=1 and sp_mode=None"
        ),
        summary="`ep` > 1 with `sp_mode` megatron, or with `sp` > 1 and `pp` > 1",
    ),
    LayoutRule(
        "ep",
        UnsupportedLayout,
        lambda p: not _not_positive(p.ep) and p.ep > 1 and p.tp_mode != "1d",
        lambda p: (
            f"HybridParallel.ep={p.ep} with tp_mode={p.tp_mode!r} is not supported (the MoE plan runs 1D tensor "
            "parallelism only); use tp_mode='1d' with ep"
        ),
        summary="`ep` > 1 with a 2D / 2.5D / 3D `tp_mode`",
    ),
    LayoutRule(
        "expert_tensor_parallel",
        LayoutError,
        lambda p: p.expert_tensor_parallel and p.tp == 1,
        lambda p: (
            "HybridParallel.expert_tensor_parallel=True splits each expert's FFN over the tp group, and tp=1; set tp "
            "> 1 or leave expert_tensor_parallel=False"
        ),
    ),
    LayoutRule(
        "tp_mode",
        LayoutError,
        lambda p: p.tp_mode not in TP_MODES,
        lambda p: f"HybridParallel.tp_mode={p.tp_mode!r} is unknown; use one of {TP_MODES}",
    ),
    LayoutRule(
        "tp",
        LayoutError,
        lambda p: p.tp_mode in TP_MODES and _grid_error(p) is not None,
        lambda p: f"HybridParallel: {_grid_error(p)}",
    ),
    LayoutRule(
        "tp_mode",
        UnsupportedLayout,
        lambda p: p.tp_mode != "1d" and (p.pp > 1 or p.sp > 1 or p.sp_mode is not None or p.zero_stage == 3),
        lambda p: (
            f"HybridParallel: tp_mode={p.tp_mode!r} composes with dp and zero_stage 0-2 only (got pp={p.pp}, "
            f"sp={p.sp}, sp_mode={p.sp_mode!r}, zero_stage={p.zero_stage}); use pp=1, sp=1, sp_mode=None and "
            "zero_stage <= 2, or tp_mode='1d'"
        ),
        summary="a 2D / 2.5D / 3D `tp_mode` with `pp` > 1, `sp` > 1, an `sp_mode` or `zero_stage` 3",
    ),
    LayoutRule(
        "zero_stage",
        LayoutError,
        lambda p: p.zero_stage not in (0, 1, 2, 3),
        lambda p: f"HybridParallel.zero_stage={p.zero_stage!r} is not a ZeRO stage; use 0, 1, 2 or 3",
    ),
    LayoutRule(
        "activation_checkpointing",
        UnsupportedLayout,
        lambda p: p.zero_stage == 3 and p.activation_checkpointing == "selective",
        lambda p: (
            "HybridParallel.activation_checkpointing='selective' does not work with zero_stage=3: gathering "
            "parameters inside the blocks runs different ops in the recomputation; use 'full' or 'offload', or "
            "zero_stage <= 2"
        ),
        summary="selective activation checkpointing with `zero_stage` 3",
    ),
    LayoutRule(
        "compile_blocks",
        UnsupportedLayout,
        lambda p: p.zero_stage == 3 and p.compile_blocks,
        lambda p: (
            "HybridParallel.compile_blocks=True does not work with zero_stage=3: the per-block parameter gathers "
            "swap the parameters' storage inside the blocks, which torch.compile cannot trace; use zero_stage <= 2 "
            "or compile_blocks=False"
        ),
        summary="`compile_blocks` with `zero_stage` 3",
    ),
    LayoutRule(
        "schedule",
        LayoutError,
        lambda p: p.schedule not in GENERATORS,
        lambda p: f"HybridParallel.schedule={p.schedule!r} is unknown; use one of {sorted(GENERATORS)}",
    ),
    LayoutRule(
        "schedule",
        UnsupportedLayout,
        lambda p: p.sp_mode == "megatron" and p.pp > 1 and p.schedule == "zero_bubble_h1",
        lambda p: (
            "HybridParallel: sp_mode='megatron' with schedule='zero_bubble_h1' is not supported (its split "
            "weight-gradient steps bypass the gradient hooks that sum the sequence-parallel norms' gradients over "
            "tp, so the tp ranks' collectives diverge); use schedule='1f1b' or 'gpipe'"
        ),
        summary="`sp_mode: megatron` with `pp` > 1 and `schedule: zero_bubble_h1`",
    ),
    LayoutRule(
        "pipeline_zero_sync",
        LayoutError,
        lambda p: p.pipeline_zero_sync not in PIPELINE_ZERO_SYNCS,
        lambda p: (
            f"HybridParallel.pipeline_zero_sync={p.pipeline_zero_sync!r} is unknown; use one of {PIPELINE_ZERO_SYNCS}"
        ),
    ),
    LayoutRule(
        "pipeline_zero_sync",
        LayoutError,
        lambda p: p.pipeline_zero_sync == "microbatch" and (p.pp == 1 or p.zero_stage < 2),
        lambda p: (
            "HybridParallel.pipeline_zero_sync='microbatch' is for pp > 1 with zero_stage 2 or 3 (got "
            f"pp={p.pp}, zero_stage={p.zero_stage}); leave it at 'step'"
        ),
    ),
    LayoutRule(
        "pipeline_zero_sync",
        UnsupportedLayout,
        lambda p: p.pipeline_zero_sync == "microbatch" and p.schedule == "zero_bubble_h1",
        lambda p: (
            "HybridParallel: pipeline_zero_sync='microbatch' with schedule='zero_bubble_h1' is not supported (its "
            "split weight-gradient steps fire no gradient hooks, which a per-microbatch reduction runs from); use "
            "pipeline_zero_sync='step', or schedule='1f1b' or 'gpipe'"
        ),
        summary="`pipeline_zero_sync: microbatch` with `schedule: zero_bubble_h1`",
    ),
    LayoutRule(
        "num_model_chunks",
        LayoutError,
        lambda p: p.schedule == "interleaved_1f1b" and p.num_model_chunks < 2,
        lambda p: "HybridParallel.schedule='interleaved_1f1b' needs num_model_chunks >= 2",
    ),
    LayoutRule(
        "num_model_chunks",
        LayoutError,
        lambda p: p.schedule != "interleaved_1f1b" and p.num_model_chunks != 1,
        lambda p: f"HybridParallel.num_model_chunks={p.num_model_chunks} needs schedule='interleaved_1f1b'",
    ),
)
"""HybridParallel's support matrix as data: each row raises its error type naming its field when it applies."""


def _tied_aliases(original_names: dict[int, list[str]]) -> dict[str, str]:
    """``{other name: first name}`` of every parameter the whole model holds under several names (a tied
    ``lm_head.weight`` is ``embed_tokens.weight``); a pipeline gives the names to different stages."""
    return {alias: names[0] for names in original_names.values() for alias in names[1:]}


def _names_with_aliases(checkpoint_names, aliases: dict[str, str]):
    """The plan's ``checkpoint_names`` with a tied parameter's other names saved and loaded under its first one's
    (the last stage's ``lm_head.weight`` is the checkpoint's ``embed_tokens.weight``, as in one process)."""
    if not aliases:
        return checkpoint_names

    def names(name: str, param: nn.Parameter):
        canonical = aliases.get(name, name)
        parts = checkpoint_names(canonical, param) if checkpoint_names is not None else None
        if parts is None and canonical != name:
            layout = layout_of(param)
            rows = layout.global_shape[0] if layout is not None else param.shape[0]
            return [(canonical, 0, rows)]
        return parts

    return names


class _StageChunks(nn.ModuleList):
    """This rank's model chunks of an interleaved pipeline as one module whose parameters keep the names they have
    in the whole model (the chunks hold different layers, named as in the model) instead of `nn.ModuleList`'s
    ``0.`` / ``1.`` prefixes, so optimizer groups and checkpoints see the names one process would."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen: set[int] = set()
        for chunk in self:
            for name, param in chunk.named_parameters(prefix, recurse, remove_duplicate):
                if not (remove_duplicate and id(param) in seen):
                    seen.add(id(param))
                    yield name, param


def _mixed_precision(plugin: HybridParallel):
    from colo.zero import MixedPrecision

    return None if plugin.precision == "fp32" else MixedPrecision(param_dtype=plugin.compute_dtype)


def _repoint_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, original_names: dict[int, list[str]]
) -> torch.optim.Optimizer:
    """Point ``optimizer``'s param groups at ``model``'s parameters now: tensor parallelism replaces parameters
    and a pipeline keeps a stage's, so each parameter joins the group its original held, matched by name (any of
    a tied parameter's names: the last stage's ``lm_head.weight`` joins ``embed_tokens.weight``'s group) or, for a
    parameter a parallel layer renamed, by its module (``qkv_proj.q_weight`` joins ``qkv_proj.weight``'s). The
    optimizer object and its hyperparameters are kept; it must be fresh."""
    if len(optimizer.state):
        raise ValueError("the optimizer already holds state; boost a fresh optimizer, before its first step")
    group_of_name: dict[str, int] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in original_names:
                raise ValueError("the optimizer holds a tensor that is not a parameter of the model")
            group_of_name.update(dict.fromkeys(original_names[id(param)], index))
    modules: dict[str, set[int]] = {}
    for name, index in group_of_name.items():
        modules.setdefault(name.rpartition(".")[0], set()).add(index)
    groups: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        index = group_of_name.get(name)
        if index is None:
            candidates = modules.get(name.rpartition(".")[0], set())
            if len(candidates) != 1:
                raise ValueError(
                    f"cannot tell which optimizer param group the parallelized parameter {name!r} belongs to; put "
                    "all parameters of its module in one group"
                )
            index = next(iter(candidates))
        groups[index].append(param)
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params
    return optimizer


class HybridEngine(ZeroEngine):
    """Runs steps for `HybridParallel` without a pipeline: the model plan prepares each rank's part of the data."""

    def __init__(self, plugin: HybridParallel, *, plan, model, optimizer: ZeroOptimizer, mesh: Mesh, criterion):
        super().__init__(plugin, model=model, optimizer=optimizer, mesh=mesh, criterion=criterion)
        self.plan = plan

    def prepare_micro(self, micro):
        return self.plan.prepare_batch(micro, mesh=self.mesh, plugin=self.plugin)


class PipelineEngine(OptimizerDriver, Engine):
    """Runs a pipeline step with ZeRO over the data axes: the chunk-optimizer driver and a `PipelineRunner` (the
    schedule's `colo.pipeline.PipelineExecutor`; a batch's size must divide by ``num_microbatches``)."""

    def __init__(
        self,
        plugin: HybridParallel,
        *,
        plan,
        part,
        optimizer: ZeroOptimizer,
        mesh: Mesh,
        model,
        tied_copies=(),
        criterion: PipelineCriterion | None = None,
    ) -> None:
        super().__init__(
            plugin, model=model, optimizer=optimizer, mesh=mesh, criterion=criterion, sync_every_microbatch=True
        )
        self.plan = plan
        self.tied_copies = set(tied_copies)
        """Checkpoint names of this rank's parameters that are another stage's parameter (a tied
        ``lm_head.weight``, saved as ``embed_tokens.weight``): that stage writes them; this one only loads them."""
        self.executor = PipelineExecutor(
            part.chunks,
            schedule=plugin.pipeline_schedule,
            mesh=mesh,
            loss_fn=part.loss_fn if criterion is None else criterion.pipeline_loss,
            tied_parameters=part.tied_parameters,
            on_backward_end=optimizer.reduce_gradients,
        )
        self.runner = PipelineRunner(self.executor, plan=plan, plugin=plugin, mesh=mesh, criterion=criterion)

    def forward(self, micro):
        """The criterion's per-row outputs of one microbatch through the stages, forward only, on every rank
        (`PipelineRunner.forward`; only with a `PipelineCriterion`)."""
        return self.runner.forward(micro)

    def train_step(self, batch):
        """`Engine.train_step`; under fp16 the schedule's backward starts from the loss scaler's scale (the
        executor's ``loss_scale``), which the optimizer divides out after its overflow check."""
        self.set_loss_scale(self.loss_scale)
        return super().train_step(batch)

    @property
    def loss_scale(self) -> float:
        """The optimizer's current loss scale (1 without a loss scaler)."""
        scaler = getattr(self.optimizer, "loss_scaler", None)
        return 1.0 if scaler is None else scaler.scale

    def set_loss_scale(self, scale: float) -> None:
        """Scale the gradients of this step's backward by ``scale``."""
        self.executor.loss_scale = scale

    def backward(self, loss):
        raise RuntimeError("with pp > 1 the pipeline runs backward itself: use booster.train_step(batch)")

    def no_sync(self):
        raise RuntimeError("with pp > 1 the pipeline accumulates microbatches itself: use booster.train_step(batch)")

    def checkpoint_state(self) -> tuple[dict, dict]:
        """The optimizer's checkpoint state with this rank's tied copies marked as replicas (the first stage holding
        the parameter writes it, under the same checkpoint name), and the optimizer scalars (AdamW's ``step``) of
        every stage in the metadata: each stage knows its own parameters' only, and the checkpoint keeps one
        rank's metadata (one all-gather of JSON over ``pp``)."""
        tensors, own = super().checkpoint_state()
        optimizer = own[OPTIMIZER_KEY]
        scalars = {}
        for stage_scalars in all_gather_object(optimizer["scalars"], group=self.mesh.group("pp")):
            scalars.update(stage_scalars)
        own[OPTIMIZER_KEY] = {**optimizer, "scalars": scalars}
        for key, value in tensors.items():
            weight = key.removeprefix(OPTIM_PREFIX).rpartition("/")[0] if key.startswith(OPTIM_PREFIX) else key
            if weight in self.tied_copies:
                tensors[key] = dataclasses.replace(value, replica=True)
        return tensors, own


class MoEHybridEngine(ExpertBiases, HybridEngine):
    """`HybridEngine` for a model with MoE blocks: the expert biases' update after each step (`ExpertBiases`)."""


class MoEPipelineEngine(ExpertBiases, PipelineEngine):
    """`PipelineEngine` for a model with MoE blocks: each stage updates its own blocks' expert biases after each
    step, and the checkpoint holds every stage's (`ExpertBiases`); under fp16 the stages' aux losses enter backward
    loss-scaled like the loss (`colo.apps.booster.moe_plan.set_aux_loss_scale`)."""

    def set_loss_scale(self, scale: float) -> None:
        super().set_loss_scale(scale)
        for chunk in self.executor.chunks:
            set_aux_loss_scale(chunk, scale)
