"""colo.pipeline's simulator for the planner: a schedule's makespan and peak live activations per rank.

A step of ``M`` microbatches is simulated with ``min(M, pp)`` of them (a multiple of ``pp``, as interleaved 1F1B
needs); past the warm-up a 1F1B-style schedule is in its steady state, each further microbatch adding one forward
and one backward of every model chunk to every rank, so the makespan is extended by that and the peak live
activations do not change (GPipe keeps every microbatch alive: ``M`` per chunk).
"""

from __future__ import annotations

import functools

from .layout import Layout


def _simulated_microbatches(layout: Layout) -> int:
    pp, microbatches = layout.pp, layout.num_microbatches
    cap = pp
    if microbatches <= cap:
        return microbatches
    return cap  # a multiple of pp, as interleaved 1F1B needs


@functools.lru_cache(maxsize=256)
def _schedule(name: str, pp: int, microbatches: int, chunks: int):
    from colo.pipeline import make_schedule

    return make_schedule(name, pp, microbatches, num_chunks=chunks)


@functools.lru_cache(maxsize=1024)
def _run(
    name: str, pp: int, microbatches: int, chunks: int, forward: float, b_input: float, b_weight: float, p2p: float
):
    from colo.pipeline import CostModel, simulate

    schedule = _schedule(name, pp, microbatches, chunks)
    cost = CostModel(forward=forward, backward_input=b_input, backward_weight=b_weight, p2p=p2p)
    result = simulate(schedule, cost, check=False)
    return result.makespan, result.peak_live_activations


def pipeline_makespan(layout: Layout, *, forward: float, backward_input: float, backward_weight: float, p2p: float):
    """Seconds of the schedule's step for per-chunk F / B / W times and one p2p transfer time."""
    simulated = _simulated_microbatches(layout)
    unit = forward or 1.0  # the makespan scales with the costs: simulate the ratios (3 significant digits), reuse them
    ratios = [float(f"{value / unit:.3g}") for value in (backward_input, backward_weight, p2p)]
    makespan, _ = _run(layout.schedule, layout.pp, simulated, layout.num_model_chunks, 1.0, *ratios)
    makespan *= unit
    per_microbatch = layout.num_model_chunks * (forward + backward_input + backward_weight)
    return makespan + (layout.num_microbatches - simulated) * per_microbatch


def peak_live_activations(layout: Layout, pp_rank: int) -> int:
    """The most (microbatch, model chunk) pairs whose activations ``pp_rank`` holds at once."""
    if layout.schedule == "gpipe":
        return layout.num_microbatches * layout.num_model_chunks
    simulated = _simulated_microbatches(layout)
    _, live = _run(layout.schedule, layout.pp, simulated, layout.num_model_chunks, 1.0, 1.0, 1.0, 0.0)
    return live[pp_rank]
