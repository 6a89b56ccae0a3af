"""What the benchmarks that run a peer framework in its own processes share (`dpo_trl.py`, `diffusion_train.py`):
starting one worker process per rank with the environment ``torchrun`` / ``accelerate launch`` would set, and
reading each rank's JSON result; the peak RSS a worker reports."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_processes(
    label: str,
    world: int,
    command_for_rank: Callable[[int, str], list[str]],
    *,
    env: dict[str, str],
    timeout: float,
) -> list[dict]:
    """Run ``command_for_rank(rank, scratch)`` for every rank at once (with ``RANK`` / ``WORLD_SIZE`` /
    ``MASTER_ADDR`` ... set when ``world > 1``) and return the JSON each wrote to ``scratch/rank{rank}.json``.

    Raises:
        RuntimeError: a rank timed out (all are killed) or exited non-zero (its output's tail is included).
    """
    port = _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        procs = []
        for rank in range(world):
            rank_env = {**os.environ, **env}
            if world > 1:  # what torchrun / accelerate launch would set
                rank_env.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                )  # fmt: skip
            procs.append(
                subprocess.Popen(
                    command_for_rank(rank, scratch),
                    env=rank_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{label}: timed out after {timeout} s") from None
        if any(p.returncode for p in procs):
            failed = next(i for i, p in enumerate(procs) if p.returncode)
            raise RuntimeError(f"{label} rank {failed} exited {procs[failed].returncode}:\n{outputs[failed][-3000:]}")
        return [json.loads(Path(scratch, f"rank{rank}.json").read_text()) for rank in range(world)]
