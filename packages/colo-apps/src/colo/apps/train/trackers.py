"""Experiment trackers (``logging.report_to``): Weights & Biases and MLflow get the resolved run config, every logged
metric and the run's samples (text; image grids), from rank 0 through `colo.apps.train.metrics.MetricsLogger`.

Both are optional extras (``pip install 'colo-apps[wandb]'`` / ``'colo-apps[mlflow]'``), imported only when a run
lists them. Each keeps its run's id in ``output_dir/trackers.json``, so a run resumed from a checkpoint continues the
same tracker run; a run that starts from scratch in the same directory begins a new one.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from .resilience import PREEMPTED_EXIT_CODE

TrackerStatus = Literal["finished", "failed", "preempted"]
"""How a run ended: ``"preempted"`` is a SIGTERM after which it checkpointed, to be resumed (the same tracker runs
reopen then)."""

EXTRAS = {"wandb": ("wandb", "colo-apps[wandb]"), "mlflow": ("mlflow", "colo-apps[mlflow]")}
"""``logging.report_to`` name -> (the module it imports, the pip extra that installs it)."""

IDS_FILE = "trackers.json"
"""Under the run's ``output_dir``: ``{"wandb": run id, "mlflow": run id}``, what a resumed run reopens."""


class Tracker(Protocol):
    """What `MetricsLogger` calls on rank 0; one instance per tracker and run."""

    def start(self, config: dict, *, run_name: str, output_dir: str, resuming: bool) -> list[str]:
        """Open the run (reopen the stored one when ``resuming``) and record ``config``; returns lines to show
        (e.g. what was truncated)."""

    def log(self, record: Mapping[str, float], step: int) -> None:
        """Record flat numeric metrics at ``step``."""

    def log_text(self, name: str, text: str, step: int) -> None:
        """Record a text sample."""

    def log_image(self, name: str, path: str, step: int) -> None:
        """Record an image file (a sample grid)."""

    def finish(self, status: TrackerStatus) -> None:
        """Close the run as finished, failed or preempted."""


def missing_tracker(report_to: Sequence[str]) -> str | None:
    """What is wrong when a tracker ``report_to`` names cannot be imported (checked without importing it), naming
    the pip extra; ``None`` when all can."""
    for name in report_to:
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            return (
                f"logging.report_to lists {name!r}, but the {module} package is not installed: "
                f"pip install '{extra}' (or remove {name!r} from logging.report_to)"
            )
    return None


def require_trackers(report_to: Sequence[str]) -> None:
    """Check that every tracker ``report_to`` names is installed; every rank calls this before any collective, so a
    missing extra is one clear error rather than a hang (``colo train`` / ``colo launch`` check it earlier, as an
    invalid run config).

    Raises:
        ImportError: a listed tracker's package is not installed; the message names the pip extra.
    """
    problem = missing_tracker(report_to)
    if problem is not None:
        raise ImportError(problem)


def build_trackers(report_to: Sequence[str], *, project: str | None) -> list[Tracker]:
    """The trackers ``report_to`` names, not started yet (rank 0 only).

    Args:
        report_to: ``logging.report_to`` (``"wandb"``, ``"mlflow"``).
        project: the W&B project / MLflow experiment; ``None``: ``"colo"``.
    """
    kinds = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [kinds[name](project=project or "colo") for name in report_to]


def numeric_metrics(record: Mapping, *, prefix: str = "") -> dict[str, float]:
    """``record``'s numbers, nested dicts flattened with ``'/'`` (``{"a": {"b": 1}} -> {"a/b": 1}``); booleans as
    0 / 1; ``step``, ``time``, strings and ``None`` left out."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if not prefix and key in ("step", "time"):
            continue
        if isinstance(value, Mapping):
            flat.update(numeric_metrics(value, prefix=f"{name}/"))
        elif isinstance(value, bool):
            flat[name] = int(value)
        elif isinstance(value, int | float):
            flat[name] = value
    return flat


def flatten_config(config: Mapping, *, prefix: str = "") -> dict[str, object]:
    """``{"model": {"dim": 64}} -> {"model/dim": 64}``; lists stay values."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, prefix=f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _stored_id(output_dir: str, tracker: str) -> str | None:
    try:
        with open(os.path.join(output_dir, IDS_FILE), encoding="utf-8") as file:
            return json.load(file).get(tracker)
    except (OSError, ValueError):
        return None


