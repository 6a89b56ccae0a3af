"""`Handle`, the async result of a colo communication call, and the error translation shared by all calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .errors import CommError, CommTimeoutError
from .group import Group
from .regions import _NO_REGION, region, size_text

Detail = str | Callable[[], str]
"""What the call was about, for error messages; a callable is only formatted when an error happens."""

_last_entered: list = [None, False]
"""``[the translate_errors of the last operation this process entered, whether it has returned]``: one list
store per call, read only by `last_collective` (a hang watchdog dumping where a rank waits)."""


class translate_errors:  # noqa: N801 - used like a function: ``with translate_errors(op, group):``
    """Re-raise a backend failure inside the block as `CommError` / `CommTimeoutError` naming op and group.

    A class rather than a generator-based context manager: it wraps every collective, so it must be cheap.
    """

    __slots__ = ("op", "group", "detail", "start")

    def __init__(self, op: str, group: Group, detail: Detail = "") -> None:
        self.op, self.group, self.detail = op, group, detail

    def __enter__(self) -> None:
        self.start = time.monotonic()
        _last_entered[0], _last_entered[1] = self, False

    def __exit__(self, kind, error, traceback) -> bool:
        if _last_entered[0] is self:
            _last_entered[1] = True
        if error is None or not isinstance(error, RuntimeError) or isinstance(error, CommError):
            return False
        elapsed = time.monotonic() - self.start
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        lowered = str(error).lower()
        timed_out = "timed out" in lowered or "timeout" in lowered
        exception_type = CommTimeoutError if timed_out else CommError
        detail = self.detail() if callable(self.detail) else self.detail
        what = f"{self.op}{' ' + detail if detail else ''} on group {self.group.describe()}"
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise exception_type(
            f"{what} failed on rank {rank} after {elapsed:.1f}s: {text}. A peer rank probably died, hangs, or did "
            f"not call the same operation on this group; operations fail after the group's timeout of "
            f"{self.group.timeout:.0f}s (set it with init_distributed(timeout=...))."
        ) from error


def last_collective() -> dict | None:
    """The last collective or point-to-point operation this process entered through colo.comm, for hang reports.

    Returns:
        ``None`` before any, else ``{"op", "group", "ranks", "detail" (shapes and dtype), "seconds" (since it was
        entered), "returned" (False while the process is still inside it)}``. Recording costs one list
        store per call; the details are formatted only here.
    """
    entered, returned = _last_entered
    if entered is None:
        return None
    detail = entered.detail() if callable(entered.detail) else entered.detail
    group = entered.group
    return {
        "op": entered.op,
        "group": group.name,
        "ranks": list(group.ranks),
        "detail": detail,
        "seconds": round(time.monotonic() - entered.start, 3),
        "returned": returned,
    }


class Handle:
    """An operation in flight. ``wait()`` blocks until it completes and returns its result.

    Synchronous calls return the result directly; with ``async_op=True`` they return a `Handle`, so
    communication can overlap computation where the backend runs it in the background.
    """

    def __init__(
        self,
        op: str,
        group: Group,
        works: list[Any],
        finish: Callable[[], Any] | None = None,
        detail: Detail = "",
    ) -> None:
        self._op = op
        self._group = group
        self._works = [work for work in works if work is not None]
        self._finish = finish
        self._detail = detail
        self._done = False
        self._async = True  # a synchronous call's wait is inside the call's own profiler range: no range of its own
        self._result: Any = None
        self.input_reduced = False
        """Whether the call reduced its (donated) input in place, all of it: every element holds the group's
        reduction (`reduce_scatter` with ``donate="whole"`` sets it; the input is then no longer the caller's)."""

    @classmethod
    def completed(cls, op: str, group: Group, result: Any) -> Handle:
        """A handle whose operation has already finished: ``wait()`` returns ``result`` (a group of one rank, or a
        call in compiled code, where the compiler places the wait)."""
        handle = cls(op, group, [])
        handle._result, handle._done = result, True
        return handle

    def wait(self) -> Any:
        """Block until the operation completes; return its result (a tensor, a list, or ``None``)."""
        if not self._done:
            with (
                translate_errors(self._op, self._group, self._detail),
                region(self._wait_name) if self._async else _NO_REGION,
            ):
                for work in self._works:
                    work.wait()
            self._result = self._finish() if self._finish is not None else None
            self._done = True
            self._works = []
        return self._result

    def _wait_name(self) -> str:
        return f"colo.wait {self._op}[{self._group.name}]"

    def is_completed(self) -> bool:
        """Whether the operation has finished (``wait()`` would not block)."""
        return self._done or all(work.is_completed() for work in self._works)


def issue(
    op: str,
    group: Group,
    start: Callable[[], list[Any]],
    finish: Callable[[], Any] | None,
    async_op: bool,
    detail: Detail = "",
    *,
    nbytes: int | None = None,
) -> Any:
    """Start an operation (``start`` returns its torch works) and return a `Handle` or, if synchronous, the result.

    Under a torch profiler the call is a range ``colo.<op>[<group>] <nbytes>`` (`colo.comm.regions`; ``nbytes``:
    this rank's buffer), holding the wait when synchronous; an asynchronous call's wait is its own range."""

    def name() -> str:
        size = f" {size_text(nbytes)}" if nbytes is not None else ""
        return f"colo.{op}[{group.name}]{size}{'' if not async_op else ' (async)'}"

    with region(name):
        with translate_errors(op, group, detail):
            works = start()
        handle = Handle(op, group, works, finish, detail)
        handle._async = async_op
        return handle if async_op else handle.wait()
