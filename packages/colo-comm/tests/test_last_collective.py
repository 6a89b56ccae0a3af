"""`last_collective`: the op, group, ranks and sizes of the last collective a rank entered, and whether it is still
inside it (what a hang watchdog writes down), seen from another thread while the call blocks and after it returns."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from colo.comm import Mesh, all_gather, all_reduce, last_collective
from colo.comm.testing import run_distributed


def _watch_a_blocked_all_reduce():
    mesh = Mesh(dp=2)
    all_gather(torch.zeros(2, dtype=torch.float64), group=mesh.group("dp"))  # an earlier call, then replaced
    inside: list[dict] = []
    if dist.get_rank() == 0:
        stop = threading.Event()

        def poll() -> None:  # the watchdog's view: another thread, while the main one waits for rank 1
            while not stop.is_set():
                seen = last_collective()
                if seen is not None and seen["op"] == "all_reduce" and not seen["returned"]:
                    inside.append(seen)
                    return
                time.sleep(0.005)

        watcher = threading.Thread(target=poll)
        watcher.start()
        all_reduce(torch.ones(4, 3), group=mesh.group("dp"))
        stop.set()
        watcher.join()
    else:
        time.sleep(1.0)  # rank 0 sits inside its all_reduce meanwhile
        all_reduce(torch.ones(4, 3), group=mesh.group("dp"))
    return inside, last_collective()


def test_last_collective_names_the_op_group_and_sizes_inside_the_call_and_after_it():
    (inside, after_0), (_, after_1) = run_distributed(_watch_a_blocked_all_reduce, world_size=2, timeout=60)
    assert len(inside) == 1, "rank 0's watcher never saw it inside the all_reduce"
    seen = inside[0]
    assert (seen["op"], seen["group"], seen["ranks"], seen["returned"]) == ("all_reduce", "dp", [0, 1], False)
    assert "(4, 3)" in seen["detail"] and "torch.float32" in seen["detail"], seen
    assert 0 <= seen["seconds"] < 1.0
    for after in (after_0, after_1):
        assert (after["op"], after["group"], after["returned"]) == ("all_reduce", "dp", True)
        assert "(4, 3)" in after["detail"]