def _store_id(output_dir: str, tracker: str, run_id: str) -> None:
    path = os.path.join(output_dir, IDS_FILE)
    try:
        with open(path, encoding="utf-8") as file:
            ids = json.load(file)
    except (OSError, ValueError):
        ids = {}
    ids[tracker] = run_id
    os.makedirs(output_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(ids, file)


class WandbTracker:
    """Weights & Biases: ``wandb.init(project, name=run name, dir=output_dir, config=the resolved config,
    id=..., resume="allow")``; ``WANDB_MODE=offline`` needs no account (``wandb sync`` uploads later).

    Args:
        project: the W&B project.
    """

    def __init__(self, *, project: str) -> None:
        self.project = project
        self.run = None

    def start(self, config: dict, *, run_name: str, output_dir: str, resuming: bool) -> list[str]:
        import wandb

        run_id = _stored_id(output_dir, "wandb") if resuming else None  # None: W&B picks a new one
        self.run = wandb.init(
            project=self.project, name=run_name, dir=output_dir, config=config, id=run_id, resume="allow"
        )
        _store_id(output_dir, "wandb", self.run.id)
        return []

    def log(self, record: Mapping[str, float], step: int) -> None:
        self.run.log(dict(record), step=step)

    def log_text(self, name: str, text: str, step: int) -> None:
        import wandb

        self.run.log({name: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def log_image(self, name: str, path: str, step: int) -> None:
        import wandb

        self.run.log({name: wandb.Image(path)}, step=step)

    def finish(self, status: TrackerStatus) -> None:
        if status == "preempted":  # W&B shows the run as preempted; the resumed run reopens it
            self.run.mark_preempting()
        self.run.finish(exit_code={"finished": 0, "failed": 1, "preempted": PREEMPTED_EXIT_CODE}[status])
        import wandb

        # run.finish() can return before W&B's service process has written an offline run's records (the run file
        # then holds its header only); tearing the service down waits for them, so a finished run is on disk
        wandb.teardown()


_MLFLOW_NAME = re.compile(r"[^/\w.\- ]")  # what MLflow accepts in metric and param names


class MlflowTracker:
    """MLflow through its client, against ``MLFLOW_TRACKING_URI`` (MLflow's default: ``sqlite:///mlflow.db`` in the
    working directory): an experiment named ``project``, a run whose params are the flattened config (values over
    MLflow's length limit truncated, and said so; the whole config is the run's ``config.json`` artifact), metrics per
    step, text samples as ``samples/*.txt`` and images under ``samples/``.

    Args:
        project: the MLflow experiment.
    """

    def __init__(self, *, project: str) -> None:
        self.project = project
        self.client = None
        self.run_id: str | None = None

    def start(self, config: dict, *, run_name: str, output_dir: str, resuming: bool) -> list[str]:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient()
        stored = _stored_id(output_dir, "mlflow") if resuming else None
        if stored is not None:
            try:
                client.get_run(stored)
            except MlflowException:  # not in this tracking store (another MLFLOW_TRACKING_URI, deleted)
                stored = None
        if stored is not None:
            self.run_id = stored
            client.update_run(stored, status="RUNNING")
            return []  # its params are the config it started with (MLflow params cannot change)
        experiment = client.get_experiment_by_name(self.project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.project)
        self.run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
        _store_id(output_dir, "mlflow", self.run_id)
        limit = _mlflow_param_limit()
        params, truncated = [], []
        for key, value in flatten_config(config).items():
            text = json.dumps(value) if isinstance(value, list | dict) else str(value)
            if len(text) > limit:
                text = text[: limit - 3] + "..."
                truncated.append(key)
            params.append(Param(_MLFLOW_NAME.sub("_", key), text))
        client.log_batch(self.run_id, params=params)
        client.log_dict(self.run_id, config, "config.json")
        if truncated:
            return [
                f"mlflow: params {', '.join(truncated)} are longer than MLflow's {limit} characters and were "
                "truncated; the whole config is the run's config.json artifact"
            ]
        return []

    def log(self, record: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_NAME.sub("_", key), float(value), now, step) for key, value in record.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_text(self, name: str, text: str, step: int) -> None:
        file_name = _MLFLOW_NAME.sub("_", name.replace("/", "_"))
        self.client.log_text(self.run_id, text, f"samples/{file_name}-step-{step:08d}.txt")

    def log_image(self, name: str, path: str, step: int) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path="samples")

    def finish(self, status: TrackerStatus) -> None:
        statuses = {"finished": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}  # MLflow's run statuses
        self.client.set_terminated(self.run_id, status=statuses[status])


def _mlflow_param_limit() -> int:
    """MLflow's longest param value (6000 characters in MLflow 3; 500 in old versions)."""
    from mlflow.utils import validation

    return getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
