"""A dead or hung rank makes the others fail within the timeout, naming the op and the group; pools recover."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from colo.comm import CommError, CommTimeoutError, Mesh, RankFailure, RankTimeout, all_reduce, launch
from colo.comm.testing import get_pool, run_distributed


def _rank_one_dies_then_others_reduce():
    mesh = Mesh(dp=2)
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(0.2)
    all_reduce(torch.ones(4), group=mesh.group("dp"))


def test_a_killed_rank_makes_the_others_fail_naming_op_and_group():
    with pytest.raises(RankFailure) as caught:
        launch(_rank_one_dies_then_others_reduce, 2, backend="gloo", comm_timeout=10, timeout=120)
    failures = caught.value.failures
    assert "died (exit code 3)" in failures[1]
    assert "CommError" in failures[0]
    assert "all_reduce of (4,) torch.float32 on group 'dp' (ranks [0, 1]) failed on rank 0" in failures[0]
    assert not isinstance(caught.value, RankTimeout)  # rank 0 raised by itself; nobody had to be killed


def _rank_one_hangs():
    mesh = Mesh(dp=2)
    if dist.get_rank() == 1:
        time.sleep(120)
    all_reduce(torch.ones(4), group=mesh.group("dp"))


def test_a_hung_rank_makes_the_others_time_out_within_the_comm_timeout():
    # comm_timeout=3: rank 0's all_reduce gives up after 3 s, long before the launch's own 120 s limit,
    # and rank 1 is killed right after rank 0 failed.
    with pytest.raises(RankFailure) as caught:
        launch(_rank_one_hangs, 2, backend="gloo", comm_timeout=3, timeout=120)
    assert caught.value.first_rank == 0
    first = caught.value.failures[0]
    assert "CommTimeoutError" in first and "all_reduce" in first and "'dp'" in first
    assert "timeout of 3s" in first
    assert "still running" in caught.value.failures[1]


def _returns_rank_squared(offset):
    return dist.get_rank() ** 2 + offset


def _raises_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    return "fine"


def test_launch_returns_results_and_reraises_the_first_failure_with_its_traceback():
    assert launch(_returns_rank_squared, 3, 10, backend="gloo") == [10, 11, 14]
    with pytest.raises(RankFailure) as caught:
        launch(_raises_on_rank_one, 2, backend="gloo")
    assert caught.value.first_rank == 1
    message = str(caught.value)
    assert message.startswith("_raises_on_rank_one failed on rank 1:")
    assert "Traceback" in message and "ValueError: rank one is unhappy" in message


def _die_on_rank(rank):
    if dist.get_rank() == rank:
        os._exit(7)
    all_reduce(torch.ones(1))


def _sleep(seconds):
    time.sleep(seconds)


def _world_sum():
    return all_reduce(torch.ones(1)).item()


def test_pool_recovers_after_a_dead_rank_and_after_a_hang():
    pool = get_pool(2)
    assert run_distributed(_world_sum, world_size=2) == [2.0, 2.0]
    starts = pool.starts
    with pytest.raises(RankFailure, match="died"):
        run_distributed(_die_on_rank, 1, world_size=2)
    assert run_distributed(_world_sum, world_size=2) == [2.0, 2.0]
    assert pool.starts == starts + 1
    with pytest.raises(RankTimeout, match="did not finish within 1s"):
        run_distributed(_sleep, 30, world_size=2, timeout=1)
    assert run_distributed(_world_sum, world_size=2) == [2.0, 2.0]
    assert pool.starts == starts + 2


def _comm_error_type():
    return issubclass(CommTimeoutError, CommError)


def test_errors_form_a_hierarchy():
    assert _comm_error_type()
    assert issubclass(RankTimeout, RankFailure)


def _exec_environment(name: str) -> str | None:
    """``name`` in the environment this process was started with (``/proc/self/environ``: what exec passed)."""
    with open("/proc/self/environ", "rb") as file:
        entries = file.read().split(b"\0")
    prefix = name.encode() + b"="
    return next((entry[len(prefix) :].decode() for entry in entries if entry.startswith(prefix)), None)


def test_launch_env_is_in_each_ranks_environment_from_exec_on():
    """``launch(env=...)`` reaches the ranks before their program starts (glibc reads its ``MALLOC_*`` tunables at
    start, so a variable set later does nothing), and the parent's environment is left as it was."""
    import os

    if not os.path.exists("/proc/self/environ"):
        pytest.skip("needs /proc/self/environ (Linux)")
    name = "COLO_TEST_ENV_AT_EXEC"
    assert launch(_exec_environment, 2, name, backend="gloo", env={name: "yes"}) == ["yes", "yes"]
    assert name not in os.environ
