"""How `HybridParallel` parallelizes a model family: a `ModelPlan` per model type, looked up by `plan_for`.

A plan checks the plugin's sizes against the model's shape (before any collective), applies tensor and sequence
parallelism in place, and cuts the model into pipeline stages. colo's own plans (the native Llama, MoELlama,
transformers' ``LlamaForCausalLM`` and ``GPT2LMHeadModel``, and the diffusion transformer, alone or in the diffusion
recipe's ``DenoiserLoss``) are listed in `BUILTIN_PLANS` by the model class's
module and name and imported on first use, so importing the Booster imports no plan and no model; users add
theirs with `register_plan`, which take precedence.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from colo.comm import Mesh, default_device


def materialize_device() -> torch.device:
    """Where meta-device tensors are materialized: this rank's compute device (`colo.comm.default_device`: the
    current CUDA device in an NCCL job, the CPU in a gloo one)."""
    return default_device()


@dataclass(frozen=True)
class PipelinePart:
    """This rank's share of a pipeline: its model chunks, the loss the last stage computes, and tied parameters."""

    chunks: list[nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tied_parameters: dict[str, nn.Parameter]


class ModelPlan:
    """The parallelization of one model family (subclass it and `register_plan` it)."""

    def check(self, model: nn.Module, plugin) -> None:
        """Raise a `ValueError` naming the plugin field when its sizes do not fit the model (no collectives)."""

    def apply(self, model: nn.Module, *, mesh: Mesh, plugin) -> nn.Module:
        """Apply tensor / sequence parallelism to ``model`` (or a pipeline chunk of it), in place."""
        raise NotImplementedError

    def pipeline(self, model: nn.Module, *, mesh: Mesh, plugin, stage_ids: list[int]) -> PipelinePart:
        """The pipeline chunks for ``stage_ids`` (this rank's stages), parallelized with `apply`."""
        raise NotImplementedError

    def prepare_batch(
        self, batch: dict[str, torch.Tensor], *, mesh: Mesh, plugin
    ) -> tuple[dict[str, torch.Tensor], float]:
        """This rank's part of a (micro)batch and its loss weight: with sequence parallelism, the rank's piece of
        every sequence, weighted so that the mean over the sequence-parallel ranks is the loss of the whole."""
        return batch, 1.0

    def checkpoint_names(self, model: nn.Module):
        """``fn(parameter name, parameter) -> [(checkpoint name, first row, rows), ...] | None`` giving the unfused
        names checkpoints use (the same for every layout of the model), or ``None`` to keep parameter names."""
        return None

    def pipeline_batch(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first stage's inputs, last stage's targets)`` from a batch dict."""
        raise NotImplementedError

    def prepare_pipeline_batch(self, batch: Mapping[str, torch.Tensor], *, mesh: Mesh, plugin) -> tuple:
        """``(first stage's inputs, last stage's targets)`` of this rank: with sequence parallelism its piece of
        every sequence (and what the stages and the loss need to go with it). Default: `pipeline_batch`, and a
        `ValueError` under ``sp > 1`` (a plan that cuts sequences for its stages overrides this)."""
        if getattr(plugin, "sp", 1) > 1:
            raise ValueError(
                f"{type(self).__name__} does not cut sequences for pipeline stages (sp={plugin.sp} with pp > 1); "
                "use sp=1 with a pipeline, or override ModelPlan.prepare_pipeline_batch"
            )
        return self.pipeline_batch(batch)


def reject_packed_rows(batch: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise when a pipeline batch holds packed rows (``position_ids`` restarting within a row, or
    ``document_ids``): the pipeline feeds its first stage token ids only, so the document mask would be lost."""
    from colo.kernels import document_ids_from_position_ids

    ids = batch.get("document_ids")
    if ids is None and batch.get("position_ids") is not None:
        ids = document_ids_from_position_ids(batch["position_ids"])
    if ids is not None and bool(ids[..., -1:].ne(ids[..., :1]).any()):
        raise ValueError(
            f"{where}: the batch packs several documents per row (its position_ids restart within a row), but a "
            "pipeline (pp > 1) feeds its first stage input_ids only, so attention would cross the documents; use "
            "pp=1 (tp, sp and dp keep the document mask) or one document per row"
        )


BUILTIN_PLANS: tuple[tuple[str, str, str], ...] = (
    ("colo.apps.models.moe_llama.", "MoELlama", "colo.apps.booster.moe_plan:MoELlamaPlan"),
    ("colo.apps.models.llama.", "Llama", "colo.apps.booster.llama_plan:LlamaPlan"),
    ("transformers.models.llama.", "LlamaForCausalLM", "colo.apps.hf.plans:HFLlamaPlan"),
    ("transformers.models.gpt2.", "GPT2LMHeadModel", "colo.apps.hf.plans:HFGPT2Plan"),
    ("colo.apps.models.dit.", "DiffusionTransformer", "colo.apps.booster.dit_plan:DiTPlan"),
    ("colo.apps.diffusion.objective.", "DenoiserLoss", "colo.apps.booster.dit_plan:DiTPlan"),
)
"""colo's plans: ``(module prefix of the model class, class name, "module:PlanClass")``. A model whose class, or a
class it derives from, matches gets the plan (the most derived match wins); the plan's module is imported then."""

_PLANS: list[tuple[type, ModelPlan]] = []
_BUILTIN_INSTANCES: dict[str, ModelPlan] = {}


def register_plan(model_type: type, plan: ModelPlan) -> None:
    """Use ``plan`` for models of ``model_type`` (and its subclasses); later registrations win, and every
    registration wins over colo's own plans (`BUILTIN_PLANS`)."""
    _PLANS.insert(0, (model_type, plan))


def _builtin_plan(model_class: type) -> ModelPlan | None:
    for cls in model_class.__mro__:
        for module_prefix, name, target in BUILTIN_PLANS:
            if cls.__name__ == name and f"{cls.__module__}.".startswith(module_prefix):
                if target not in _BUILTIN_INSTANCES:
                    module, plan_class = target.split(":")
                    _BUILTIN_INSTANCES[target] = getattr(importlib.import_module(module), plan_class)()
                return _BUILTIN_INSTANCES[target]
    return None


def find_plan(model: nn.Module) -> ModelPlan | None:
    """The plan of ``model``'s type: a registered one, else colo's own (`BUILTIN_PLANS`), else ``None``."""
    for model_type, plan in _PLANS:
        if isinstance(model, model_type):
            return plan
    return _builtin_plan(type(model))


def checkpoint_manifest(model: nn.Module) -> list[str]:
    """The names of every parameter of ``model`` in its checkpoints (its plan's `ModelPlan.checkpoint_names`:
    colo's fused q/k/v saved as q, k and v, say), sorted. Taken from the whole model before a plugin cuts it
    into pipeline stages, it is what a checkpoint of any layout must hold."""
    plan = find_plan(model)
    names_of = plan.checkpoint_names(model) if plan is not None else None
    names = set()
    for name, param in model.named_parameters():
        parts = names_of(name, param) if names_of is not None else None
        names.update([name] if not parts else [part for part, _, _ in parts])
    return sorted(names)


def plan_for(model: nn.Module) -> ModelPlan:
    """The registered plan of ``model``'s type; a `ValueError` naming the type when there is none."""
    plan = find_plan(model)
    if plan is not None:
        return plan
    known = sorted({t.__name__ for t, _ in _PLANS} | {name for _, name, _ in BUILTIN_PLANS})
    raise ValueError(
        f"HybridParallel has no parallelization plan for {type(model).__name__}; plans exist for {known} (register "
        "one with colo.apps.booster.register_plan), or use the DDP / Zero plugins, which need none"
    )
