"""Surviving failures in the trainer: preemption, time-based checkpoints, a hang watchdog, straggler statistics and
the per-attempt rank records that let a restarted (or failed) job say which rank failed and why.

- Preemption: SIGTERM (what schedulers send before killing a job; torchrun forwards it to its workers) sets a flag.
  After every step the ranks exchange their flags in one small all-gather, so all of them see the signal at the
  same step, write a checkpoint there and exit with `PREEMPTED_EXIT_CODE`; the next launch resumes from it.
- Time-based checkpoints (``checkpoint.every_minutes``): rank 0 decides when the interval has passed and its vote
  travels in the same all-gather, so every rank saves at the same step.
- Stragglers: each rank's busy time of the step (the main thread's CPU time on CPU devices, where waiting inside a
  collective costs none; wall time on CUDA) travels in the same all-gather; the log steps report the spread.
- Watchdog (``resilience.watchdog_seconds``): a thread per rank; when no step has ended for that long it writes the
  rank's Python stacks (`faulthandler`) and the last collective the rank entered (`colo.comm.last_collective`)
  to ``output_dir/hang/rank-R.txt`` and ends the process with `HUNG_EXIT_CODE`, failing the job instead of
  waiting forever (torchrun then restarts it if restarts are left).
- Attempt records: every rank writes ``output_dir/attempts/attempt-K-rank-R.json`` (K: torchrun's restart count)
  when it starts and again when it ends (done, preempted, failed with the error, hung). A rank that left only the
  start record died without raising: killed by a signal (SIGKILL, the OOM killer) or its host was lost.
  `describe_attempt` turns the records into the line a restarted job (and ``colo launch`` at the end) prints.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from colo.comm import all_gather, last_collective, world_group

from .faults import fault_from_environment

PREEMPTED_EXIT_CODE = 75
"""Exit code of a rank (and of ``colo train`` / ``colo launch``) that stopped on SIGTERM after writing a checkpoint
(75 is ``EX_TEMPFAIL``: run the same command again and it resumes)."""

HUNG_EXIT_CODE = 86
"""Exit code of a rank the watchdog ended because no step finished within ``resilience.watchdog_seconds``."""


@dataclass
class Agreement:
    """What the ranks agreed on after a step.

    Attributes:
        stop: some rank got SIGTERM: checkpoint now and exit.
        save: rank 0 says ``checkpoint.every_minutes`` has passed since the last checkpoint.
        busy_seconds: every rank's busy time of the step, in rank order.
    """

    stop: bool
    save: bool
    busy_seconds: list[float] = field(default_factory=list)


class RunGuard:
    """The trainer's failure handling for one run on one rank (see the module docstring).

    Args:
        output_dir: the run directory (hang dumps and attempt records go under it).
        rank: this process's global rank.
        world_size: ranks in the job.
        device: where the agreement's all-gather runs (the process group's device).
        every_minutes: ``checkpoint.every_minutes`` (``None``: no time-based checkpoints).
        watchdog_seconds: the hang threshold (``None``: no watchdog).
    """

    def __init__(
        self,
        output_dir: str,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        every_minutes: float | None = None,
        watchdog_seconds: float | None = None,
    ) -> None:
        self.output_dir, self.rank, self.world_size, self.device = output_dir, rank, world_size, device
        self.every_seconds = None if every_minutes is None else every_minutes * 60.0
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.signalled: str | None = None
        self.step = 0
        self._last_save = time.monotonic()
        self._busy_start = self._clock()
        self._window: list[list[float]] = []
        self.fault = fault_from_environment()  # chaos tests only (COLO_FAULT); None otherwise
        self._previous_handler = None
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._write_record("running")
        self.watchdog = None
        if watchdog_seconds is not None:
            self.watchdog = Watchdog(watchdog_seconds, guard=self)

    # --- signals and the per-step agreement -------------------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = signal.Signals(signum).name

    def _clock(self) -> float:
        return time.thread_time() if self.device.type == "cpu" else time.perf_counter()

    def step_begins(self, step: int) -> None:
        """Call before step ``step`` runs: restarts the busy timer and feeds the watchdog."""
        self.step = step - 1
        if self.watchdog is not None:
            self.watchdog.beat()
        self._busy_start = self._clock()
        if self.fault is not None:
            self.fault.before_step(step, rank=self.rank)

    def agree(self, step: int) -> Agreement:
        """After step ``step`` (every rank): one all-gather of ``[SIGTERM seen, checkpoint due, busy seconds]``."""
        self.step = step
        busy = self._clock() - self._busy_start
        since_save = time.monotonic() - self._last_save
        due = self.rank == 0 and self.every_seconds is not None and since_save >= self.every_seconds
        mine = torch.tensor([[float(self.signalled is not None), float(due), busy]], dtype=torch.float64)
        if self.world_size > 1:
            gathered = all_gather(mine.to(self.device), group=world_group()).cpu()
        else:
            gathered = mine
        self._window.append(gathered[:, 2].tolist())
        if self.watchdog is not None:
            self.watchdog.beat()
        return Agreement(
            stop=bool(gathered[:, 0].max() > 0), save=bool(gathered[:, 1].max() > 0), busy_seconds=self._window[-1]
        )

    def saved(self) -> None:
        """A checkpoint was written: the time-based interval starts again."""
        self._last_save = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.beat()

    def straggler_metrics(self) -> dict[str, float | int]:
        """The spread of the ranks' mean busy step time since the last call (for the metrics log): the slowest
        rank, its time and the fastest's, and their ratio."""
        if not self._window or self.world_size == 1:
            self._window = []
            return {}
        per_rank = torch.tensor(self._window).mean(dim=0)
        self._window = []
        slowest, fastest = int(per_rank.argmax()), float(per_rank.min())
        return {
            "step_busy_max_s": float(per_rank[slowest]),
            "step_busy_min_s": fastest,
            "step_busy_spread": float(per_rank[slowest]) / fastest if fastest > 0 else float("inf"),
            "slowest_rank": slowest,
        }

    # --- attempt records --------------------------------------------------------------------------------------

    def _record_path(self, attempt: int, rank: int) -> str:
        return os.path.join(self.output_dir, "attempts", f"attempt-{attempt}-rank-{rank}.json")

    def _write_record(self, status: str, **extra) -> None:
        path = self._record_path(self.attempt, self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        record = {
            "rank": self.rank,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "status": status,
            "step": self.step,
            "time": time.time(),
            **extra,
        }
        with open(path + ".tmp", "w") as file:
            json.dump(record, file)
        os.replace(path + ".tmp", path)

    def finished(self, status: str, error: BaseException | None = None) -> None:
        """Record how this rank's attempt ended (``done``, ``preempted`` or ``failed`` with ``error``) and stop the
        watchdog and the SIGTERM handler."""
        if self.watchdog is not None:
            self.watchdog.close()
        extra = {"signal": self.signalled} if status == "preempted" else {}
        if error is not None:
            text = str(error).strip().splitlines()[0] if str(error).strip() else ""
            extra["error"] = f"{type(error).__name__}: {text}"[:500]
        self._write_record(status, **extra)
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def restart_report(self) -> str | None:
        """On a restarted attempt, the line saying how the previous attempt ended (``None`` on the first)."""
        if self.attempt == 0:
            return None
        return describe_attempt(self.output_dir, self.attempt - 1, self.world_size)


def read_attempt(output_dir: str, attempt: int, world_size: int | None) -> dict[int, dict | None]:
    """``{rank: its record of ``attempt`` (or None when it wrote none)}`` under ``output_dir/attempts``, for ranks
    ``0..world_size-1`` (``None``: the ranks that wrote one)."""
    if world_size is None:
        prefix = f"attempt-{attempt}-rank-"
        try:
            names = os.listdir(os.path.join(output_dir, "attempts"))
        except OSError:
            names = []
        ranks = sorted(
            int(name[len(prefix) : -5]) for name in names if name.startswith(prefix) and name.endswith(".json")
        )
    else:
        ranks = list(range(world_size))
    records: dict[int, dict | None] = {}
    for rank in ranks:
        path = os.path.join(output_dir, "attempts", f"attempt-{attempt}-rank-{rank}.json")
        try:
            with open(path) as file:
                records[rank] = json.load(file)
        except (OSError, ValueError):
            records[rank] = None
    return records


def latest_attempt(output_dir: str, *, since: float = 0.0) -> int | None:
    """The highest attempt number with records under ``output_dir/attempts`` written at or after ``since`` (a
    ``time.time()``; the launch's start, so records of earlier launches into the same directory do not count);
    ``None``: none."""
    root = os.path.join(output_dir, "attempts")
    try:
        names = os.listdir(root)
    except OSError:
        return None
    numbers = []
    for name in names:
        if name.startswith("attempt-") and name.endswith(".json"):
            try:
                with open(os.path.join(root, name)) as file:
                    record = json.load(file)
            except (OSError, ValueError):
                continue
            if record.get("time", 0) >= since:
                numbers.append(int(record["attempt"]))
    return max(numbers, default=None)


def describe_attempt(output_dir: str, attempt: int, world_size: int) -> str:
    """Which ranks of ``attempt`` failed and why, in one line, from their records.

    A rank whose record still says ``running`` died without raising (a signal: SIGKILL, the OOM killer, a lost
    host); failures of communication (a peer's connection reset or closed, a collective's timeout) are listed
    after the causes, as they are usually the peers noticing.
    """
    records = read_attempt(output_dir, attempt, world_size)
    reached = max((record["step"] for record in records.values() if record is not None), default=0)
    causes, followers = [], []
    for rank, record in records.items():
        if record is None:
            causes.append(f"rank {rank} left no record (it never started)")
        elif record["status"] == "running":
            causes.append(
                f"rank {rank} (pid {record['pid']} on {record['host']}) died without raising (the others had "
                f"finished step {reached}): killed by a signal (SIGKILL, the OOM killer) or its host was lost"
            )
        elif record["status"] == "hung":
            causes.append(f"rank {rank} hung after step {record['step']} (the watchdog's dump: {record.get('dump')})")
        elif record["status"] == "failed":
            text = f"rank {rank} raised {record.get('error')} after step {record['step']}"
            (followers if _is_peer_failure(str(record.get("error"))) else causes).append(text)
        elif record["status"] == "preempted":
            causes.append(f"rank {rank} was preempted ({record.get('signal', 'SIGTERM')}) at step {record['step']}")
    parts = causes + followers
    return f"attempt {attempt}: " + ("; ".join(parts) if parts else "every rank finished")


_PEER_FAILURES = ("CommError", "CommTimeoutError", "Connection reset", "Connection closed", "timed out", "Broken pipe")


def _is_peer_failure(error: str) -> bool:
    return any(marker in error for marker in _PEER_FAILURES)


class Watchdog:
    """A daemon thread that ends the process when the guard's heartbeat stops for ``seconds`` (see `RunGuard`)."""

    def __init__(self, seconds: float, *, guard: RunGuard) -> None:
        if seconds <= 0:
            raise ValueError(f"resilience.watchdog_seconds={seconds} must be positive (or null: no watchdog)")
        self.seconds, self.guard = seconds, guard
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="colo-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Progress: the threshold starts again."""
        self._last = time.monotonic()

    def close(self) -> None:
        """Stop watching (the run ended)."""
        self._stop.set()

    def _watch(self) -> None:
        poll = min(1.0, self.seconds / 10)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.seconds:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        guard = self.guard
        path = os.path.join(guard.output_dir, "hang", f"rank-{guard.rank}.txt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        collective = last_collective()
        with open(path, "w") as file:
            file.write(
                f"rank {guard.rank} (pid {os.getpid()} on {socket.gethostname()}): no step finished for {idle:.1f} s "
                f"(resilience.watchdog_seconds={self.seconds:g}) after step {guard.step}\n"
            )
            if collective is None:
                file.write("last collective entered: none\n")
            else:
                state = "returned" if collective["returned"] else f"still inside it after {collective['seconds']:.1f} s"
                file.write(
                    f"last collective entered: {collective['op']} {collective['detail']} on group "
                    f"'{collective['group']}' (ranks {collective['ranks']}), {state}\n"
                )
            file.write("\nPython stacks of every thread:\n")
            file.flush()
            faulthandler.dump_traceback(file, all_threads=True)
        guard._write_record("hung", dump=path, collective=collective)
        # the peers' watchdogs fire about now too (they wait for this rank): give them time to write their dumps
        # before this process's exit makes their collectives fail
        time.sleep(min(10.0, self.seconds / 2))
        print(
            f"colo: rank {guard.rank} hung: no step finished for {idle:.0f} s after step {guard.step}; stacks and the "
            f"last collective are in {path}; ending the process (exit code {HUNG_EXIT_CODE})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(HUNG_EXIT_CODE)
