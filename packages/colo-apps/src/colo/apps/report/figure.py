"""The report's figure: one panel per metric some run logged, every run overlaid in its own colour, each diffusion
run's newest sample grid in a column beside the curves, and under them a row per run with per-rank timing or profiler
traces (`colo.apps.report.ranks`) (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .ranks import detail_height, draw_rank_timing, draw_timeline, num_ranks
from .runs import RunMetrics


@dataclass(frozen=True)
class Panel:
    """One plot of the report.

    Attributes:
        name: the panel's key in `write_report`'s result.
        title: the plot's title.
        keys: the ``metrics.jsonl`` fields it draws; each run contributes the first one it logged (``grpo/kl`` or
            ``ppo/kl``).
        unit: the y axis label.
        scale: the y values are divided by this for the axis ticks only (bytes shown as MiB).
    """

    name: str
    title: str
    keys: tuple[str, ...]
    unit: str = ""
    scale: float = 1.0


PANELS = (
    Panel("loss", "training loss", ("loss",)),
    Panel("eval_loss", "eval loss", ("eval_loss",)),
    Panel("lr", "learning rate", ("lr",)),
    Panel("grad_norm", "gradient norm", ("grad_norm",)),
    Panel("tokens_per_second", "tokens / s", ("tokens_per_second",)),
    Panel("images_per_s", "images / s", ("images_per_s",)),
    Panel("mfu", "MFU", ("mfu",)),
    Panel("memory", "peak memory", ("memory_bytes", "memory"), "MiB", 2.0**20),
    Panel("reward", "reward (mean)", ("grpo/reward_mean", "ppo/reward_mean")),
    Panel("kl", "KL to the reference", ("grpo/kl", "ppo/kl")),
    Panel("response_length", "response length", ("grpo/response_length", "ppo/response_length"), "tokens"),
    Panel("accuracy", "preference accuracy", ("dpo/accuracy", "rm/accuracy")),
)
"""The panels in order; a panel appears when some run logged one of its keys."""

PANEL_WIDTH_IN = 4.0
PANEL_HEIGHT_IN = 3.0
DPI = 100
PANELS_PER_ROW = 3


def panel_key(panel: Panel, run: RunMetrics) -> str | None:
    """The field of ``run`` that ``panel`` draws, or ``None`` when the run logged none of its keys."""
    return next((key for key in panel.keys if key in run.series), None)


def figure_size(num_panels: int, *, with_samples: bool, rank_rows: tuple[int, ...] = ()) -> tuple[int, int]:
    """The PNG's ``(width, height)`` in pixels for ``num_panels`` panels (plus a column of sample grids, and one
    per-rank row for each entry of ``rank_rows``, the number of ranks it draws; such a row is at least
    `PANELS_PER_ROW` panels wide)."""
    columns = max(min(num_panels, PANELS_PER_ROW), PANELS_PER_ROW if rank_rows else 0) + (1 if with_samples else 0)
    rows = max(1, math.ceil(num_panels / PANELS_PER_ROW))
    height = rows * PANEL_HEIGHT_IN + sum(detail_height(n) for n in rank_rows)
    return round(columns * PANEL_WIDTH_IN * DPI), round(height * DPI)


def draw(runs: dict[str, RunMetrics], path: str, *, title: str) -> dict:
    """Draw ``runs`` (label -> metrics) into the PNG ``path``.

    Raises:
        ValueError: no run logged any panel's metric.

    Returns:
        ``{"panels": {panel name: {label: {"key", "steps", "values"}}}, "samples": {label: {"step", "path"}},
        "rank_timing": {label: ...}, "timeline": {label: ...}, "size": (width, height)}``: the arrays are read back
        from the drawn lines and bars (`draw_rank_timing`, `draw_timeline` say what the per-rank entries hold).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.image import imread
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError:
        raise ImportError("colo report draws with matplotlib: pip install 'colo-apps[report]'") from None

    class ScaledLocator(MaxNLocator):
        """Round ticks in the axis's unit (MiB) on data in another (bytes)."""

        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale

        def tick_values(self, vmin, vmax):
            return super().tick_values(vmin / self.scale, vmax / self.scale) * self.scale

    panels = [p for p in PANELS if any(panel_key(p, run) for run in runs.values())]
    if not panels:
        keys = sorted({key for p in PANELS for key in p.keys})
        raise ValueError(f"none of {', '.join(r.run_dir for r in runs.values())} logged a metric to plot ({keys})")
    samples = {label: run.sample_grid for label, run in runs.items() if run.sample_grid is not None}
    per_rank = {label: run for label, run in runs.items() if num_ranks(run)}
    rank_rows = tuple(num_ranks(run) for run in per_rank.values())
    width, height = figure_size(len(panels), with_samples=bool(samples), rank_rows=rank_rows)
    # a Figure on its own Agg canvas, not pyplot: no global backend switch, nothing to close
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    columns = min(len(panels), PANELS_PER_ROW) or 1
    rows = max(1, math.ceil(len(panels) / PANELS_PER_ROW))
    outer = figure.add_gridspec(
        1 + len(rank_rows),
        2 if samples else 1,
        width_ratios=[width / (PANEL_WIDTH_IN * DPI) - 1, 1] if samples else None,
        height_ratios=[rows * PANEL_HEIGHT_IN, *(detail_height(n) for n in rank_rows)],
    )
    curves = outer[0, 0].subgridspec(rows, columns)
    colours = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    drawn: dict[str, dict] = {}
    for i, panel in enumerate(panels):
        axes = figure.add_subplot(curves[i // columns, i % columns])
        axes.set_title(panel.title, fontsize=9)
        axes.set_xlabel("step", fontsize=8)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.unit:
            axes.set_ylabel(panel.unit, fontsize=8)
        if panel.scale != 1.0:
            axes.yaxis.set_major_locator(ScaledLocator(panel.scale))
            axes.yaxis.set_major_formatter(FuncFormatter(lambda y, _, s=panel.scale: f"{y / s:g}"))
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
        drawn[panel.name] = {}
        for label, run in runs.items():
            key = panel_key(panel, run)
            if key is None:
                continue
            steps, values = run.series[key]
            marker = "o" if len(steps) <= 20 or panel.name == "eval_loss" else None
            (line,) = axes.plot(steps, values, color=colours[label], marker=marker, markersize=3, label=label)
            drawn[panel.name][label] = {
                "key": key,
                "steps": [int(s) for s in line.get_xdata()],
                "values": [float(v) for v in line.get_ydata()],
            }
    if samples:
        column = outer[0, 1].subgridspec(len(samples), 1)
        for i, (label, (step, grid)) in enumerate(samples.items()):
            axes = figure.add_subplot(column[i, 0])
            axes.imshow(imread(grid))
            axes.set_title(f"{label}: samples at step {step}", fontsize=9)
            axes.axis("off")
    rank_timing, timeline = {}, {}
    total_columns = round(width / (PANEL_WIDTH_IN * DPI))
    for i, (label, run) in enumerate(per_rank.items()):
        parts = [part for part, present in (("timing", run.rank_timing), ("timeline", run.profile_window)) if present]
        ratios = [1, total_columns - 1] if len(parts) == 2 else [1]
        row = outer[1 + i, :].subgridspec(1, len(parts), width_ratios=ratios)
        for j, part in enumerate(parts):
            axes = figure.add_subplot(row[0, j])
            if part == "timing":
                rank_timing[label] = draw_rank_timing(axes, run, label)
            else:
                timeline[label] = draw_timeline(axes, run, label)
    handles = [Line2D([], [], color=colours[label], label=label) for label in runs]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(runs), 6), fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.savefig(path, dpi=DPI)
    return {
        "panels": drawn,
        "samples": {label: {"step": step, "path": grid} for label, (step, grid) in samples.items()},
        "rank_timing": rank_timing,
        "timeline": timeline,
        "size": (width, height),
    }
