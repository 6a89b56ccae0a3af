"""Fault injection for chaos tests of the trainer: ``COLO_FAULT=action=kill,rank=1,step=6`` makes rank 1 SIGKILL
itself as step 6 begins, so restart, preemption and hang handling are tested on real processes.

The variable holds comma-separated ``key=value`` pairs:

- ``action``: ``kill`` (SIGKILL this process: what the OOM killer or a lost host does), ``raise`` (a
  ``RuntimeError``), ``hang`` (sleep forever before the step's work, as a rank stuck in I/O or a deadlock does; the
  other ranks then wait inside a collective), ``spin`` (busy-loop ``seconds`` on every step from ``step`` on:
  a straggler) or ``sleep`` (sleep ``seconds`` on every step from ``step`` on: a slow job to interrupt).
- ``rank``: the global rank it happens on (default 0; ``all``: every rank).
- ``step``: the step it happens at (default 1).
- ``attempt``: the torchrun restart count it happens in (default 0, the first attempt; ``all``: every attempt),
  so a restarted job does not fail again.
- ``seconds``: the length of ``spin`` and ``sleep`` (default 0.1).

Several faults are separated by ``;`` and act in order: ``action=sleep,rank=all,attempt=all,seconds=0.5;
action=kill,rank=1,step=9`` is a job of slow steps in which rank 1 dies as step 9 begins.

Unset (the normal case), `fault_from_environment` returns ``None`` and the trainer calls nothing.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV_VAR = "COLO_FAULT"
_ACTIONS = ("kill", "raise", "hang", "spin", "sleep")


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring for the fields)."""

    action: str
    rank: int | None = 0
    step: int = 1
    attempt: int | None = 0
    seconds: float = 0.1

    def before_step(self, step: int, *, rank: int) -> None:
        """Act if ``step`` (about to run) on ``rank`` in this restart attempt is where the fault happens."""
        if self.rank is not None and rank != self.rank:
            return
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.attempt is not None and attempt != self.attempt:
            return
        if self.action == "sleep":
            if step >= self.step:
                time.sleep(self.seconds)
            return
        if self.action == "spin":
            if step >= self.step:
                deadline = time.thread_time() + self.seconds  # CPU work, as a slow rank does
                while time.thread_time() < deadline:
                    pass
            return
        if step != self.step:
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "raise":
            raise RuntimeError(f"{ENV_VAR}: injected failure on rank {rank} at step {step}")
        while True:  # hang
            time.sleep(3600)


def parse_fault(text: str) -> Fault:
    """A `Fault` from the ``COLO_FAULT`` syntax; ``ValueError`` naming the bad part otherwise."""
    fields: dict[str, object] = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("action", "rank", "step", "attempt", "seconds"):
            raise ValueError(f"{ENV_VAR}={text!r}: {part!r} is not one of action=, rank=, step=, attempt=, seconds=")
        if key == "action":
            if value not in _ACTIONS:
                raise ValueError(f"{ENV_VAR}={text!r}: action must be one of {list(_ACTIONS)}")
            fields[key] = value
        elif key == "seconds":
            fields[key] = float(value)
        else:
            fields[key] = None if value == "all" and key in ("rank", "attempt") else int(value)
    if "action" not in fields:
        raise ValueError(f"{ENV_VAR}={text!r}: give action=kill|raise|hang|spin|sleep")
    return Fault(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Faults:
    """The faults of one ``COLO_FAULT`` value, acting in order before every step."""

    faults: tuple[Fault, ...]

    def before_step(self, step: int, *, rank: int) -> None:
        """`Fault.before_step` of each."""
        for fault in self.faults:
            fault.before_step(step, rank=rank)


def fault_from_environment() -> Faults | None:
    """The faults ``COLO_FAULT`` asks for (``;``-separated), or ``None`` when it is unset."""
    text = os.environ.get(ENV_VAR, "").strip()
    parts = [part for part in text.split(";") if part.strip()]
    return Faults(tuple(parse_fault(part) for part in parts)) if parts else None
