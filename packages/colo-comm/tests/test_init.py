"""`init_distributed` picks the backend, reads torchrun's environment, runs unlaunched, and is idempotent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from colo.comm import gpus_per_local_rank, init_distributed, launch, pick_backend
from colo.comm.testing import RankPool, run_distributed


def test_auto_backend_is_gloo_without_cuda_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("COLO_BACKEND", raising=False)
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert pick_backend("auto") == expected
    assert pick_backend("gloo") == "gloo"
    monkeypatch.setenv("COLO_BACKEND", "gloo")
    assert pick_backend("auto") == "gloo"
    with pytest.raises(ValueError, match="use one of 'auto', 'gloo', 'nccl'"):
        pick_backend("mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_explains():
    with pytest.raises(ValueError, match="needs CUDA"):
        pick_backend("nccl")


def _one_gpu_machine(monkeypatch, local_processes: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_processes))
    monkeypatch.delenv("COLO_BACKEND", raising=False)


def test_auto_backend_takes_nccl_only_when_each_local_process_has_a_gpu(monkeypatch):
    _one_gpu_machine(monkeypatch, local_processes=1)
    assert pick_backend("auto") == "nccl"
    assert gpus_per_local_rank() and not gpus_per_local_rank(2)
    _one_gpu_machine(monkeypatch, local_processes=2)  # `make demo` on a one-GPU machine: CPU ranks with gloo
    assert pick_backend("auto") == "gloo"
    assert not gpus_per_local_rank()


def test_nccl_with_more_processes_than_gpus_is_refused_before_any_process_starts(monkeypatch):
    _one_gpu_machine(monkeypatch, local_processes=2)
    with pytest.raises(ValueError, match=r"2 processes on this node but 1 GPU\(s\).*--nproc-per-node 1"):
        pick_backend("nccl")
    with pytest.raises(ValueError, match=r"3 processes on this node but 1 GPU"):
        launch(_init_again, 3, backend="nccl")  # refused in the launcher: no rank was started
    with pytest.raises(ValueError, match=r"2 processes on this node but 1 GPU"):
        RankPool(2, backend="nccl")  # the test harness too


def _init_again():
    info = init_distributed()  # already initialised by the harness: returns the current state
    again = init_distributed("gloo")
    return info == again, info.rank, info.world_size, info.backend, str(info.device), info.timeout


def test_init_is_idempotent_inside_a_launched_job():
    results = run_distributed(_init_again, world_size=2)
    for rank, (same, got_rank, world, backend, device, timeout) in enumerate(results):
        assert (same, got_rank, world, backend, device) == (True, rank, 2, "gloo", "cpu")
        assert timeout == 30.0  # the harness's communication timeout


def test_a_script_without_torchrun_runs_as_a_single_process_job():
    script = textwrap.dedent(
        """
        import os
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
        import torch
        from colo.comm import all_reduce, destroy_distributed, init_distributed, Mesh
        info = init_distributed(timeout=12)
        mesh = Mesh(dp=1)
        total = all_reduce(torch.ones(2), group=mesh.group("dp")).sum().item()
        print(info.rank, info.world_size, info.backend, info.timeout, total)
        destroy_distributed()
        """
    )
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert output.stdout.split() == ["0", "1", "gloo", "12.0", "2.0"]
    assert not dist.is_initialized()  # the pytest process itself was never initialised
