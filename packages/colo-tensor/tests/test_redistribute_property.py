"""Property: for random meshes, shapes and pairs of layouts A, B,
``gather(redistribute(distribute(x, A), B)) == x``, every local piece is the matching slice of x, and the
`CommTracker` measures exactly the volume `plan_redistribute` planned.

Cases are drawn by hypothesis in the pytest process (derandomized, no example database) and one batch is
shipped to the ranks per hypothesis example: every rank must run the same cases, or they hang. Values are small
integers in float32, so every reduction is exact in any order and the comparisons are bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import (
    Partial,
    Replicate,
    Shard,
    distribute,
    gather,
    layout_of,
    plan_redistribute,
    redistribute,
)

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

MESH_SHAPES = {
    2: [{"a": 2}, {"a": 1, "b": 2}, {"a": 2, "b": 1}],
    4: [{"a": 4}, {"a": 2, "b": 2}, {"a": 1, "b": 4}, {"a": 4, "b": 1}],
}
BATCH = 40


def _tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 51, shape, generator=generator).float()


@st.composite
def _case(draw, world_size: int):
    mesh_shape = draw(st.sampled_from(MESH_SHAPES[world_size]))
    ndim = draw(st.integers(1, 3))
    # extents 0-9: mostly uneven over 2 or 4 ranks, some empty dimensions and empty trailing shards
    shape = tuple(draw(st.lists(st.sampled_from([5, 3, 7, 2, 4, 6, 8, 1, 9, 0]), min_size=ndim, max_size=ndim)))
    shards = [Shard(dim) for dim in range(ndim)]
    placement = st.sampled_from(
        [Replicate(), Partial("sum"), Partial("avg"), Partial("max")] + shards * (4 if ndim == 1 else 2)
    )
    src = tuple(draw(placement) for _ in mesh_shape)
    dst = tuple(draw(placement) for _ in mesh_shape)
    return mesh_shape, shape, src, dst, draw(st.integers(0, 2**16))


def _run_batch(batch):
    results = []
    for mesh_shape, shape, src, dst, seed in batch:
        mesh = Mesh(**mesh_shape)
        x = _tensor(shape, seed)
        a = distribute(x, mesh, src)
        plan = plan_redistribute(layout_of(a), layout_of(a).with_placements(dst))
        with CommTracker() as tracker:
            b = redistribute(a, dst)
        assert layout_of(b).placements == dst
        full = gather(b)
        results.append((mesh.coord, a, b, full, plan.bytes, tracker.bytes(), str(plan)))
    return results


def _reference_piece(x, mesh_shape, placements, coord):
    """The slice of x at ``coord``, by nested ``torch.chunk`` (outer axis first) with empty trailing chunks."""
    piece = x
    for (axis, n), placement in zip(mesh_shape.items(), placements):
        if isinstance(placement, Shard):
            chunks = list(torch.chunk(piece, n, dim=placement.dim)) if piece.shape[placement.dim] else []
            empty = piece.narrow(placement.dim, piece.shape[placement.dim], 0)
            piece = (chunks + [empty] * n)[coord[axis]]
    return piece


def _reduced_piece(pieces_by_coord, mesh_shape, placements, coord):
    """What the partial pieces reduce to at ``coord``: reduce over each partial axis, innermost first."""
    axes = list(mesh_shape)
    partial = [a for a, p in zip(axes, placements) if isinstance(p, Partial)]

    def value(point, remaining):
        if not remaining:
            return pieces_by_coord[tuple(point[a] for a in axes)]
        axis = remaining[-1]
        values = torch.stack([value(dict(point, **{axis: i}), remaining[:-1]) for i in range(mesh_shape[axis])])
        reduce = placements[axes.index(axis)].reduce
        return {"sum": values.sum(0), "avg": values.mean(0), "max": values.amax(0)}[reduce]

    return value(coord, partial)


def _check(batch, per_rank):
    for index, (mesh_shape, shape, src, dst, seed) in enumerate(batch):
        x = _tensor(shape, seed)
        results = [rank_results[index] for rank_results in per_rank]
        for placements, slot in ((src, 1), (dst, 2)):
            pieces = {tuple(r[0].values()): r[slot] for r in results}
            for coord, *_ in results:
                got = _reduced_piece(pieces, mesh_shape, placements, coord)
                expected = _reference_piece(x, mesh_shape, placements, coord)
                assert torch.equal(got, expected), (mesh_shape, shape, placements, coord, got, expected)
        for coord, _, _, full, planned, measured, plan in results:
            assert torch.equal(full, x), (mesh_shape, shape, src, dst, coord)
            assert measured == pytest.approx(planned, rel=1e-12), (coord, plan, measured)


SETTINGS = hypothesis.settings(
    derandomize=True,  # the same cases on every run and machine
    database=None,  # no example database: nothing replayed from earlier runs
    max_examples=8,  # batches, each of BATCH cases in one run_distributed call
    deadline=None,
    suppress_health_check=[
        hypothesis.HealthCheck.too_slow,
        hypothesis.HealthCheck.data_too_large,
        hypothesis.HealthCheck.large_base_example,
    ],
)


@SETTINGS
@hypothesis.given(st.lists(_case(2), min_size=BATCH, max_size=BATCH))
def test_round_trip_on_2_ranks(batch):
    _check(batch, run_distributed(_run_batch, batch, world_size=2))


@SETTINGS
@hypothesis.given(st.lists(_case(4), min_size=BATCH, max_size=BATCH))
def test_round_trip_on_4_ranks(batch):
    # 4 ranks: the only way to get two axes of size 2, where shards nest and partial axes combine
    _check(batch, run_distributed(_run_batch, batch, world_size=4))
