"""`FrozenPipeline`: a frozen copy of a pipelined model (``HybridParallel(pp > 1)``), run forward only.

A frozen reference (GRPO's KL term) must compute with the same layout as the policy it is compared with. Under a
pipeline no rank holds the whole model, so the copy is pipelined as the policy is: each rank keeps its own stages of
the copy (cut and laid out by the same plan), and a forward runs the stages in order through an executor of the
copy's own (`colo.pipeline.PipelineExecutor.forward_outputs`), the last stage's output turned into per-row values by
the boost criterion's ``pipeline_outputs`` and sent to every rank of the pipeline. A rank holds one stage of the
reference, as it holds one stage of the policy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from colo.comm import all_gather_object
from colo.pipeline import PipelineExecutor


class FrozenPipeline(nn.Module):
    """This rank's frozen stages of a pipelined model, called as the boosted model is
    (``copy(**microbatch) -> criterion.pipeline_outputs``, the same on every rank of the pipeline).

    Args:
        chunks (list[nn.Module]): this rank's stages, frozen.
        executor (PipelineExecutor): an executor over them (its own: no training step runs through it).
        criterion: the boost criterion (a `colo.apps.booster.PipelineCriterion`) that cuts batches and reads the
            last stage's output.
        group: the pipeline's process group.
    """

    def __init__(self, chunks: list[nn.Module], *, executor: PipelineExecutor, criterion, group) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.executor, self.criterion, self.group = executor, criterion, group

    @torch.no_grad()
    def forward(self, **micro: torch.Tensor) -> Mapping[str, torch.Tensor]:
        inputs, targets = self.criterion.pipeline_split(micro)
        outputs = self.executor.forward_outputs(inputs, targets, output_fn=self.criterion.pipeline_outputs)
        local = None if outputs is None else {name: value.detach().cpu() for name, value in outputs[0].items()}
        held = [value for value in all_gather_object(local, group=self.group) if value is not None]
        return {name: value.to(self.executor.device) for name, value in held[-1].items()}


def _no_loss(*_args):
    raise RuntimeError("a FrozenPipeline runs forward only")


def frozen_pipeline(engine, model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> FrozenPipeline:
    """``model`` (unsharded, or on the meta device) as a `FrozenPipeline` laid out as ``engine``'s stages, loaded
    with ``state_dict`` (the whole model's names; each stage takes its own entries)."""
    from .plugins.runner import PipelineCriterion

    plugin, mesh, criterion = engine.plugin, engine.mesh, engine.criterion
    if not isinstance(criterion, PipelineCriterion):
        raise ValueError(
            f"Booster.frozen_copy under pp={plugin.pp}: the copy runs the boost criterion's pipeline_split / "
            "pipeline_outputs; boost with a PipelineCriterion (e.g. colo.apps.rlhf.GRPOCriterion)"
        )
    stage_ids = list(plugin.pipeline_schedule.stages[mesh.rank("pp")])
    part = engine.plan.pipeline(model, mesh=mesh, plugin=plugin, stage_ids=stage_ids)
    if state_dict is not None:
        for chunk in part.chunks:
            own = chunk.state_dict()
            missing = sorted(name for name in own if name not in state_dict)
            if missing:
                raise ValueError(
                    f"Booster.frozen_copy: the state dict lacks {missing[:3]} of pipeline stage {stage_ids}"
                )
            chunk.load_state_dict({name: state_dict[name] for name in own})
    for chunk in part.chunks:
        chunk.requires_grad_(False).eval()
    executor = PipelineExecutor(
        part.chunks, schedule=plugin.pipeline_schedule, mesh=mesh, loss_fn=_no_loss, tied_parameters=None
    )
    return FrozenPipeline(part.chunks, executor=executor, criterion=criterion, group=mesh.group("pp")).eval()
