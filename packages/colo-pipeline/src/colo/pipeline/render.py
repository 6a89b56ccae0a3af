"""Timeline pictures of a simulated (or measured) schedule: text for terminals, PNG through matplotlib.

``render_text(simulate(one_f_one_b(4, 8)))`` prints one row per rank, one cell per time quantum::

    rank 0 |F0 F1 F2 F3 . . . . . . BW0   F4 BW1   F5 ...
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .actions import Action
from .simulate import SimulationResult, TimelineEvent

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "BW": "#8172B3"}
"""Fill colour of each compute op in the PNG."""


def _label(action: Action) -> str:
    return f"{action.op}{action.microbatch}" + (f".{action.chunk}" if action.chunk else "")


def _compute_events(events: Sequence[TimelineEvent]) -> list[TimelineEvent]:
    return [e for e in events if isinstance(e.action, Action) and e.end > e.start]


def render_text(result: SimulationResult, *, quantum: float | None = None, cell: int | None = None) -> str:
    """The timeline as text: a row per rank, ``cell`` characters per ``quantum`` of time, ``.`` when idle.

    Args:
        result: a `SimulationResult` (from `simulate`, or built from measured events).
        quantum: time per cell; default: the shortest compute action.
        cell: characters per cell; default: the longest one-quantum label plus a space.
    """
    events = _compute_events(result.events)
    if not events:
        return "(empty timeline)"
    if cell is None:
        shortest = min(e.end - e.start for e in events)
        cell = 1 + max(len(_label(e.action)) for e in events if e.end - e.start <= shortest * 1.5)
    quantum = quantum or min(e.end - e.start for e in events)
    origin = min(e.start for e in result.events)
    num_ranks = len(result.busy)
    num_cells = int(round(result.makespan / quantum))
    rows = []
    for rank in range(num_ranks):
        line = ["." + " " * (cell - 1)] * num_cells
        for event in (e for e in events if e.rank == rank):
            first = int(round((event.start - origin) / quantum))
            count = max(1, int(round((event.end - event.start) / quantum)))
            text = _label(event.action).ljust(cell * count)[: cell * count]
            for k in range(count):
                if first + k < num_cells:
                    line[first + k] = text[k * cell : (k + 1) * cell]
        rows.append(f"rank {rank} |" + "".join(line).rstrip())
    schedule = result.schedule
    header = (
        f"{schedule.name}: p={schedule.num_ranks} m={schedule.num_microbatches} v={schedule.num_chunks}  "
        f"makespan {result.makespan:g}  bubble {result.bubble_ratio:.1%}  "
        f"peak live activations {list(result.peak_live_activations)}"
    )
    return "\n".join([header, *rows])


def render_png(result: SimulationResult, path: str | Path, *, title: str | None = None) -> Path:
    """Draw the timeline as a PNG (needs matplotlib: ``pip install colo-pipeline[render]``).

    ``F`` blue, ``B`` green, ``W`` orange, fused ``BW`` purple; later model chunks are drawn lighter; each box
    is labelled with its microbatch.

    Args:
        result: the timeline to draw.
        path: where to write the PNG.
        title: the figure title; default: schedule name, sizes, bubble ratio and peak activations.

    Returns:
        The path written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("render_png needs matplotlib: pip install 'colo-pipeline[render]'") from error

    events = _compute_events(result.events)
    schedule = result.schedule
    num_ranks = len(result.busy)
    origin = min((e.start for e in result.events), default=0.0)
    width = max(6.0, min(24.0, result.makespan * 0.35))
    fig, ax = plt.subplots(figsize=(width, 0.55 * num_ranks + 1.2), dpi=110)
    for event in events:
        action = event.action
        alpha = 1.0 - 0.45 * (action.chunk / max(1, schedule.num_chunks - 1)) if schedule.num_chunks > 1 else 1.0
        y = num_ranks - 1 - event.rank
        ax.barh(
            y,
            event.end - event.start,
            left=event.start - origin,
            height=0.8,
            color=COLORS[action.op],
            alpha=alpha,
            edgecolor="white",
            linewidth=0.6,
        )
        ax.text(
            (event.start + event.end) / 2 - origin,
            y,
            str(action.microbatch),
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_yticks(range(num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(num_ranks))])
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    ax.set_title(
        title
        or (
            f"{schedule.name}  p={schedule.num_ranks} m={schedule.num_microbatches} v={schedule.num_chunks}  "
            f"bubble {result.bubble_ratio:.1%}  peak live activations {max(result.peak_live_activations)}"
        ),
        fontsize=10,
    )
    used = sorted({e.action.op for e in events}, key=list(COLORS).index)
    ax.legend(
        handles=[Patch(color=COLORS[op], label=op) for op in used],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
