"""The report's figure: one panel per metric some run logged, every run overlaid in its own colour, and each diffusion
run's newest sample grid in a column beside the curves (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def figure_size(num_panels: int, *, with_samples: bool) -> tuple[int, int]:
    """The PNG's ``(width, height)`` in pixels for ``num_panels`` panels (plus a column of sample grids)."""
    columns = min(num_panels, PANELS_PER_ROW) + (1 if with_samples else 0)
    rows = max(1, math.ceil(num_panels / PANELS_PER_ROW))
    return round(columns * PANEL_WIDTH_IN * DPI), round(rows * PANEL_HEIGHT_IN * DPI)


def draw(runs: dict[str, RunMetrics], path: str, *, title: str) -> dict:
    """Draw ``runs`` (label -> metrics) into the PNG ``path``.

    Raises:
        ValueError: no run logged any panel's metric.

    Returns:
        ``{"panels": {panel name: {label: {"key", "steps", "values"}}}, "samples": {label: {"step", "path"}},
        "size": (width, height)}``: the arrays are read back from the drawn lines.
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
    width, height = figure_size(len(panels), with_samples=bool(samples))
    # a Figure on its own Agg canvas, not pyplot: no global backend switch, nothing to close
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    columns = min(len(panels), PANELS_PER_ROW) or 1
    rows = max(1, math.ceil(len(panels) / PANELS_PER_ROW))
    outer = figure.add_gridspec(1, 2 if samples else 1, width_ratios=[columns, 1] if samples else None)
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
    handles = [Line2D([], [], color=colours[label], label=label) for label in runs]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(runs), 6), fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.savefig(path, dpi=DPI)
    return {
        "panels": drawn,
        "samples": {label: {"step": step, "path": grid} for label, (step, grid) in samples.items()},
        "size": (width, height),
    }
