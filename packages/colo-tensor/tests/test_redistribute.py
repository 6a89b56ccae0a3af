"""Redistribution plans: each single-axis change uses the expected collective, the planned volume is the
`CommTracker` formula, and the tracker measures exactly that volume. Values are small integers in float32, so
every result is exact."""

from __future__ import annotations

import pytest
import torch

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import Partial, Replicate, Shard, distribute, gather, layout_of, plan_redistribute, redistribute

F32 = 4  # bytes per element


def _tensor(shape):
    return torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(0)).float()


def _run(mesh_shape, shape, src, dst):
    """Plan, run under a tracker and gather; return what the test compares."""
    mesh = Mesh(**mesh_shape)
    x = _tensor(shape)
    a = distribute(x, mesh, src)
    plan = plan_redistribute(layout_of(a), layout_of(a).with_placements(dst))
    with CommTracker() as tracker:
        b = redistribute(a, dst)
    expected_local = distribute(x, mesh, dst)
    local_ok = bool(layout_of(b).partial_axes) or torch.equal(b, expected_local)
    return {
        "coord": mesh.coord,
        "steps": [(s.axis, s.kind, s.collective) for s in plan.steps],
        "planned": plan.bytes,
        "planned_by_op": {op: plan.bytes_by(op) for op in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")},
        "measured": tracker.bytes(),
        "measured_by_op": {
            op: tracker.bytes(op) for op in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
        },
        "calls": tracker.calls(),
        "num_collectives": plan.num_collectives,
        "local_ok": local_ok,
        "round_trip": torch.equal(gather(b), x),
        "notes": [s.note for s in plan.steps],
    }


def _check(results, steps, volume_of):
    """Every rank: the expected steps, volume_of(coord) planned and measured, correct pieces and round trip."""
    for result in results:
        assert result["steps"] == steps
        assert result["planned"] == pytest.approx(volume_of(result["coord"]))
        assert result["measured"] == pytest.approx(result["planned"])
        assert result["measured_by_op"] == pytest.approx(result["planned_by_op"])
        assert result["calls"] == result["num_collectives"]
        assert result["local_ok"] and result["round_trip"]
    return results


# (src, dst, expected steps, bytes per rank) on Mesh(tp=2) for an (8, 6) float32 tensor (192 bytes)
SINGLE_AXIS = {
    "shard_to_replicate": ([Shard(0)], [Replicate()], [("tp", "all_gather", "all_gather")], (8 - 4) * 6 * F32),
    "replicate_to_shard": ([Replicate()], [Shard(1)], [("tp", "slice", None)], 0),
    "partial_to_replicate": ([Partial()], [Replicate()], [("tp", "all_reduce", "all_reduce")], 2 * 1 / 2 * 192),
    "partial_to_shard": ([Partial("avg")], [Shard(0)], [("tp", "reduce_scatter", "reduce_scatter")], 1 / 2 * 192),
    "shard_to_shard": ([Shard(0)], [Shard(1)], [("tp", "all_to_all", "all_to_all")], 4 * 3 * F32),
    "replicate_to_partial": ([Replicate()], [Partial("max")], [("tp", "to_partial", None)], 0),
    "shard_to_partial": ([Shard(1)], [Partial("sum")], [("tp", "to_partial", None)], 0),
    "partial_avg_to_sum": (
        [Partial("avg")],
        [Partial("sum")],
        [("tp", "all_reduce", "all_reduce"), ("tp", "to_partial", None)],
        192,
    ),
}


@pytest.mark.parametrize("case", list(SINGLE_AXIS))
def test_each_single_axis_change_uses_its_collective_and_formula_volume(case):
    src, dst, steps, volume = SINGLE_AXIS[case]
    _check(run_distributed(_run, {"tp": 2}, (8, 6), src, dst, world_size=2), steps, lambda coord: volume)


def test_uneven_pieces_count_what_each_rank_sends():
    # dim 0 of extent 5 over 4 ranks: pieces [2, 2, 1, 0] rows of 3 floats; all_gather moves S - own per rank
    results = run_distributed(_run, {"tp": 4}, (5, 3), [Shard(0)], [Replicate()], world_size=4)
    own = [2, 2, 1, 0]
    _check(results, [("tp", "all_gather", "all_gather")], lambda c: (5 - own[c["tp"]]) * 3 * F32)
    # Shard(0) -> Shard(1) of a (5, 6) tensor: rank r keeps its own block (own[r] x 2 of 6 columns)
    results = run_distributed(_run, {"tp": 4}, (5, 6), [Shard(0)], [Shard(1)], world_size=4)
    columns = [2, 2, 2, 0]
    _check(results, [("tp", "all_to_all", "all_to_all")], lambda c: own[c["tp"]] * (6 - columns[c["tp"]]) * F32)


def test_partial_to_uneven_shard_pads_or_falls_back_to_all_reduce():
    # extent 5 over 4 ranks: reduce_scatter of the input padded to 8 rows, (n-1)/n of 8 rows
    results = run_distributed(_run, {"tp": 4}, (5, 3), [Partial()], [Shard(0)], world_size=4)
    _check(results, [("tp", "reduce_scatter", "reduce_scatter")], lambda c: 3 / 4 * 8 * 3 * F32)
    assert results[0]["notes"] == ["dim 0 padded from 5 to 8"]
    # extent 1 over 4 ranks: padding to 4 rows would move 3 rows, an all_reduce of 1 row moves 1.5: all_reduce
    results = run_distributed(_run, {"tp": 4}, (1, 3), [Partial()], [Shard(0)], world_size=4)
    _check(results, [("tp", "all_reduce_slice", "all_reduce")], lambda c: 2 * 3 / 4 * 1 * 3 * F32)


def test_plan_shrinks_before_it_gathers():
    # (Replicate, Shard(0)) -> (Shard(1), Replicate) on an (8, 8) tensor: slicing dp first halves the gather
    results = run_distributed(
        _run, {"dp": 2, "tp": 2}, (8, 8), [Replicate(), Shard(0)], [Shard(1), Replicate()], world_size=4
    )
    _check(results, [("dp", "slice", None), ("tp", "all_gather", "all_gather")], lambda c: (8 - 4) * 4 * F32)


def test_nested_shards_gather_the_inner_axis_first():
    # (Shard(0), Shard(0)) -> (Replicate, Shard(0)): dp's shard of dim 0 is split again by tp, so tp gathers
    # first, then dp, then tp takes its chunk of the whole dimension
    results = run_distributed(
        _run, {"dp": 2, "tp": 2}, (8, 2), [Shard(0), Shard(0)], [Replicate(), Shard(0)], world_size=4
    )
    steps = [("tp", "all_gather", "all_gather"), ("dp", "all_gather", "all_gather"), ("tp", "slice", None)]
    _check(results, steps, lambda c: (4 - 2) * 2 * F32 + (8 - 4) * 2 * F32)


def test_two_axes_change_together():
    # (Partial, Shard(1)) -> (Shard(0), Shard(0)) of a (6, 4) tensor: reduce_scatter over dp of the (6, 2) piece
    # into (3, 2), then tp moves its split from dim 1 to dim 0 with an all_to_all of the (3, 2) piece
    results = run_distributed(
        _run, {"dp": 2, "tp": 2}, (6, 4), [Partial(), Shard(1)], [Shard(0), Shard(0)], world_size=4
    )
    steps = [("dp", "reduce_scatter", "reduce_scatter"), ("tp", "all_to_all", "all_to_all")]
    tp_rows = [2, 1]  # the 3 rows chunked over tp: each rank sends its 2 columns of the other rank's rows
    _check(results, steps, lambda c: 1 / 2 * 6 * 2 * F32 + 2 * (3 - tp_rows[c["tp"]]) * F32)


def test_no_communication_on_an_axis_of_size_one_or_for_empty_tensors():
    results = run_distributed(
        _run, {"dp": 2, "tp": 1}, (4, 3), [Shard(1), Partial()], [Shard(1), Shard(0)], world_size=2
    )
    _check(results, [("tp", "local", None)], lambda c: 0)
    results = run_distributed(_run, {"tp": 2}, (0, 3), [Shard(0)], [Replicate()], world_size=2)
    _check(results, [("tp", "all_gather", None)], lambda c: 0)


def _plan_errors():
    mesh = Mesh(tp=2)
    a = distribute(torch.ones(4, 4), mesh, [Shard(0)])
    other = layout_of(distribute(torch.ones(4, 5), mesh, [Shard(0)]))
    try:
        plan_redistribute(layout_of(a), other)
    except ValueError as error:
        return str(error)
    return None


def test_plan_rejects_layouts_of_different_tensors():
    message = run_distributed(_plan_errors, world_size=2)[0]
    assert "differ in mesh or global shape; redistribution only changes placements" in message
