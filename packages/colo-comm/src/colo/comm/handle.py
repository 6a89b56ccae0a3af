"""`Handle`, the async result of a colo communication call, and the error translation shared by all calls."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from .errors import CommError, CommTimeoutError
from .group import Group


@contextlib.contextmanager
def translate_errors(op: str, group: Group, detail: str = "") -> Iterator[None]:
    """Re-raise a backend failure inside the block as `CommError` / `CommTimeoutError` naming op and group."""
    start = time.monotonic()
    try:
        yield
    except (CommError, ValueError, TypeError):
        raise
    except RuntimeError as error:
        elapsed = time.monotonic() - start
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        lowered = str(error).lower()
        timed_out = "timed out" in lowered or "timeout" in lowered
        kind = CommTimeoutError if timed_out else CommError
        what = f"{op}{' ' + detail if detail else ''} on group {group.describe()}"
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise kind(
            f"{what} failed on rank {rank} after {elapsed:.1f}s: {text}. A peer rank probably died, hangs, or did "
            f"not call the same operation on this group; operations fail after the group's timeout of "
            f"{group.timeout:.0f}s (set it with init_distributed(timeout=...))."
        ) from error


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
        detail: str = "",
    ) -> None:
        self._op = op
        self._group = group
        self._works = [work for work in works if work is not None]
        self._finish = finish
        self._detail = detail
        self._done = False
        self._result: Any = None

    def wait(self) -> Any:
        """Block until the operation completes; return its result (a tensor, a list, or ``None``)."""
        if not self._done:
            with translate_errors(self._op, self._group, self._detail):
                for work in self._works:
                    work.wait()
            self._result = self._finish() if self._finish is not None else None
            self._done = True
            self._works = []
        return self._result

    def is_completed(self) -> bool:
        """Whether the operation has finished (``wait()`` would not block)."""
        return self._done or all(work.is_completed() for work in self._works)


def issue(
    op: str,
    group: Group,
    start: Callable[[], list[Any]],
    finish: Callable[[], Any] | None,
    async_op: bool,
    detail: str = "",
) -> Any:
    """Start an operation (``start`` returns its torch works) and return a `Handle` or, if synchronous, the result."""
    with translate_errors(op, group, detail):
        works = start()
    handle = Handle(op, group, works, finish, detail)
    return handle if async_op else handle.wait()
