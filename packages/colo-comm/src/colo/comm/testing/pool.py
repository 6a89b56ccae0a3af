"""Warm pools of ranks, one per (world size, backend), kept for the whole test session."""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from typing import Any

from .._function_ref import ref_of
from .._workers import RankGang
from ..distributed import check_nccl_fits

DEFAULT_TEST_TIMEOUT_S = 60.0
"""Seconds a test's function may run on the ranks before they are killed and the test fails."""

COMM_TIMEOUT_S = 30.0
"""Seconds before a collective inside a test fails (shorter than the test timeout, so errors name the op)."""


class RankPool:
    """A warm gang of ``world_size`` ranks, rebuilt transparently after a failure.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` by default, so the same tests run on a machine with or without GPUs.
        threads: torch threads per rank (1: ranks share the machine's cores).
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", threads: int = 1):
        if backend == "nccl":  # never more NCCL ranks than GPUs: refused before any rank starts
            check_nccl_fits(world_size)
        self.world_size = world_size
        self.backend = backend
        self.threads = threads
        self.starts = 0
        self._gang: RankGang | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> RankGang:
        if self._gang is None or not self._gang.alive:
            if self._gang is not None:
                self._gang.kill()
            env = {"OMP_NUM_THREADS": str(self.threads)}
            self._gang = RankGang(
                self.world_size, backend=self.backend, pg_timeout=COMM_TIMEOUT_S, threads=self.threads, env=env
            ).start()
            self.starts += 1
        return self._gang

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        timeout: float = DEFAULT_TEST_TIMEOUT_S,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results in rank order (see `RankGang.run`)."""
        with self._lock:
            return self._ensure().run(fn, args, kwargs, timeout=timeout)

    def close(self) -> None:
        """Stop the ranks."""
        with self._lock:
            if self._gang is not None:
                if self._gang.alive:
                    self._gang.close()
                else:
                    self._gang.kill()
                self._gang = None


_pools: dict[tuple[int, str], RankPool] = {}


def get_pool(world_size: int, backend: str = "gloo") -> RankPool:
    """The session's pool for ``world_size`` ranks on ``backend`` (created on first use)."""
    key = (world_size, backend)
    if key not in _pools:
        _pools[key] = RankPool(world_size, backend=backend)
    return _pools[key]


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float | None = None,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` warm ranks; return each rank's result, in rank order.

    ``fn`` must be defined at module level (test modules are loaded by file in the ranks). Inside it,
    torch.distributed is initialized (gloo by default), one torch thread per rank.

    Args:
        fn: the function every rank runs.
        *args, **kwargs: its arguments (picklable; draw random cases here, in the pytest process, so every rank
            runs the same example).
        world_size: number of ranks.
        timeout: seconds before the ranks are killed and the test fails (default 60, or ``COLO_TEST_TIMEOUT``).
        backend: process-group backend of the pool.

    Raises:
        RankFailure: a rank raised or died; the message leads with its traceback.
        RankTimeout: a rank did not finish within ``timeout``.
    """
    ref_of(fn)  # reject lambdas and closures before (re)starting any rank
    if timeout is None:
        timeout = float(os.environ.get("COLO_TEST_TIMEOUT", DEFAULT_TEST_TIMEOUT_S))
    return get_pool(world_size, backend).run(fn, args, kwargs, timeout=timeout)


def shutdown_pools() -> None:
    """Stop every pool's ranks (at the end of the test session)."""
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


atexit.register(shutdown_pools)
