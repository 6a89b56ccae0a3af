"""`launch`: run a function on several local processes, for scripts and notebooks (torchrun's little sibling)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._workers import RankGang
from .distributed import check_nccl_fits


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "auto",
    timeout: float | None = None,
    comm_timeout: float = 300.0,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local processes that form one process group; return the results.

    Each process gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, a free loopback
    ``MASTER_PORT``), so ``fn`` runs as it would under torchrun, with `init_distributed` already called.

    Args:
        fn: a module-level function (lambdas and closures cannot be found by the other processes).
        nprocs: number of ranks.
        *args, **kwargs: passed to ``fn`` on every rank (picklable).
        backend: ``"auto"`` (NCCL when there are at least ``nprocs`` GPUs, else gloo), ``"gloo"`` or ``"nccl"``
            (refused before any process starts when ``nprocs`` exceeds the GPUs).
        timeout: seconds for the whole run; ``None`` waits as long as it takes.
        comm_timeout: seconds before a collective fails instead of hanging (when a rank died or hangs).
        threads: torch intra-op threads per rank; default ``cpu_count // nprocs`` (at least 1).
        env: extra environment variables for the ranks.

    Returns:
        ``fn``'s return value on each rank, in rank order.

    Raises:
        RankFailure: a rank raised or died; the message leads with the first failing rank's traceback, and the
            other ranks are stopped.
        RankTimeout: the run did not finish within ``timeout``.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a positive int")
    if backend == "nccl":
        check_nccl_fits(nprocs)
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // nprocs)
    gang = RankGang(nprocs, backend=backend, pg_timeout=comm_timeout, threads=threads, env=env).start()
    try:
        return gang.run(fn, args, kwargs, timeout=timeout if timeout is not None else float("inf"))
    finally:
        if gang.alive:
            gang.close()
        else:
            gang.kill()
