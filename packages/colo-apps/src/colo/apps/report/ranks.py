"""The report's per-rank panels, one row of the figure per run that has them: the time per step of each rank by phase
(``logging.rank_timing``) and a timeline of each rank's colo ranges in one profiled step (``profile.every_steps``)."""

from __future__ import annotations

import statistics

from .runs import RANK_PHASES, RunMetrics
from .traces import KINDS, read_rank_step

KIND_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "optimizer": "#55a868",
    "communication": "#c44e52",
    "pipeline": "#8172b3",
    "checkpoint": "#937860",
    "other": "#8c8c8c",
}
"""The colour of each range kind (`colo.apps.report.traces.KINDS`); a rank-timing phase takes its kind's."""
PHASE_KINDS = {
    "forward_s": "forward",
    "backward_s": "backward",
    "optimizer_s": "optimizer",
    "comm_wait_s": "communication",
}
"""The range kind whose colour each rank-timing phase is drawn in."""
PHASE_LABELS = {phase: phase.removesuffix("_s").replace("_", " ") for phase in PHASE_KINDS}
BUSY = ("forward_s", "backward_s", "optimizer_s")
"""The phases that make a rank slow (the trainer's rule, `colo.apps.train.rank_timing`)."""
SLOWEST_COLOUR = "#c00000"


def detail_height(num_ranks: int) -> float:
    """The height in inches of a run's per-rank row for ``num_ranks`` ranks."""
    return max(3.0, 1.4 + 0.35 * num_ranks)


def num_ranks(run: RunMetrics) -> int:
    """How many rank rows ``run``'s per-rank panels draw (0: it has neither rank timing nor traces)."""
    timing = len(run.rank_timing[max(run.rank_timing)]) if run.rank_timing else 0
    traced = len(run.profile_window[1]) if run.profile_window else 0
    return max(timing, traced)


def _slowest(table: dict[int, dict[str, float]]) -> int:
    return max(table, key=lambda rank: sum(table[rank][phase] for phase in BUSY))


def draw_rank_timing(axes, run: RunMetrics, label: str) -> dict:
    """Stacked horizontal bars, one per rank, of its forward / backward / optimizer / comm wait ms per step: the mean
    over the logged records with the last record's ranks (a run resumed on another number of ranks keeps its newest
    part). The slowest rank (most forward + backward + optimizer time, as the trainer names it) is marked with its
    lag over the median rank; each rank's label says in how many records it was the slowest.

    Returns:
        ``{"steps", "ranks", "ms": {phase: [per rank]}, "slowest", "lag", "slowest_records": {rank: count}}``: the
        bars' widths read back from the figure.
    """
    last_ranks = list(run.rank_timing[max(run.rank_timing)])
    records = {step: table for step, table in run.rank_timing.items() if list(table) == last_ranks}
    steps = list(records)
    means = {
        rank: {phase: statistics.fmean(records[s][rank][phase] for s in steps) for phase in RANK_PHASES}
        for rank in last_ranks
    }
    slowest = _slowest(means)
    busy = [sum(means[rank][phase] for phase in BUSY) for rank in last_ranks]
    median = statistics.median(busy)
    lag = busy[last_ranks.index(slowest)] / median - 1.0 if median > 0 else 0.0
    slowest_records = {rank: 0 for rank in last_ranks}
    for table in records.values():
        slowest_records[_slowest(table)] += 1

    positions = list(range(len(last_ranks)))
    left = [0.0] * len(last_ranks)
    drawn_ms = {}
    for phase in RANK_PHASES:
        widths = [means[rank][phase] * 1e3 for rank in last_ranks]
        bars = axes.barh(
            positions, widths, left=left, height=0.6, color=KIND_COLOURS[PHASE_KINDS[phase]], label=PHASE_LABELS[phase]
        )
        drawn_ms[phase] = [float(bar.get_width()) for bar in bars]
        left = [start + width for start, width in zip(left, widths, strict=True)]
    row = last_ranks.index(slowest)
    axes.text(left[row], row, f"  slowest {lag:+.0%}", va="center", fontsize=7, color=SLOWEST_COLOUR)
    axes.set_yticks(positions, [f"rank {rank} ({slowest_records[rank]}/{len(steps)})" for rank in last_ranks])
    axes.get_yticklabels()[row].set(color=SLOWEST_COLOUR, fontweight="bold")
    axes.set_ylim(len(last_ranks) - 0.5, -0.5)  # rank 0 on top, as in the timeline
    axes.set_xlim(0, max(left) * 1.3 if max(left) > 0 else 1.0)  # room for the mark
    which = f"mean of {len(steps)} logged records" if len(steps) > 1 else "1 logged record"
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    axes.set_title(f"{label}: time per step by rank\n({which}, {span}; label: slowest in n/records)", fontsize=9)
    axes.set_xlabel("ms per step", fontsize=8)
    axes.tick_params(labelsize=7)
    axes.grid(axis="x", alpha=0.3)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2, frameon=False)
    return {
        "steps": steps,
        "ranks": last_ranks,
        "ms": drawn_ms,
        "slowest": slowest,
        "lag": lag,
        "slowest_records": slowest_records,
    }


