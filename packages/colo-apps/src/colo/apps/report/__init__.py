"""``colo report``: loss, eval loss, learning rate, throughput, MFU, memory (and an RL run's reward, KL and response
length) over steps, several runs overlaid, drawn from each run's ``metrics.jsonl`` into a PNG and a self-contained
HTML page; a diffusion run's newest sample grid sits beside the curves. Under them, a row per run with per-rank
timing (``logging.rank_timing``: each rank's forward / backward / optimizer / comm wait per step) or profiler traces
(``profile.every_steps``: each rank's colo ranges in the newest window's last step, as a timeline).

matplotlib (the ``report`` extra) is imported only when a report is drawn.
"""

from __future__ import annotations

import os

from .figure import PANELS, Panel, figure_size
from .ranks import draw_rank_timing, draw_timeline
from .runs import RunMetrics, read_run
from .traces import read_rank_step

__all__ = [
    "PANELS",
    "Panel",
    "RunMetrics",
    "draw_rank_timing",
    "draw_timeline",
    "figure_size",
    "read_rank_step",
    "read_run",
    "write_report",
]


def write_report(run_dirs: list[str], out: str, *, title: str | None = None) -> dict:
    """Draw the runs under ``run_dirs`` into the PNG ``out`` and the HTML page beside it (``out`` with ``.html``).

    Each run's ``metrics.jsonl`` is read with `read_run` (a step logged twice, by a resumed run, counts once: the
    later record wins). A panel of `PANELS` appears when some run logged its metric; runs are overlaid, one colour
    each, labelled by their directory's name (the whole path when two names clash). A run whose records hold
    ``rank_timing`` tables, or whose ``profile/`` holds traces, gets a row of its own under the curves: the mean time
    per step of each rank by phase (`draw_rank_timing`) beside a timeline of each rank's colo ranges in the last
    step of the newest profiler window (`draw_timeline`).

    Args:
        run_dirs: the runs' output directories (at least one).
        out: the PNG to write (a ``.png`` path; its directory is created).
        title: the figure's and page's title. Default: ``"colo report: "`` and the run labels.

    Returns:
        ``{"png", "html", "size": (width, height), "panels": {panel name: {run label: {"key", "steps", "values"}}},
        "samples": {run label: {"step", "path"}}, "rank_timing": {run label: ...}, "timeline": {run label: ...},
        "runs": {run label: RunMetrics}}``: what was drawn, the arrays read back from the figure's lines and bars
        (`draw_rank_timing` and `draw_timeline` say what their entries hold; a run without rank timing or traces
        has none).

    Raises:
        FileNotFoundError: a run directory, or its ``metrics.jsonl``, does not exist (the message names the path).
        ValueError: no run directory, ``out`` is not a ``.png`` path, a ``metrics.jsonl`` holds no metrics, or a
            trace of a run's newest profiler window is not a Chrome trace with colo ranges (a run killed while
            writing it: the message names the file).
    """
    if not run_dirs:
        raise ValueError("colo report needs at least one run directory")
    if not out.lower().endswith(".png"):
        raise ValueError(f"the report is a PNG: --out {out!r} should end in .png (the HTML page goes beside it)")
    runs = {}
    for run_dir, label in zip(run_dirs, _labels(run_dirs), strict=True):
        runs[label] = read_run(run_dir)
    title = title or "colo report: " + ", ".join(runs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    from .figure import draw
    from .page import write_page

    drawn = draw(runs, out, title=title)
    page = os.path.splitext(out)[0] + ".html"
    write_page(page, png=out, runs=runs, panels=drawn["panels"], title=title)
    return {"png": out, "html": page, **drawn, "runs": runs}


def _labels(run_dirs: list[str]) -> list[str]:
    """Each run's legend label: its directory's name, or the path as given when names repeat."""
    names = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    return [name if names.count(name) == 1 else os.path.normpath(d) for name, d in zip(names, run_dirs, strict=True)]
