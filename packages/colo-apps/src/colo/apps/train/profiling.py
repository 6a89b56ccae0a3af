"""Profiling a run (``profile.*``): `torch.profiler` traces over windows of steps, one Chrome / Perfetto JSON file
per window and profiled rank, and, on CUDA, the allocator's memory history with snapshots.

Window ``k`` ends at step ``k * every_steps``: the profiler idles, warms up for ``warmup_steps`` steps (running,
its events dropped) and records the last ``active_steps`` steps, then writes
``output_dir/profile/rank-R-step-N.json`` (``N``: the window's last step; a run that stops inside a window writes
what it recorded at its last step). The trace holds torch's ops and colo's named ranges (`colo.comm.regions`):
``colo.forward`` / ``colo.backward`` / ``colo.optimizer_step`` per step, every collective (``colo.all_reduce[dp]
1.2 MiB``, ``colo.wait reduce_scatter[dp]``), pipeline actions (``colo.pp F mb3 chunk0``), ``colo.rollout`` /
``colo.generate``, ``colo.checkpoint save``. Open it in ui.perfetto.dev or chrome://tracing.

With ``profile.memory_history`` (CUDA only) the allocator records its history from the first step (at most
`MEMORY_HISTORY_ENTRIES` events); a snapshot goes to ``output_dir/profile/memory-rank-R-step-N.pickle`` at the end of
every window and when a step runs out of memory (then the error is raised on). The snapshot is torch's own format
(a pickle: open it at pytorch.org/memory_viz, never load one you did not write).

Profiling off (``profile.every_steps`` unset, or a rank not in ``profile.ranks``) builds a `NoProfiler`: no
profiler object, no hook, nothing per step but a method call that returns.
"""

from __future__ import annotations

import os

import torch

from .config import ProfileSection

MEMORY_HISTORY_ENTRIES = 100_000
"""How many allocator events the memory history keeps (the newest)."""


class NoProfiler:
    """What a run without profiling (or a rank that does not profile) uses: every method does nothing."""

    def __enter__(self) -> NoProfiler:
        return self

    def __exit__(self, *exc_info) -> bool:
        return False

    def start(self, start_step: int) -> None:
        """Nothing to start."""

    def step(self, step: int) -> None:
        """Nothing to record."""


class StepProfiler:
    """`torch.profiler.profile` over windows of steps on this rank (see the module docstring).

    Use it as a context around the training loop: `start` before the first step, `step` after each one; leaving
    the context stops the profiler (writing a window cut short) and, after an out-of-memory error, writes a memory
    snapshot.

    Args:
        settings: the ``profile`` section (``every_steps`` set).
        output_dir: the run directory; traces go to its ``profile/``.
        rank: this process's global rank (in the file names).
        device: the compute device (CUDA activity is recorded on CUDA).
    """

    def __init__(self, settings: ProfileSection, *, output_dir: str, rank: int, device: torch.device) -> None:
        self.settings = settings
        self.directory = os.path.join(output_dir, "profile")
        self.rank = rank
        self.device = device
        self.profiler: torch.profiler.profile | None = None
        self.start_step = 0
        self.last_step = 0
        self.traces: list[str] = []
        """The trace files written so far."""

    # --- the schedule -------------------------------------------------------------------------------------------

    def action(self, step: int) -> torch.profiler.ProfilerAction:
        """What the profiler does during ``step`` (1-based, the run's own count): the window ending at the next
        multiple of ``every_steps`` records its last ``active_steps`` steps after ``warmup_steps`` of warm-up."""
        every, active = self.settings.every_steps, self.settings.active_steps
        position = (step - 1) % every + 1  # 1 .. every
        first_active = every - active + 1
        if position < first_active - self.settings.warmup_steps:
            return torch.profiler.ProfilerAction.NONE
        if position < first_active:
            return torch.profiler.ProfilerAction.WARMUP
        if position < every:
            return torch.profiler.ProfilerAction.RECORD
        return torch.profiler.ProfilerAction.RECORD_AND_SAVE

    def _schedule(self, step_num: int) -> torch.profiler.ProfilerAction:
        return self.action(self.start_step + step_num + 1)  # torch counts the profiler's steps from 0

    # --- the loop -----------------------------------------------------------------------------------------------

    def __enter__(self) -> StepProfiler:
        return self

    def start(self, start_step: int) -> None:
        """Start profiling before step ``start_step + 1`` (``start_step``: the step a resumed run starts after)."""
        self.start_step = self.last_step = start_step
        os.makedirs(self.directory, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.settings.memory_history:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=self._schedule,
            on_trace_ready=self._write_trace,
            record_shapes=self.settings.record_shapes,
        )
        self.profiler.start()

    def step(self, step: int) -> None:
        """After step ``step``: move the profiler on (it writes a trace when a window ends)."""
        self.last_step = step
        if self.settings.memory_history and step % self.settings.every_steps == 0:
            self._write_memory_snapshot(step)
        self.profiler.step()

    def __exit__(self, kind, error, traceback) -> bool:
        if self.profiler is None:
            return False
        if isinstance(error, torch.cuda.OutOfMemoryError) and self.settings.memory_history:
            self._write_memory_snapshot(self.last_step + 1)  # the step that ran out of memory
        profiler, self.profiler = self.profiler, None
        profiler.stop()  # writes the window in progress, if it recorded anything
        if self.settings.memory_history:
            torch.cuda.memory._record_memory_history(enabled=None)
        return False

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        path = os.path.join(self.directory, f"rank-{self.rank}-step-{self.last_step}.json")
        if path in self.traces:  # the run ended as a window was saved and the next one (active at once) holds no step
            return
        profiler.export_chrome_trace(path)
        self.traces.append(path)

    def _write_memory_snapshot(self, step: int) -> None:
        path = os.path.join(self.directory, f"memory-rank-{self.rank}-step-{step}.pickle")
        torch.cuda.memory._dump_snapshot(path)


def build_profiler(
    settings: ProfileSection, *, output_dir: str, rank: int, device: torch.device
) -> StepProfiler | NoProfiler:
    """The profiler of this rank: a `StepProfiler` when ``settings.every_steps`` is set and ``rank`` is one of
    ``settings.ranks`` (``None``: every rank), else a `NoProfiler`.

    Raises:
        ValueError: ``profile.memory_history`` on a device other than CUDA (the allocator history is CUDA's).
    """
    if settings.memory_history and device.type != "cuda":
        raise ValueError(
            f"profile.memory_history records the CUDA allocator's history, but this run computes on {device.type}; "
            "set profile.memory_history=false (or run on a GPU)"
        )
    if settings.every_steps is None or (settings.ranks is not None and rank not in settings.ranks):
        return NoProfiler()
    return StepProfiler(settings, output_dir=output_dir, rank=rank, device=device)