def draw_timeline(axes, run: RunMetrics, label: str) -> dict:
    """A Gantt chart of the newest profiler window: one row per rank (rank 0 on top), its last profiled step's colo
    ranges as bars coloured by `KINDS`, nested ranges thinner over their parent (one lane per depth), the step's
    extent shaded behind; time in ms from each rank's own step start (ranks' clocks are not compared).

    Returns:
        ``{"step": N, "ranks": {rank: {"path", "profiler_step", "duration_ms", "bars": [{"name", "kind",
        "start_ms", "duration_ms", "depth"}]}}}``: the bars' positions read back from the figure, in the trace's
        start order.

    Raises:
        ValueError: a trace of the window is not a Chrome trace or holds no colo range (the message names it).
    """
    window_step, paths = run.profile_window
    steps = {rank: read_rank_step(path) for rank, path in paths.items()}
    drawn_ranks = {}
    kinds_seen = set()
    for row, (rank, step) in enumerate(steps.items()):
        axes.barh(row, step.duration_ms, height=0.9, color="#e8e8e8", zorder=1)
        bars_drawn = []
        for depth in sorted({r.depth for r in step.ranges}):
            lane = [r for r in step.ranges if r.depth == depth]
            bars = axes.barh(
                [row] * len(lane),
                [r.duration_ms for r in lane],
                left=[r.start_ms for r in lane],
                height=0.7 * 0.6**depth,
                color=[KIND_COLOURS[r.kind] for r in lane],
                linewidth=0,
                zorder=2 + depth,
            )
            bars_drawn += [(r, bar) for r, bar in zip(lane, bars, strict=True)]
        kinds_seen |= {r.kind for r in step.ranges}
        order = {id(r): i for i, r in enumerate(step.ranges)}
        bars_drawn.sort(key=lambda pair: order[id(pair[0])])
        drawn_ranks[rank] = {
            "path": step.path,
            "profiler_step": step.profiler_step,
            "duration_ms": step.duration_ms,
            "bars": [
                {
                    "name": r.name,
                    "kind": r.kind,
                    "start_ms": float(bar.get_x()),
                    "duration_ms": float(bar.get_width()),
                    "depth": r.depth,
                }
                for r, bar in bars_drawn
            ],
        }
    longest = max(step.duration_ms for step in steps.values()) or 1.0
    for row, step in enumerate(steps.values()):  # name the top-level ranges wide enough to hold it
        for r in step.ranges:
            if r.depth == 0 and r.duration_ms > 0.08 * longest:
                text = r.name.removeprefix("colo.")
                axes.text(r.start_ms + r.duration_ms / 2, row - 0.25, text, ha="center", va="center", fontsize=6)
    axes.set_yticks(range(len(steps)), [f"rank {rank}" for rank in steps])
    axes.set_ylim(len(steps) - 0.5, -0.5)
    axes.set_xlim(0, longest * 1.02)
    numbers = {step.profiler_step for step in steps.values()}
    which = f", ProfilerStep#{numbers.pop()}" if len(numbers) == 1 and None not in numbers else ""
    axes.set_title(
        f"{label}: colo ranges of each rank's last profiled step\n(window ending at step {window_step}{which}; "
        "nested ranges thinner, over their parent)",
        fontsize=9,
    )
    axes.set_xlabel("ms from the rank's step start", fontsize=8)
    axes.tick_params(labelsize=7)
    axes.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color=KIND_COLOURS[kind], label=kind) for kind in KINDS if kind in kinds_seen]
    axes.legend(
        handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=len(handles), frameon=False
    )
    return {"step": window_step, "ranks": drawn_ranks}
