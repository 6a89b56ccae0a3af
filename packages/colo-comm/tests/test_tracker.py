"""`CommTracker` records the formula volume of each collective (nccl-tests bus bytes), per op and per axis."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import (
    CommTracker,
    Mesh,
    P2POp,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    batch_send_recv,
    broadcast,
    force_algorithm,
    reduce_scatter,
)
from colo.comm.testing import run_distributed


def _volumes():
    mesh = Mesh(dp=2, tp=2)
    dp, tp = mesh.group("dp"), mesh.group("tp")
    world = mesh.group("dp", "tp")
    with CommTracker() as tracker:
        all_reduce(torch.ones(1000), group=dp)  # fp32, 4000 B
        with force_algorithm("all_gather", "native"):
            all_gather(torch.ones(10, 3, dtype=torch.bfloat16), group=tp)  # out 2*60 B
            all_gather(torch.ones(mesh.rank("tp") + 1, 5), group=tp, sizes=[1, 2])  # uneven: rows 1, 2 of 20 B
        with force_algorithm("all_gather", "all_reduce"):
            all_gather(torch.ones(10, 3, dtype=torch.bfloat16), group=world)  # out 4*60 B
        with force_algorithm("reduce_scatter", "native"):
            reduce_scatter(torch.ones(8, 4), group=world)  # in 128 B
        with force_algorithm("reduce_scatter", "all_reduce"):
            reduce_scatter(torch.ones(8, 4), group=world)
        all_to_all(torch.ones(4, 2, dtype=torch.float16), group=tp)  # in 16 B
        broadcast(torch.ones(16), src=0, group=dp)  # 64 B
        peer = 1 - mesh.rank("tp")
        batch_send_recv([P2POp.send(torch.ones(3), peer), P2POp.recv(torch.empty(3), peer)], group=tp)
        barrier(group=world)
    return (
        mesh.rank("tp"),
        tracker.records,
        {
            "all_reduce": (tracker.bytes("all_reduce", axis="dp"), tracker.calls("all_reduce")),
            "all_gather": tracker.bytes("all_gather", axis="tp"),
            "all_gather_impl": tracker.impl_bytes("all_gather", axis="tp"),
            "all_gather_world": (
                tracker.bytes("all_gather", axis="dp+tp"),
                tracker.impl_bytes("all_gather", axis="dp+tp"),
                tracker.algorithms("all_gather"),
            ),
            "reduce_scatter": tracker.bytes("reduce_scatter", axis="dp+tp"),
            "reduce_scatter_impl": tracker.impl_bytes("reduce_scatter", axis="dp+tp"),
            "reduce_scatter_algorithms": tracker.algorithms("reduce_scatter"),
            "all_to_all": tracker.bytes("all_to_all", axis="tp"),
            "broadcast": tracker.bytes("broadcast", axis="dp"),
            "send": tracker.bytes("send", axis="tp"),
            "recv": tracker.bytes("recv", axis="tp"),
            "barrier": (tracker.bytes("barrier"), tracker.calls("barrier", axis="dp+tp")),
            "other_axis": tracker.bytes("all_reduce", axis="tp"),
            "summary": tracker.summary(),
        },
    )


def test_tracker_bytes_equal_the_formulas():
    for tp_rank, records, volume in run_distributed(_volumes, world_size=4):
        n = 2
        assert volume["all_reduce"] == (2 * (n - 1) / n * 4000, 1)
        own_rows = tp_rank + 1
        even_gather = (n - 1) / n * (n * 60)
        uneven_gather = (3 - own_rows) * 20  # total rows 3, this rank's rows are not sent to itself
        assert volume["all_gather"] == pytest.approx(even_gather + uneven_gather)
        # the padded implementation moves max(sizes) = 2 rows from each other rank
        assert volume["all_gather_impl"] == pytest.approx(even_gather + (n - 1) * 2 * 20)
        # an all-gather run as an all-reduce of the (4 * 60 B) output buffer moves twice the formula volume
        assert volume["all_gather_world"] == (
            pytest.approx(3 / 4 * 240),
            pytest.approx(2 * 3 / 4 * 240),
            {"native": 1, "padded_native": 1, "all_reduce": 1},
        )
        assert volume["reduce_scatter"] == pytest.approx(2 * (3 / 4) * 128)
        assert volume["reduce_scatter_impl"] == pytest.approx((3 / 4) * 128 + 2 * (3 / 4) * 128)
        assert volume["reduce_scatter_algorithms"] == {"native": 1, "all_reduce": 1}
        assert volume["all_to_all"] == pytest.approx((n - 1) / n * 16)
        assert volume["broadcast"] == 64
        assert volume["send"] == 12 and volume["recv"] == 12
        assert volume["barrier"] == (0, 1)
        assert volume["other_axis"] == 0
        assert "reduce_scatter" in volume["summary"]
        assert {record.axis for record in records} == {"dp", "tp", "dp+tp"}


def _nested_trackers():
    with CommTracker() as outer:
        all_reduce(torch.ones(10))
        with CommTracker() as inner:
            all_reduce(torch.ones(10))
        all_reduce(torch.ones(10))
    all_reduce(torch.ones(10))  # after both closed: not recorded
    return outer.calls(), inner.calls(), dist.get_world_size()


def test_trackers_nest_and_stop_at_exit():
    outer, inner, _ = run_distributed(_nested_trackers, world_size=2)[0]
    assert (outer, inner) == (3, 1)
