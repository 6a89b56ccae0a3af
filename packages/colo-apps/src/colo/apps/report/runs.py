"""What `colo report` reads of a run directory: its ``metrics.jsonl`` as one series per metric (and the per-rank timing
table of each record that has one), its newest diffusion sample grid, its newest profiler window's trace files and the
run's name from its newest checkpoint."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

from .traces import newest_window

METRICS_FILE = "metrics.jsonl"
_SAMPLE_GRID = re.compile(r"step-(\d+)\.png")
_CHECKPOINT = re.compile(r"step-(\d+)")  # the trainer's checkpoint directories (colo.apps.train.state)
RANK_PHASES = ("forward_s", "backward_s", "optimizer_s", "comm_wait_s")
"""The phases of a record's ``rank_timing`` table (``logging.rank_timing``, `colo.apps.train.rank_timing`)."""


@dataclass
class RunMetrics:
    """One run directory as `read_run` found it.

    Attributes:
        run_dir: the directory given.
        series: metric name -> ``(steps, values)``, ascending steps, one value per step (the later record wins).
        last: metric name -> its value at the run's last logged step for it.
        config_name: ``config.name`` from the newest committed checkpoint's metadata; ``None`` without one.
        sample_grid: ``(step, path)`` of the newest ``samples/step-N.png`` (diffusion runs); ``None`` without one.
        skipped_lines: lines of ``metrics.jsonl`` that were not a JSON record with a step (a run killed mid-write
            leaves a partial line, which a resumed run's next record then continues).
        rank_timing: step -> rank -> `RANK_PHASES` name -> seconds per step, from the records with a ``rank_timing``
            table (the later record of a step wins); empty without ``logging.rank_timing``.
        profile_window: ``(N, {rank: trace path})`` of the newest profiler window (``profile/rank-R-step-N.json``);
            ``None`` without traces.
    """

    run_dir: str
    series: dict[str, tuple[list[int], list[float]]]
    config_name: str | None = None
    sample_grid: tuple[int, str] | None = None
    skipped_lines: int = 0
    last: dict[str, float] = field(default_factory=dict)
    rank_timing: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)
    profile_window: tuple[int, dict[int, str]] | None = None


def read_run(run_dir: str) -> RunMetrics:
    """Read the run written under ``run_dir`` (a ``colo train`` run's ``output_dir``).

    Every numeric field of every record becomes a series over ``step``; ``None`` (MFU on a CPU), booleans
    (``skipped``) and non-finite numbers are left out, as is ``time``; a ``rank_timing`` table is kept per step
    (`RunMetrics.rank_timing`). A resumed run appends to the same file, so a
    step may appear twice: for each metric the later record of a step wins (the resumed run's value, the one its
    checkpoint continued). Lines that are not JSON records with a step are counted, not fatal.

    Args:
        run_dir: the run's output directory, holding ``metrics.jsonl``.

    Returns:
        The run's `RunMetrics`.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory, or has no ``metrics.jsonl`` (the message names the path).
        ValueError: ``metrics.jsonl`` holds no record with a step.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a directory: colo report reads run directories (a run's output_dir)")
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: {run_dir} is not the output_dir of a colo train run that logged metrics "
            "(logging.jsonl: true)"
        )
    by_step: dict[str, dict[int, float]] = {}
    rank_timing: dict[int, dict[int, dict[str, float]]] = {}
    skipped = 0
    with open(path, encoding="utf-8") as file:
        for line in file:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                skipped += 1
                continue
            for key, value in record.items():
                if key not in ("step", "time") and _is_number(value):
                    by_step.setdefault(key, {})[step] = float(value)
            if table := _rank_table(record.get("rank_timing")):
                rank_timing[step] = table
    if not by_step:
        raise ValueError(f"{path} holds no metrics: no line is a JSON record with a step and a number")
    series = {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in by_step.items()}
    return RunMetrics(
        run_dir=run_dir,
        series=series,
        last={key: values[-1] for key, (_, values) in series.items()},
        config_name=_config_name(run_dir),
        sample_grid=_newest_sample_grid(run_dir),
        skipped_lines=skipped,
        rank_timing=dict(sorted(rank_timing.items())),
        profile_window=newest_window(run_dir),
    )


def _is_number(value) -> bool:
    """A metric value worth plotting: a finite int or float, not a bool (``skipped``) nor ``None``."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _rank_table(table) -> dict[int, dict[str, float]] | None:
    """A record's ``rank_timing`` (``{"0": {"forward_s": ..., ...}, ...}``) as rank -> phase -> seconds, ranks in
    order; ``None`` unless every rank has every phase as a finite number."""
    if not isinstance(table, dict) or not table:
        return None
    ranks = {}
    for rank, phases in table.items():
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(phases, dict)):
            return None
        if not all(_is_number(phases.get(phase)) for phase in RANK_PHASES):
            return None
        ranks[int(rank)] = {phase: float(phases[phase]) for phase in RANK_PHASES}
    return dict(sorted(ranks.items()))


def _config_name(run_dir: str) -> str | None:
    """``config.name`` in the metadata of the newest committed checkpoint under ``run_dir/checkpoints`` (the
    ``step-N`` directory with the highest N holding an ``index.json``); ``None`` when there is none or it is
    unreadable (a report does not fail over a name). Reads the index as plain JSON: no trainer import, no tensor
    checks."""
    from ..runs.metadata import RUN_KEY

    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    committed = [
        (int(match.group(1)), entry.path)
        for entry in os.scandir(root)
        if (match := _CHECKPOINT.fullmatch(entry.name)) and os.path.isfile(os.path.join(entry.path, "index.json"))
    ]
    if not committed:
        return None
    try:
        with open(os.path.join(max(committed)[1], "index.json"), encoding="utf-8") as file:
            run = json.load(file).get("metadata", {}).get(RUN_KEY) or {}
        name = (run.get("config") or {}).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _newest_sample_grid(run_dir: str) -> tuple[int, str] | None:
    """``(step, path)`` of the highest-step ``samples/step-N.png`` a diffusion run wrote, if any."""
    samples = os.path.join(run_dir, "samples")
    if not os.path.isdir(samples):
        return None
    grids = [(int(m.group(1)), e.path) for e in os.scandir(samples) if (m := _SAMPLE_GRID.fullmatch(e.name))]
    return max(grids) if grids else None
