"""The test harness ships functions and arguments to warm ranks and brings results or tracebacks back."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from colo.comm import RankFailure, all_reduce
from colo.comm.testing import get_pool, run_distributed


def _echo(value, *, scale):
    return dist.get_rank(), dist.get_world_size(), value * scale, torch.get_num_threads()


def test_arguments_and_results_travel_and_each_rank_has_one_thread():
    results = run_distributed(_echo, torch.ones(2), world_size=4, scale=3.0)
    for rank, (got_rank, world, value, threads) in enumerate(results):
        assert (got_rank, world, threads) == (rank, 4, 1)
        torch.testing.assert_close(value, torch.full((2,), 3.0))


def _assert_fails_on_rank_zero():
    assert dist.get_rank() != 0, "rank zero disagrees"


def test_an_assertion_on_one_rank_fails_the_test_with_its_traceback():
    with pytest.raises(RankFailure, match="rank zero disagrees") as caught:
        run_distributed(_assert_fails_on_rank_zero, world_size=2)
    assert caught.value.first_rank == 0 and set(caught.value.failures) == {0}


def test_functions_that_ranks_cannot_import_are_rejected_up_front():
    with pytest.raises(TypeError, match="define it at module level"):
        run_distributed(lambda: None, world_size=2)


def _tiny_collective():
    return all_reduce(torch.ones(4)).sum().item()


def test_a_small_distributed_test_is_cheap_on_a_warm_pool(capsys):
    """Reports the per-test cost of the warm pool (printed, not asserted: timings belong in benchmarks)."""
    run_distributed(_tiny_collective, world_size=2)  # make sure the pool is warm
    starts = get_pool(2).starts
    repeats = 20
    begin = time.perf_counter()
    for _ in range(repeats):
        assert run_distributed(_tiny_collective, world_size=2) == [8.0, 8.0]
    per_test = (time.perf_counter() - begin) / repeats
    assert get_pool(2).starts == starts  # the same ranks served every call
    with capsys.disabled():
        print(f"\n[harness] warm 2-rank pool: {per_test * 1000:.1f} ms per small distributed test")


def test_load_beside_imports_a_helper_module_once_per_process(tmp_path):
    from colo.comm.testing import load_beside

    (tmp_path / "_shared.py").write_text("class Thing:\n    pass\n")
    (tmp_path / "_other.py").write_text("VALUE = 1\n")
    test_file = str(tmp_path / "test_x.py")
    first = load_beside(test_file, "_shared.py", module_name="colo_comm_test_load_beside")
    assert load_beside(test_file, "_shared.py", module_name="colo_comm_test_load_beside") is first
    with pytest.raises(ValueError, match="is taken by"):
        load_beside(test_file, "_other.py", module_name="colo_comm_test_load_beside")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_beside(test_file, "_missing.py", module_name="colo_comm_test_load_beside_missing")
