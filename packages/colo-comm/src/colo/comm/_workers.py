"""A gang of worker processes, one per rank, each in the process group, running shipped functions.

Used by `colo.comm.launch` (one function, then the gang is closed) and by the test harness in
`colo.comm.testing` (a warm gang per world size for the whole pytest session).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
import traceback
from typing import Any

from ._function_ref import FunctionRef, ref_of, resolve
from .distributed import find_free_port
from .errors import RankFailure, RankTimeout

_ADDRESS_IN_USE = ("address already in use", "eaddrinuse", "errno 98")
FAILURE_GRACE_S = 2.0
"""After a rank fails, how long the others get to finish or fail themselves before the gang is killed."""


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout: float,
    threads: int | None,
    env: dict[str, str],
    conn,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        from .distributed import destroy_distributed, init_distributed
        from .tracker import reset_active_trackers

        init_distributed(backend, timeout=pg_timeout)
    except BaseException:
        conn.send_bytes(pickle.dumps(("init_error", None, traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", None, os.getpid())))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if message is None:
            break
        task_id, ref, args, kwargs = message
        reset_active_trackers()
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
        try:
            result = resolve(ref)(*args, **kwargs)
            reply = pickle.dumps(("ok", task_id, result))
        except BaseException as error:
            reply = pickle.dumps(("error", task_id, _describe(error)))
        try:
            conn.send_bytes(reply)
        except (BrokenPipeError, OSError):
            break
    destroy_distributed()


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``os.environ`` with ``env`` set while the block runs (a spawned process inherits it at exec, so what a
    program reads at start, e.g. glibc's ``MALLOC_*`` tunables, sees it), restored after."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _describe(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


class RankGang:
    """``world_size`` processes on loopback, each rank of one process group, that run functions on request.

    Args:
        world_size: number of ranks.
        backend: process-group backend for the workers (``"auto"``, ``"gloo"``, ``"nccl"``).
        pg_timeout: seconds before a collective inside a worker fails.
        threads: torch intra-op threads per rank (``None``: torch's default).
        env: extra environment variables for the workers.
        start_timeout: seconds to wait for every rank to join the process group.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "auto",
        pg_timeout: float = 60.0,
        threads: int | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
    ):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a positive int")
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout = pg_timeout
        self.threads = threads
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.broken = False
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._task_ids = itertools.count()

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self, attempts: int = 5) -> RankGang:
        """Spawn the ranks and wait until all joined the group; retries on a rendezvous port taken meanwhile."""
        for attempt in range(attempts):
            failures = self._try_start(find_free_port())
            if not failures:
                return self
            self.kill()
            port_taken = any(any(s in text.lower() for s in _ADDRESS_IN_USE) for text in failures.values())
            if not port_taken or attempt == attempts - 1:
                first = min(failures)
                raise RankFailure(f"rank {first} failed to start:\n{failures[first]}", failures, first)
        raise AssertionError("unreachable")

    def _try_start(self, port: int) -> dict[int, str]:
        context = multiprocessing.get_context("spawn")
        self._procs, self._conns = [], []
        self.broken = False
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self.backend, self.pg_timeout, self.threads, self.env, child_end),
                name=f"colo-rank-{rank}",
            )
            with _environment(self.env):  # in the new process's environment from exec on (glibc reads some at start)
                proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        replies, failures, pending = self._collect(None, self.start_timeout, expect="ready")
        for rank in pending:
            failures[rank] = f"rank {rank} did not join the process group within {self.start_timeout:.0f}s"
        return failures

    @property
    def alive(self) -> bool:
        """Whether every rank's process is running and the gang has not been marked broken."""
        return bool(self._procs) and not self.broken and all(p.is_alive() for p in self._procs)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the ranks to leave the process group and exit; kill those that do not within ``timeout``."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank's process at once."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self.broken = True

    # --- running --------------------------------------------------------------------------------------------

    def run(self, fn, args: tuple = (), kwargs: dict | None = None, *, timeout: float = 60.0) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return each rank's result, in rank order.

        Raises:
            RankFailure: a rank raised or died (its traceback leads the message); the gang is then broken.
            RankTimeout: ranks did not finish within ``timeout`` seconds; they are killed and the gang is broken.
        """
        if not self.alive:
            raise RuntimeError("the rank gang is not running; start() it (or build a new one after a failure)")
        ref: FunctionRef = ref_of(fn)
        task_id = next(self._task_ids)
        try:
            payload = pickle.dumps((task_id, ref, tuple(args), dict(kwargs or {})))
        except Exception as error:
            raise TypeError(f"arguments for {ref.qualname} cannot be pickled to send to the ranks: {error}") from error
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
            results, failures, pending = self._collect(task_id, timeout, expect="ok")
        except BaseException:
            self.kill()  # interrupted (Ctrl-C, pytest-timeout): the ranks' state is unknown, never reuse them
            raise
        if not failures and not pending:
            return [results[rank] for rank in range(self.world_size)]
        first = next(iter(failures), None)
        for rank in pending:
            failures[rank] = (
                f"rank {rank} did not finish within {timeout:.0f}s"
                if first is None
                else f"rank {rank} was still running {FAILURE_GRACE_S:.0f}s after rank {first} failed "
                "(probably waiting in a collective for it)"
            )
        self.kill()
        if first is None:
            message = f"{ref.qualname}: ranks {sorted(pending)} did not finish within {timeout:.0f}s; killed them"
            raise RankTimeout(message, failures, None)
        others = "\n".join(f"  rank {r}: {_last_line(t)}" for r, t in sorted(failures.items()) if r != first)
        message = f"{ref.qualname} failed on rank {first}:\n{failures[first]}"
        if others:
            message += f"\nother ranks:\n{others}"
        raise RankFailure(message, failures, first)

    def _collect(self, task_id, timeout: float, *, expect: str) -> tuple[dict, dict, set]:
        """Wait for one reply per rank; returns (results, failures in arrival order, ranks still pending)."""
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        by_conn = {id(conn): rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            remaining = min(remaining, 3600.0)
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for ready in multiprocessing.connection.wait(waitables, timeout=remaining):
                rank = by_conn.get(id(ready)) if not isinstance(ready, int) else by_sentinel.get(ready)
                if rank is None or rank not in pending:
                    continue
                reply = self._receive(rank)
                if reply is None:
                    code = self._procs[rank].exitcode
                    if code is None:
                        self._procs[rank].join(1)
                        code = self._procs[rank].exitcode
                    failures[rank] = f"rank {rank} died (exit code {code})"
                elif reply[1] != task_id:
                    continue  # not an answer to this request
                elif reply[0] == expect:
                    results[rank] = reply[2]
                elif reply[0] in ("error", "init_error"):
                    failures[rank] = reply[2]
                else:
                    continue
                pending.discard(rank)
                if failures and grace_deadline is None:
                    grace_deadline = time.monotonic() + FAILURE_GRACE_S
        return results, failures, pending

    def _receive(self, rank: int):
        conn = self._conns[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        if self._procs[rank].is_alive():
            return ("pending", None, None)
        return None
