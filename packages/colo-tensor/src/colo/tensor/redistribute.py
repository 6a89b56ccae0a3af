"""Redistribution between two layouts: plan a cheapest sequence of per-axis steps, report its volume, run it.

Each step changes the placement of one mesh axis:

==========================  ====================================================  ===================
from -> to (one axis)       how                                                   volume per rank
==========================  ====================================================  ===================
Replicate -> Shard(d)       local slice                                           0
Replicate -> Partial        local: coordinate 0 keeps the value, others zeros     0
                            (``avg``/``max``: every rank keeps it)
Shard(d) -> Partial         local: the piece padded with zeros (``max``: -inf)    0
                            (not for ``avg``, which goes through Replicate)
Shard(d) -> Replicate       all_gather along d (uneven pieces: colo pads)         ``S - own``
Shard(d) -> Shard(e)        all_to_all of the blocks, split sizes per rank        ``S - own``
Partial -> Replicate        all_reduce                                            ``2 (n-1)/n S``
Partial -> Shard(d)         reduce_scatter; uneven extents are padded to          ``(n-1)/n S_pad``
                            ``n * ceil(E / n)``, or all_reduce + slice where      or ``2 (n-1)/n S``
                            padding would move more
==========================  ====================================================  ===================

Volumes are the `colo.comm.CommTracker` formulas (``bytes``), so a test can check that the tracker measures
exactly what `plan_redistribute` planned. An axis of size 1 needs no communication at all.

A shard of dimension d on axis i can only change while no inner axis (j > i) also shards d: shards nest outer
axis first, so the inner ones are gathered first. The planner is a shortest-path search over the placements of
every axis (each axis taking its source, its destination or `Replicate`), so it also orders the steps to shrink
the tensor before gathering it. The search costs are rank-independent (mean piece sizes), so every rank runs the
same sequence of collectives; uneven pieces only change the per-rank volumes reported.
"""

from __future__ import annotations

import functools
import heapq
import math

import torch

from ._transforms import run_step
from .layout import Layout, PlacementsLike, require_layout, set_layout
from .placement import Placement, Replicate, Shard, chunk_size
from .redistribute_plan import RedistributePlan, RedistributeStep

# --- the search ---------------------------------------------------------------------------------------------


def _transition_kind(old: Placement, new: Placement) -> str | None:
    """How one axis goes from ``old`` to ``new`` directly, or ``None`` when it must go through Replicate."""
    if isinstance(old, Replicate):
        return "slice" if isinstance(new, Shard) else "to_partial"
    if isinstance(old, Shard):
        if isinstance(new, Replicate):
            return "all_gather"
        if isinstance(new, Shard):
            return "all_to_all"
        return "to_partial" if new.reduce in ("sum", "max") else None
    if isinstance(new, Replicate):
        return "all_reduce"
    if isinstance(new, Shard):
        return "reduce_scatter"
    return None  # Partial -> another Partial goes through Replicate


def _valid(state: tuple[Placement, ...], axis: int, new: Placement) -> bool:
    """Whether ``axis`` may go to ``new`` in ``state``: shards on one dimension nest, outer axis first."""
    old = state[axis]
    inner = state[axis + 1 :]
    if isinstance(old, Shard) and old in inner:
        return False  # an inner axis still splits this axis's pieces; gather it first
    if isinstance(new, Shard) and new in inner:
        return False  # an inner axis already splits this dimension; this axis would have to split it first
    return _transition_kind(old, new) is not None


def _mean_numel(layout_shape: torch.Size, state: tuple[Placement, ...], sizes: tuple[int, ...]) -> float:
    shards = math.prod(n for n, p in zip(sizes, state) if isinstance(p, Shard))
    return math.prod(layout_shape) / shards


def _search_cost(kind: str, n: int, mean_before: float) -> float:
    """Rank-independent cost of a step in elements (mean piece sizes), used only to choose the path."""
    if n == 1 or kind in ("slice", "to_partial"):
        return 0.0
    if kind == "all_gather":
        return (n - 1) * mean_before
    if kind == "all_reduce":
        return 2 * (n - 1) / n * mean_before
    return (n - 1) / n * mean_before  # reduce_scatter, all_to_all


def _search(src: Layout, dst: Layout) -> tuple[tuple[int, Placement], ...]:
    """A cheapest sequence of ``(axis index, new placement)`` from ``src`` to ``dst``."""
    return _cheapest_path(tuple(src.mesh.shape.values()), src.global_shape, src.placements, dst.placements)


@functools.lru_cache(maxsize=4096)
def _cheapest_path(
    sizes: tuple[int, ...], global_shape: torch.Size, start: tuple[Placement, ...], goal: tuple[Placement, ...]
) -> tuple[tuple[int, Placement], ...]:
    """Dijkstra over the per-axis placements; depends on nothing rank-specific, so every rank gets the same path."""
    options = []
    for old, new in zip(start, goal):
        choices = [old]
        for extra in (new, Replicate()):
            if extra not in choices:
                choices.append(extra)
        options.append(choices)
    counter = 0
    heap: list = [(0.0, 0, (), counter, start, ())]
    settled: set[tuple[Placement, ...]] = set()
    while heap:
        cost, num_steps, key, _, state, path = heapq.heappop(heap)
        if state in settled:
            continue
        settled.add(state)
        if state == goal:
            return path
        mean_before = _mean_numel(global_shape, state, sizes)
        for axis, choices in enumerate(options):
            for new in choices:
                if new == state[axis] or not _valid(state, axis, new):
                    continue
                following = state[:axis] + (new,) + state[axis + 1 :]
                if following in settled:
                    continue
                step_cost = _search_cost(_transition_kind(state[axis], new), sizes[axis], mean_before)
                counter += 1
                heapq.heappush(
                    heap,
                    (
                        cost + step_cost,
                        num_steps + 1,
                        key + ((axis, repr(new)),),
                        counter,
                        following,
                        path + ((axis, new),),
                    ),
                )
    raise AssertionError(f"no path from {start} to {goal}; every layout reaches all-Replicate")  # unreachable


