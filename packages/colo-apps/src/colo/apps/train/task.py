"""The seam between the one training loop and what ``data.task`` trains: `TrainTask`, `TaskContext`, and the
registry of `TaskSpec`s.

`Trainer` runs every task the same way: it starts the ranks, builds the plugin and the `Booster`, and loops over
steps under the resilience guard (SIGTERM checkpoints, the hang watchdog, timed checkpoints), checks the loss is
finite, logs metrics, saves asynchronously, prunes and resumes. What differs between tasks is a `TrainTask`: the
model, the data, the step, the metrics, evaluation, the final samples and the state a checkpoint keeps beside the
weights. A task sees the run through a `TaskContext` (model, booster, data, device, groups, logger, and a way to
rebuild the model and optimizer), never the trainer's internals; every hook has a default, so a task overrides only
what it changes.

A task is registered with a `TaskSpec`: its ``data.task`` name(s), the config section it owns (``grpo``,
``diffusion``, ...), its support rules (`TaskRule`: the field to change, when the rule applies, the message), and a
loader of its class. The run config (`colo.apps.train.config.RunConfig`) is assembled from the registered specs, and
``data.task`` is looked up here and nowhere else. The built-in tasks are registered by `colo.apps.recipes`, imported
on the first lookup, as torchtitan's train specs are; `register_task` adds another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

BUILTIN_TASKS_MODULE = "colo.apps.recipes"
"""The module whose import registers the built-in tasks (pretrain, sft, rm, dpo, grpo, ppo, diffusion)."""


class TaskRule(NamedTuple):
    """One support rule of a task, checked against the whole run config when it validates.

    Attributes:
        field: the dotted field a user changes to satisfy the rule (``plugin.pp``, ``lora.enabled``).
        applies: whether the config breaks the rule.
        message: what is wrong and what to change (the error's text).
        summary: when the rule refuses a config, in a few words (the README's table of refusals, `rules_table`).
    """

    field: str
    applies: Callable[[Any], bool]
    message: Callable[[Any], str]
    summary: str = ""


@dataclass(frozen=True)
class TaskSpec:
    """What the registry knows of a task before its module is imported.

    Attributes:
        name: the ``data.task`` value.
        summary: one sentence for ``data.task``'s description (schema, ``--help``).
        load: returns the `TrainTask` subclass (imports its module: nothing heavy is imported to validate a config).
        section: the run-config section the task owns (``"grpo"``), read only when the run is this task; several
            tasks may share one (``rm`` and ``dpo`` share ``preference``).
        section_type: that section's pydantic model.
        rules: support rules against the whole config (`TaskRule`), checked in order.
        check: a further check of the whole config (raise `ValueError` naming the field), after the rules.
        check_summary: ``(field, when it refuses)`` of `check`, for `rules_table`.
        trains_llama: the task trains the run's Llama (the ``model`` section; tokenizer, tensor-parallel heads).
        reads_data_files: the task reads ``data.paths`` as text / JSONL / Hugging Face datasets.
        reads_prepared_corpora: the task reads prepared token shards (``data.blend``, or a prepared corpus in
            ``data.paths``; `colo.apps.data.prepared`).
        streams: the task reads ``data.paths`` as a stream while it trains (``data.streaming``;
            `colo.apps.data.streaming`).
        reads_chat_template: the task reads ``data.chat_template``.
        rows_vary_in_labelled_tokens: its rows hold different numbers of labelled tokens (the default
            ``plugin.loss_weighting`` is then ``'token'``).
        batches_rows_of_seq_len: its rows are ``data.seq_len`` tokens split over the data ranks and microbatches as
            `colo.apps.train.world_check` checks before the ranks start.
        supports_moe: the task trains a mixture-of-experts preset.
    """

    name: str
    summary: str
    load: Callable[[], type[TrainTask]]
    section: str | None = None
    section_type: type | None = None
    rules: tuple[TaskRule, ...] = ()
    check: Callable[[Any], None] | None = None
    check_summary: tuple[str, str] | None = None
    trains_llama: bool = True
    reads_data_files: bool = True
    reads_prepared_corpora: bool = False
    streams: bool = False
    reads_chat_template: bool = False
    rows_vary_in_labelled_tokens: bool = False
    batches_rows_of_seq_len: bool = False
    supports_moe: bool = False

    def validate(self, config) -> None:
        """Raise `ValueError` (``"FIELD: message"``, which the config loader reports at FIELD) for the first broken
        rule, then run `check`."""
        for rule in self.rules:
            if rule.applies(config):
                raise ValueError(f"{rule.field}: {rule.message(config)}")
        if self.check is not None:
            self.check(config)


_REGISTRY: dict[str, TaskSpec] = {}
_builtins_loaded = False


def register_task(spec: TaskSpec) -> None:
    """Add ``spec`` to the registry (a name registered twice is an error: a recipe would silently replace another).
    Register before the first `RunConfig` is assembled (the config's ``data.task`` choices are fixed then)."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"data.task {spec.name!r} is registered already (by {_REGISTRY[spec.name].load})")
    owners = {other.section_type for other in _REGISTRY.values() if other.section == spec.section}
    if spec.section is not None and owners and owners != {spec.section_type}:
        raise ValueError(f"section {spec.section!r} is owned by another task with another type")
    _REGISTRY[spec.name] = spec


def task_specs() -> dict[str, TaskSpec]:
    """Every registered task by name (the built-in ones first; importing `colo.apps.recipes` registers them)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        importlib.import_module(BUILTIN_TASKS_MODULE)
    return dict(_REGISTRY)


def task_spec(name: str) -> TaskSpec:
    """The spec of ``data.task`` ``name``; a `ValueError` naming the choices for an unknown one."""
    specs = task_specs()
    if name not in specs:
        raise ValueError(f"data.task={name!r} is not a registered task; choose one of {sorted(specs)}")
    return specs[name]


def build_task(config) -> TrainTask:
    """The `TrainTask` of ``config.data.task``, built from the config (before any collective runs)."""
    return task_spec(config.data.task).load()(config)


def rules_table(specs: Iterable[TaskSpec] | None = None) -> str:
    """The refusals of the registered tasks (or ``specs``) as a Markdown table: ``data.task``, the field, when the rule
    refuses a config. The colo-apps README holds it (a test keeps the two equal); ``colo config --rules`` prints it."""
    rows = ["| data.task | field | refused when |", "|---|---|---|"]
    for spec in task_specs().values() if specs is None else specs:
        for rule in spec.rules:
            rows.append(f"| `{spec.name}` | `{rule.field}` | {rule.summary} |")
        if spec.check_summary is not None:
            rows.append(f"| `{spec.name}` | `{spec.check_summary[0]}` | {spec.check_summary[1]} |")
        if spec.trains_llama and not spec.supports_moe:
            rows.append(f"| `{spec.name}` | `model.preset` | a mixture-of-experts preset |")
    return "\n".join(rows)


def sections(specs: Iterable[TaskSpec]) -> dict[str, tuple[type, list[str]]]:
    """``{section name: (its type, the tasks that read it)}`` of ``specs``, in registration order."""
    owned: dict[str, tuple[type, list[str]]] = {}
    for spec in specs:
        if spec.section is not None:
            owned.setdefault(spec.section, (spec.section_type, []))[1].append(spec.name)
    return owned


@dataclass
class TaskContext:
    """What a task sees of the run. The trainer fills it in as the run is set up; `rebuild` replaces the boosted
    model and optimizer (a reward model's second stage); tasks read it and never reach into the trainer.

    Attributes:
        config: the validated run config.
        rank / world_size: this process among all of the job's.
        device: where the model computes.
        log: the run's `colo.apps.train.metrics.MetricsLogger` (``print`` / ``log`` on rank 0 only).
        plugin / booster: the plugin and `Booster` of the model being trained.
        model / optimizer: the boosted model and optimizer.
        mesh: the plugin's mesh over the world.
        sample_group: the group of ranks that get different samples (the data-parallel ranks).
        data: what the task's `TrainTask.build_data` returned.
    """

    config: Any
    rank: int
    world_size: int
    device: torch.device
    log: Any
    plugin: Any = None
    booster: Any = None
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    mesh: Any = None
    sample_group: Any = None
    data: Any = None
    _task: TrainTask | None = field(default=None, repr=False)
    _save: Callable[..., str] | None = field(default=None, repr=False)

    def build_model(self, *, init_from: str | None = None) -> nn.Module:
        """A fresh, unboosted model as the task builds it, before `TrainTask.prepare_model` (``init_from`` replaces
        ``model.init_from``): e.g. a frozen reference's structure."""
        return self._task.build_model(self, init_from=init_from)

    def save(self, step: int, path: str | None = None) -> str:
        """The trainer's checkpoint after ``step`` (every rank); with ``path``, a checkpoint kept apart from the
        run's (not pruned, not resumed from), written synchronously."""
        return self._save(step, path)

    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs) -> None:
        """Boost ``model`` and ``optimizer`` (``kwargs``: the Booster's ``criterion``, ``lr_scheduler``,
        ``example_batch``) and make them the run's: the trainer steps, saves and loads them from now on. The first
        call boosts under ``plugin``; a later one (a second stage's model) under a fresh plugin of the same layout."""
        from ..booster import Booster

        config = self.config
        plugin = self.plugin
        if plugin is None or self.booster is not None:
            plugin = config.plugin.build(num_microbatches=config.schedule.num_microbatches, seed=config.seed)
        booster = Booster(plugin)
        self.model, self.optimizer, *_ = booster.boost(model, optimizer, **kwargs)
        self.plugin, self.booster, self.mesh = plugin, booster, booster.mesh
        self.sample_group = self.mesh.group(*plugin.sample_axes(self.mesh))


class TrainTask:
    """What one ``data.task`` adds to the training loop; every hook has a default.

    Setup, in the order the trainer calls it: ``__init__(config)`` (before any collective: refuse bad input
    here), `build_model`, `prepare_model`, `build_optimizer`, `build_scheduler`, `example_batch` (then the trainer
    boosts with `criterion`), `build_data`, `describe`. Each step: `before_step`, `train_step`; every
    ``logging.every_steps`` steps `throughput` and `take_metrics`; every ``eval.every_steps`` steps `evaluate`.
    Checkpoints: `state`, `data_state`, `run_metadata` and `save_beside` when saving; `before_resume`, then
    `load_state`, `load_data_state` and `after_resume` (then the RNG states are restored) when resuming. At the
    end of a run that reached its last step, `finish`; at the end of every run, normally or by an exception, `close`.

    Args:
        config: the validated run config.
    """

    criterion: Callable | None = None
    """The Booster's criterion ``(outputs, microbatch) -> loss``; ``None``: the model's forward returns the loss."""

    state_key: str = "task"
    """The key of `state` in a checkpoint's run metadata."""

    def __init__(self, config) -> None:
        self.config = config

    # --- setup ----------------------------------------------------------------------------------------------------

    def build_model(self, ctx: TaskContext, *, init_from: str | None = None) -> nn.Module:
        """The model to train, unboosted (on ``ctx.device`` or the meta device when the plugin materializes it)."""
        raise NotImplementedError(f"{type(self).__name__} builds no model")

    def prepare_model(self, model: nn.Module) -> None:
        """After `build_model`, before the optimizer sees the model: what the task adds to it (a scalar head, the
        forward its criterion reads). `TaskContext.build_model` returns the model without it."""

    def build_optimizer(self, ctx: TaskContext, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer of the ``optimizer`` section (AdamW, decay / no-decay groups, layer-wise decay)."""
        from .optim import build_optimizer

        return build_optimizer(model, self.config.optimizer, num_layers=self.num_layers(model), device=ctx.device)

    def num_layers(self, model: nn.Module) -> int:
        """The model's depth for layer-wise LR decay (``optimizer.layerwise_lr_decay``)."""
        return 0

    def build_scheduler(self, ctx: TaskContext, optimizer: torch.optim.Optimizer):
        """The learning-rate schedule of the ``schedule`` section (warmup, then cosine)."""
        from .optim import build_scheduler

        return build_scheduler(optimizer, self.config.schedule, peak_lr=self.config.optimizer.lr)

    def example_batch(self, ctx: TaskContext) -> dict | None:
        """A batch the plugin may run once to learn the execution order (chunk packing); ``None``: none."""
        return None

    def build_data(self, ctx: TaskContext) -> Any:
        """This rank's data (``ctx.sample_group`` says which share); stored as ``ctx.data``."""
        return None

    def describe(self, ctx: TaskContext) -> list[str]:
        """Lines on the model and data for the run's log, after the trainer's header line."""
        return []

    # --- the step -------------------------------------------------------------------------------------------------

    def before_step(self, ctx: TaskContext, step: int) -> None:
        """Before the step after ``step`` reads its batch."""

    def train_step(self, ctx: TaskContext, step: int) -> tuple[Any, int]:
        """The step after ``step``: returns ``(the Booster's StepResult, units of work this rank did)``, the units
        being what `throughput` counts (tokens, images)."""
        raise NotImplementedError(f"{type(self).__name__} has no step")

    def throughput(self, ctx: TaskContext, *, units: int, seconds: float) -> dict[str, float]:
        """Throughput metrics of a logging window (``units`` of this rank's work in ``seconds``)."""
        return {}

    def take_metrics(self, ctx: TaskContext) -> dict[str, float]:
        """The task's step metrics since the last call (every rank calls it: collectives are allowed)."""
        return {}

    def evaluate(self, ctx: TaskContext, step: int) -> float | None:
        """Every ``eval.every_steps`` steps (every rank): the held-out loss, or ``None`` when there is none."""
        return None

    def finish(self, ctx: TaskContext, *, final_checkpoint: str | None) -> str | None:
        """After the last step (every rank): what the run shows at its end (a sample, a grid's path), or ``None``."""
        return None

    def close(self, ctx: TaskContext) -> None:
        """When the run ends, normally or by an exception (every rank): release what `build_data` opened (a
        streamed corpus's reading thread)."""

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def state(self) -> dict | None:
        """The task's state a checkpoint keeps (JSON), or ``None``."""
        return None

    def load_state(self, ctx: TaskContext, state: dict | None) -> None:
        """Restore `state` (``None``: the checkpoint holds none)."""

    def data_state(self, ctx: TaskContext) -> dict | None:
        """The data position a checkpoint keeps (JSON; rank 0's is saved), or ``None`` when the step alone decides
        the batch."""
        return None

    def load_data_state(self, ctx: TaskContext, state: dict | None) -> None:
        """Restore `data_state`."""

    def run_metadata(self, ctx: TaskContext) -> dict:
        """More of a checkpoint's run metadata (how to open it as a model: shapes, tokenizer)."""
        return {}

    def save_beside(self, ctx: TaskContext, step: int, path: str) -> None:
        """Before the checkpoint of ``step`` at ``path`` is written (every rank): files of the task's own (a
        separate critic, an EMA) that must be complete before it commits."""

    def before_resume(self, ctx: TaskContext, step: int) -> None:
        """Before the checkpoint saved after ``step`` loads: build what it holds (a second stage's model)."""

    def after_resume(self, ctx: TaskContext, path: str, step: int) -> None:
        """After the checkpoint at ``path`` loaded."""
