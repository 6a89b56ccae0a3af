"""Runners: what one training step does between the optimizer steps, apart from the optimizer.

An `Engine` is an optimizer driver (backward, gradient sync, clipping, the step, checkpoint state: the plugin's) plus
a runner, which turns a step's batch into forwards and backwards and a loss:

- `MicrobatchRunner`: the batch split into ``plugin.num_microbatches`` microbatches, each forwarded (the engine's
  `Engine.prepare_micro` gives this rank's part and the weight of its loss) and backwarded through the engine, the
  gradient sync of all but the last held back by the engine's ``no_sync`` (unless it syncs every microbatch); the
  microbatch losses weighted equally or by their labelled tokens (``loss_weighting="token"``).
- `PipelineRunner`: a pipeline schedule (`colo.pipeline.PipelineExecutor`) runs the microbatches over the stages,
  backward included; the model plan cuts the batch into the first stage's inputs and the last stage's targets (or,
  given a `PipelineCriterion`, the criterion does, and computes the last stage's loss).

The engine then steps its optimizer once; its `Engine.train_step` is the same whatever the runner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from colo.comm import all_reduce

from ..microbatch import loss_of, split_batch
from ..replicas import comm_device
from ..timing import phase

IGNORE_INDEX = -100
"""The label of tokens without a loss (Hugging Face's and colo's Llama convention)."""


@runtime_checkable
class PipelineCriterion(Protocol):
    """A criterion that also runs under a pipeline (``HybridParallel(pp > 1)``), where no rank holds the whole
    model: the batch is cut into the first stage's inputs and the last stage's targets, and the loss is computed on
    the last stage from its output (the model's logits) and its microbatch's targets. Both are split along dim 0 into
    the same microbatches, so what belongs together (a preference pair's two rows, a rollout row's advantages)
    must sit in the same rows. E.g. `colo.apps.rlhf.PreferenceCriterion`. A criterion whose batches change shape from
    step to step by design sets ``pipeline_shapes_vary = True`` (the stages then exchange their input shapes again at
    every step, `colo.pipeline.PipelineExecutor.forget_shapes`)."""

    def pipeline_split(self, batch: Mapping[str, torch.Tensor]) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a batch: the first stage's token ids, and what the loss reads beside the
        output."""

    def pipeline_loss(self, output: torch.Tensor, targets: Any) -> torch.Tensor:
        """The scalar loss of one microbatch on the last stage (the microbatch losses are averaged)."""

    def pipeline_outputs(self, output: torch.Tensor, targets: Any) -> Mapping[str, torch.Tensor]:
        """What the model's own forward returns for these rows (e.g. per-sequence log-probs), from the last stage's
        output: a pipelined `Booster.forward` returns it on every rank."""


class MicrobatchRunner:
    """Gradient accumulation over microbatches through an engine's per-microbatch hooks (see the module docstring).

    Args:
        engine: the `Engine` whose ``forward``, ``prepare_micro``, ``backward``, ``no_sync``, ``criterion``,
            ``plugin``, ``mesh`` and ``sync_every_microbatch`` it uses.
    """

    eval_microbatches = 1
    """How many microbatches `evaluate` splits a batch into (a batch's size must divide by it)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def forward_backward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward over ``batch``; returns this rank's loss of the step (float64, on the CPU): the sum
        of the weighted microbatch losses."""
        engine = self.engine
        micro_batches = split_batch(batch, engine.plugin.num_microbatches)
        count = len(micro_batches)
        shares = self.token_shares(micro_batches) if engine.plugin.loss_weighting == "token" else [1.0 / count] * count
        total = torch.zeros((), dtype=torch.float64)
        timer = engine.timer
        for index, micro in enumerate(micro_batches):
            last = index == count - 1
            context = contextlib.nullcontext() if last or engine.sync_every_microbatch else engine.no_sync()
            with context:
                with phase(timer, "forward"):
                    micro, weight = engine.prepare_micro(micro)
                    loss = loss_of(engine.forward(micro), micro, engine.criterion) * (weight * shares[index])
                with phase(timer, "backward"):
                    engine.backward(loss)
            total += loss.detach().double().cpu()
        return total

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of ``batch`` on this rank, forward only (the caller disables gradients): the plugin's share of
        it (`Engine.prepare_micro`), its loss weighted the way a training step weights it."""
        engine = self.engine
        micro, weight = engine.prepare_micro(batch)
        return loss_of(engine.forward(micro), micro, engine.criterion) * weight

    def token_shares(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[float]:
        """Per microbatch, ``its labelled targets * ranks with different samples / the step's labelled targets on
        all of them``: the factors that make the data-parallel mean of the weighted microbatch means the mean over
        every labelled token of the step (``loss_weighting="token"``). One all-reduce of a scalar."""
        engine = self.engine
        counts = []
        for micro in micro_batches:
            labels = micro.get("labels") if isinstance(micro, Mapping) else None
            if labels is None:
                raise ValueError(
                    f"{type(engine.plugin).__name__}.loss_weighting='token' counts the batch's labelled tokens, but "
                    "the batch has no 'labels'; pass labels or use loss_weighting='microbatch'"
                )
            counts.append(int((labels[:, 1:] != IGNORE_INDEX).sum()))
        group = engine.mesh.group(*engine.plugin.sample_axes(engine.mesh))
        total = torch.tensor([float(sum(counts))], dtype=torch.float64, device=comm_device(group))
        if group.size > 1:
            with phase(engine.timer, "comm_wait", "colo.token count all-reduce"):
                all_reduce(total, group=group)
        total = max(float(total.item()), 1.0)
        return [n * group.size / total for n in counts]


class PipelineRunner:
    """A pipeline schedule over the stages (see the module docstring).

    Args:
        executor: the `colo.pipeline.PipelineExecutor` of this rank's stages.
        plan: the model plan (`ModelPlan.prepare_pipeline_batch` cuts a batch for the stages).
        plugin: the `HybridParallel` plugin (``num_microbatches``).
        mesh: the mesh.
        criterion (PipelineCriterion | None): cuts the batches instead of the plan (its ``pipeline_loss`` is the
            executor's loss). Default: ``None``.
    """

    def __init__(self, executor, *, plan, plugin, mesh, criterion: PipelineCriterion | None = None) -> None:
        self.executor, self.plan, self.plugin, self.mesh = executor, plan, plugin, mesh
        self.criterion = criterion

    def split(self, batch: Mapping[str, torch.Tensor]) -> tuple[Any, Any]:
        """The first stage's inputs and the last stage's targets of ``batch`` (the criterion's cut, or the plan's)."""
        if self.criterion is not None:
            return self.criterion.pipeline_split(batch)
        return self.plan.prepare_pipeline_batch(batch, mesh=self.mesh, plugin=self.plugin)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``criterion.pipeline_outputs`` of ``batch`` (one microbatch, forward only through the stages), on every
        rank of the pipeline (sent from the last stage's rank as objects: per-row values, small)."""
        from colo.comm import all_gather_object

        if self.criterion is None:
            raise RuntimeError(
                "Booster.forward with pp > 1 needs a criterion that runs under a pipeline (PipelineCriterion: "
                "pipeline_split / pipeline_loss / pipeline_outputs); or use booster.eval_step(batch)"
            )
        inputs, targets = self.criterion.pipeline_split(batch)
        outputs = self.executor.forward_outputs(inputs, targets, output_fn=self.criterion.pipeline_outputs)
        local = None if outputs is None else {name: value.detach().cpu() for name, value in outputs[0].items()}
        held = [value for value in all_gather_object(local, group=self.mesh.group("pp")) if value is not None]
        device = self.executor.device
        return {name: value.to(device) for name, value in held[-1].items()}

    @property
    def eval_microbatches(self) -> int:
        """The schedule's microbatches: a batch's size must divide by it."""
        return self.plugin.num_microbatches

    def forward_backward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The schedule over ``batch``, backward included; returns this rank's loss of the step (float64, CPU)."""
        inputs, targets = self.split(batch)
        if getattr(self.criterion, "pipeline_shapes_vary", False):  # e.g. rollout rows of a new width every step
            self.executor.forget_shapes()
        result = self.executor.step(inputs, targets, return_loss=True)
        return result.loss.detach().double().cpu()

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean loss of ``batch`` (this data rank's share), forward only through the stages
        (`PipelineExecutor.evaluate`); every rank of the pipeline gets it."""
        inputs, targets = self.split(batch)
        return self.executor.evaluate(inputs, targets)
