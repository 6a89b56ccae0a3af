"""Training metrics on rank 0: a rich progress bar with log lines, a JSONL file, TensorBoard (when installed) and the
experiment trackers ``logging.report_to`` lists (`colo.apps.train.trackers`); plus the memory and throughput numbers
they show."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Sequence

import torch

from ..mfu import format_mfu
from .trackers import Tracker, TrackerStatus, build_trackers, numeric_metrics


def memory_bytes(device: torch.device) -> tuple[int, str]:
    """``(bytes, what)``: CUDA's peak allocated memory on a GPU, the process's peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max allocated"
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return peak_kib * 1024, "peak RSS"


def format_bytes(count: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


class MetricsLogger:
    """Shows and records metrics and samples; every rank makes one, only rank 0's (``enabled``) does anything.

    Args:
        output_dir: where ``metrics.jsonl`` and ``tensorboard/`` go.
        total_steps: the run's length (the progress bar's total).
        start_step: steps already done (a resumed run).
        jsonl: append records to ``output_dir/metrics.jsonl``.
        tensorboard: write scalars to ``output_dir/tensorboard`` if the ``tensorboard`` package is installed.
        progress_bar: show a rich progress bar on a terminal.
        report_to: experiment trackers (``"wandb"``, ``"mlflow"``) that get every record and sample once
            `start_trackers` has opened their runs.
        project: the trackers' project / experiment (``None``: ``"colo"``).
        enabled: ``False`` on ranks other than 0.
    """

    def __init__(
        self,
        output_dir: str,
        *,
        total_steps: int,
        start_step: int = 0,
        jsonl: bool = True,
        tensorboard: bool = True,
        progress_bar: bool = True,
        report_to: Sequence[str] = (),
        project: str | None = None,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.output_dir = output_dir
        self.jsonl_path = os.path.join(output_dir, "metrics.jsonl") if jsonl and enabled else None
        self.writer = None
        self.progress = None
        self._pending_trackers: list[Tracker] = build_trackers(report_to, project=project) if enabled else []
        self.trackers: list[Tracker] = []  # the started ones
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(file=sys.stdout, highlight=False)
        os.makedirs(output_dir, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                self.writer = None
            else:
                self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if progress_bar and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def print(self, message: str) -> None:
        """A line on rank 0's console (above the progress bar)."""
        if self.enabled:
            self.console.print(message, markup=False, soft_wrap=True)

    def advance(self, step: int, status: str) -> None:
        """Move the progress bar to ``step`` with a short ``status`` (loss, tokens/s)."""
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=status)

    def start_trackers(self, config: dict, *, run_name: str, resuming: bool) -> None:
        """Open the trackers' runs with the resolved run ``config`` (rank 0); ``resuming``: reopen the runs this
        ``output_dir`` recorded (a run resumed from a checkpoint)."""
        while self._pending_trackers:
            tracker = self._pending_trackers.pop(0)
            for note in tracker.start(config, run_name=run_name, output_dir=self.output_dir, resuming=resuming):
                self.print(note)
            self.trackers.append(tracker)

    def log(self, record: dict) -> None:
        """Record one step's metrics (``{"step": ..., "loss": ..., ...}``) to JSONL, TensorBoard and the trackers
        (their numbers, nested dicts flattened with ``'/'``)."""
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        if self.jsonl_path is not None:
            with open(self.jsonl_path, "a", encoding="utf-8") as file:
                file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(key, value, record["step"])
        if self.trackers:
            metrics = numeric_metrics(record)
            for tracker in self.trackers:
                tracker.log(metrics, record["step"])

    def log_sample_text(self, name: str, text: str, step: int) -> None:
        """A generated text sample, to the trackers (the console shows it through `print`)."""
        for tracker in self.trackers:
            tracker.log_text(name, text, step)

    def log_sample_image(self, name: str, path: str, step: int) -> None:
        """An image file (a diffusion run's sample grid), to the trackers."""
        for tracker in self.trackers:
            tracker.log_image(name, path, step)

    def close(self, status: TrackerStatus = "finished") -> None:
        """Stop the progress bar, flush TensorBoard and finish the trackers' runs as ``status`` (``"failed"``: the
        run raised; ``"preempted"``: it stopped on SIGTERM after a checkpoint). Closing twice does nothing more."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self._pending_trackers = []
        while self.trackers:
            self.trackers.pop(0).finish(status)


TASK_STEP_METRICS = (
    ("sft_loss", "{:.4f}"),
    ("reward_mean", "{:.3f}"),
    ("kl", "{:.4f}"),
    ("response_length", "{:.1f}"),
    ("clip_fraction", "{:.3f}"),
    ("value_loss", "{:.4f}"),
    ("explained_variance", "{:.3f}"),
    ("accuracy", "{:.1%}"),
    ("margin", "{:.3f}"),
)
"""What the step line shows of a recipe's metrics, as ``(name after the task prefix, format)``: what RL users watch
(reward, KL, response length, clip fraction; PPO's value loss and explained variance) and preference training's
accuracy and margin. Each appears under its ``metrics.jsonl`` name (``grpo/reward_mean``, ``ppo/kl``, ``dpo/margin``)
when the step's record holds it."""

TASK_PREFIXES = ("grpo", "ppo", "dpo", "rm")


def task_metric_parts(record: dict) -> list[str]:
    """``"grpo/reward_mean 0.412"``-style parts of the step line for the recipe metrics ``record`` holds."""
    parts = []
    for name, spec in TASK_STEP_METRICS:
        for prefix in TASK_PREFIXES:
            value = record.get(f"{prefix}/{name}")
            if isinstance(value, int | float):
                parts.append(f"{prefix}/{name} {spec.format(value)}")
    return parts


def throughput_text(record: dict) -> str:
    """A record's throughput for the progress bar: ``12.3k tok/s`` or ``41.2 images/s`` (empty without one)."""
    if "tokens_per_second" in record:
        return f"{record['tokens_per_second'] / 1000:.1f}k tok/s"
    if "images_per_s" in record:
        return f"{record['images_per_s']:.1f} images/s"
    return ""


def step_line(record: dict, *, total_steps: int) -> str:
    """The log line of one step: ``step 100/300 | loss 2.31 | lr 1.9e-03 | 12.3k tok/s | MFU n/a | mem 310 MiB``,
    with a recipe's own metrics after the loss (`TASK_STEP_METRICS`); a diffusion record (``images_per_s``,
    ``memory``) shows ``41.2 images/s`` in place of tokens/s and MFU."""
    if "tokens_per_second" in record:
        throughput = [f"{record['tokens_per_second'] / 1000:.1f}k tok/s", f"MFU {format_mfu(record.get('mfu'))}"]
    else:
        throughput = [f"{record['images_per_s']:.1f} images/s"]
    memory = record["memory_bytes"] if "memory_bytes" in record else record["memory"]
    parts = [
        f"step {record['step']}/{total_steps}",
        f"loss {record['loss']:.4f}",
        *task_metric_parts(record),
        f"lr {record['lr']:.2e}" if record.get("lr") is not None else "lr -",
        f"grad norm {record['grad_norm']:.3f}" if record.get("grad_norm") is not None else "grad norm -",
        *throughput,
        f"mem {format_bytes(memory)}",
    ]
    return " | ".join(parts)
