"""Exceptions raised by colo.comm, each naming what failed and what to do about it."""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective or point-to-point operation failed (a peer died, closed its connection, or mismatched the call)."""


class CommTimeoutError(CommError):
    """A collective or point-to-point operation did not complete within the process group's timeout.

    Usually a peer rank died, hangs, or did not enter the same operation on the same group.
    """


class RankFailure(RuntimeError):
    """One or more ranks of a local launch or of a test pool failed.

    Attributes:
        failures: ``{rank: description}`` for every rank that raised, died or hung; the description of a rank
            that raised is its formatted traceback.
        first_rank: the rank whose failure was seen first (its traceback leads the message).
    """

    def __init__(self, message: str, failures: dict[int, str], first_rank: int | None):
        super().__init__(message)
        self.failures = failures
        self.first_rank = first_rank


class RankTimeout(RankFailure):
    """Ranks of a local launch or a test pool did not finish within the given timeout."""