# --- per-rank volumes -----------------------------------------------------------------------------------------


def _make_step(axis_name: str, before: Layout, after: Layout, itemsize: int) -> RedistributeStep:
    old, new = before.placement(axis_name), after.placement(axis_name)
    kind = _transition_kind(old, new)
    n = before.mesh.size(axis_name)
    me = before.mesh.coord[axis_name]
    shape = before.local_shape()

    def step(kind: str, collective: str | None, volume: float = 0.0, note: str = "") -> RedistributeStep:
        return RedistributeStep(axis_name, old, new, kind, collective, float(volume), before, after, note)

    if n == 1:
        return step("local", None, note="axis of size 1")
    if kind in ("slice", "to_partial"):
        return step(kind, None)
    if kind == "all_reduce":
        numel = math.prod(shape)
        return step(kind, "all_reduce" if numel else None, 2 * (n - 1) / n * numel * itemsize)
    if kind == "all_gather":
        dim = old.dim
        split = before.split_sizes(axis_name)
        inner = math.prod(s for i, s in enumerate(shape) if i != dim)
        total = sum(split) * inner
        return step(kind, "all_gather" if total else None, (sum(split) - split[me]) * inner * itemsize)
    if kind == "all_to_all":
        own_split = before.split_sizes(axis_name)
        new_split = after.split_sizes(axis_name)
        rest = math.prod(s for i, s in enumerate(shape) if i not in (old.dim, new.dim))
        total = sum(own_split) * shape[new.dim] * rest
        volume = own_split[me] * (shape[new.dim] - new_split[me]) * rest * itemsize
        return step(kind, "all_to_all" if total else None, volume)
    # Partial -> Shard(d): reduce_scatter, padded when the extent does not divide, unless all_reduce is cheaper
    dim = new.dim
    extent = shape[dim]
    inner = math.prod(s for i, s in enumerate(shape) if i != dim)
    if extent * inner == 0:
        return step("reduce_scatter", None)
    padded = n * chunk_size(extent, n)
    scatter_volume = (n - 1) / n * padded * inner * itemsize
    reduce_volume = 2 * (n - 1) / n * extent * inner * itemsize
    if padded == extent:
        return step("reduce_scatter", "reduce_scatter", scatter_volume)
    if scatter_volume <= reduce_volume:
        return step("reduce_scatter", "reduce_scatter", scatter_volume, f"dim {dim} padded from {extent} to {padded}")
    return step(
        "all_reduce_slice",
        "all_reduce",
        reduce_volume,
        f"dim {dim} of extent {extent} < {n} ranks: padding to {padded} would move more than an all_reduce",
    )


def plan_redistribute(src: Layout, dst: Layout, *, dtype: torch.dtype = torch.float32) -> RedistributePlan:
    """A cheapest sequence of per-axis steps from layout ``src`` to ``dst``, with this rank's planned volume.

    Args:
        src: the layout the tensor has.
        dst: the layout wanted: same mesh and global shape.
        dtype: element type, for the volumes in bytes.

    Returns:
        The `RedistributePlan`; ``plan.bytes`` is what a `CommTracker` measures on this rank when
        `redistribute` runs it.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise TypeError("plan_redistribute(src, dst): both must be Layouts")
    if src.with_placements(src.placements) != dst.with_placements(src.placements):
        raise ValueError(
            f"plan_redistribute: {src} and {dst} differ in mesh or global shape; redistribution only changes placements"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    names = src.mesh.axis_names
    steps = []
    before = src
    for axis, new in _search(src, dst):
        placements = list(before.placements)
        placements[axis] = new
        after = before.with_placements(placements)
        steps.append(_make_step(names[axis], before, after, itemsize))
        before = after
    return RedistributePlan(src, dst, tuple(steps))


def redistribute(tensor: torch.Tensor, placements: PlacementsLike) -> torch.Tensor:
    """Move a distributed tensor to new placements on the same mesh, with the cheapest planned collectives.

    Every rank of the mesh must call it with the same placements. It is not differentiable (the result does not
    require grad); inside models use the autograd functions of `colo.tensor.comm_ops`.

    Args:
        tensor: a local piece with a layout (from `distribute`, `redistribute` or a parallel layer).
        placements: one placement per mesh axis, or a mapping ``axis -> placement`` (missing axes `Replicate`).

    Returns:
        The new local piece with its layout attached (``tensor`` itself when nothing changes).
    """
    src = require_layout(tensor, "redistribute")
    dst = src.with_placements(placements)
    if dst == src:
        return tensor
    plan = plan_redistribute(src, dst, dtype=tensor.dtype)
    with torch.no_grad():
        local = tensor.detach()
        for step in plan.steps:
            local = run_step(step, local)
    if local is tensor:
        local = tensor.detach()
    return set_layout(local, dst)


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (every axis redistributed to `Replicate`); every rank must call it."""
    layout = require_layout(tensor, "gather")
    return redistribute(tensor, [Replicate()] * len(layout.placements))
