"""`python -m colo.comm.bench` measures every op on every axis and reports bus bandwidth by the nccl-tests factors."""

from __future__ import annotations

import json

import pytest

from colo.comm import bench
from colo.comm.testing import run_distributed


def _bench(argv):
    return bench._run_on_rank(argv)


def test_bandwidth_table_covers_each_axis_op_and_size():
    argv = ["--mesh", "dp=2,tp=2", "--min-bytes", "4K", "--max-bytes", "16K", "--quick"]
    result = run_distributed(_bench, argv, world_size=4)[0]
    rows = result["bandwidth"]
    assert {(r["axis"], r["op"], r["bytes"]) for r in rows} == {
        (axis, op, size) for axis in ("dp", "tp", "dp+tp") for op in bench.OPS for size in (4096, 16384)
    }
    for row in rows:
        n = row["group_size"]
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bench.BUS_FACTOR[row["op"]](n))
        assert row["time_us"] > 0
    assert result["environment"]["world_size"] == 4
    json.dumps(result)  # serialisable as written by --json


def test_calibration_and_overhead_modes_produce_tables():
    calibration = run_distributed(_bench, ["--calibrate", "unused.json", "--max-bytes", "4K", "--quick"], world_size=2)[
        0
    ]
    assert set(calibration["table"]["gloo"]) == {"reduce_scatter", "all_gather"}
    overhead = run_distributed(
        _bench, ["--vs-raw", "--max-bytes", "4K", "--rounds", "2", "--ops", "all_reduce", "--quick"], world_size=2
    )[0]
    (row,) = overhead["overhead"]
    assert row["op"] == "all_reduce" and row["ratio"] > 0


def test_size_and_mesh_parsing():
    assert bench.parse_size("4K") == 4096 and bench.parse_size("16MB") == 16 << 20 and bench.parse_size("10") == 10
    assert bench.size_range(4096, 65536) == [4096, 16384, 65536]
    assert bench.parse_mesh("dp=2,tp=2") == {"dp": 2, "tp": 2}
    with pytest.raises(ValueError, match="axis=size"):
        bench.parse_mesh("dp2")
