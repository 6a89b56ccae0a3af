"""What `colo report` reads of a run's profiler traces (``profile/rank-R-step-N.json``, `colo.apps.train.profiling`):
for the newest window, each rank's colo ranges of its last profiled step, in ms from that step's start, with their
nesting depth and kind.

The Chrome trace is read as a stream of events (`json.JSONDecoder.raw_decode` over chunks of the file): only the
complete ranges (``"ph": "X"``) named ``colo.*`` or ``ProfilerStep#k`` are kept, so a trace of millions of torch
ops costs the ranges drawn, not the file, in memory.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

TRACE_FILE = re.compile(r"rank-(\d+)-step-(\d+)\.json")
"""The trainer's trace files under ``output_dir/profile``."""
_PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)")
_CHUNK_CHARS = 1 << 20

KINDS = ("forward", "backward", "optimizer", "communication", "pipeline", "checkpoint", "other")
"""What a colo range is, for its colour: the step's phases, a collective or a wait (``colo.all_reduce[dp] 8 B``,
``colo.wait reduce_scatter[dp]``, ``colo.loss all-reduce``), a pipeline action (``colo.pp F mb3 chunk0``), a
checkpoint save, or another range (``colo.rollout``, ``colo.generate ...``)."""


def range_kind(name: str) -> str:
    """The `KINDS` entry of the colo range ``name``."""
    if name == "colo.forward":
        return "forward"
    if name == "colo.backward":
        return "backward"
    if name == "colo.optimizer_step":
        return "optimizer"
    if name.startswith("colo.pp "):
        return "pipeline"
    if name.startswith("colo.checkpoint"):
        return "checkpoint"
    if (
        name.startswith("colo.wait ")
        or name == "colo.comm_wait"
        or name.endswith(" all-reduce")  # colo.loss all-reduce, colo.token count all-reduce
        or re.match(r"colo\.\w+\[[^\]]*\]", name)  # a collective: colo.<op>[<axis>] <bytes>
    ):
        return "communication"
    return "other"


@dataclass(frozen=True)
class TraceRange:
    """One colo range of a rank's step as drawn.

    Attributes:
        name: the range's name (``colo.backward``).
        kind: its `KINDS` entry.
        start_ms: its start in ms after the step's start.
        duration_ms: its length in ms.
        depth: how many drawn ranges enclose it (0: a top-level range of the step, such as ``colo.forward``).
    """

    name: str
    kind: str
    start_ms: float
    duration_ms: float
    depth: int


@dataclass(frozen=True)
class RankStep:
    """One rank's drawn step: the last step of its trace that holds colo ranges.

    Attributes:
        path: the trace file.
        profiler_step: torch's ``ProfilerStep#k`` number of the step (counted from the profiler's start), ``None`` for
            a trace without ``ProfilerStep`` ranges (then the whole trace is the step).
        duration_ms: the step's length (the ``ProfilerStep`` range, or first colo start to last colo end).
        ranges: its colo ranges in start order.
    """

    path: str
    profiler_step: int | None
    duration_ms: float
    ranges: list[TraceRange]


def newest_window(run_dir: str) -> tuple[int, dict[int, str]] | None:
    """``(N, {rank: path})`` of the newest profiler window under ``run_dir/profile`` (the highest ``N`` of the
    ``rank-R-step-N.json`` files, with every rank that wrote one for it), or ``None`` when there are none."""
    directory = os.path.join(run_dir, "profile")
    if not os.path.isdir(directory):
        return None
    windows: dict[int, dict[int, str]] = {}
    for entry in os.scandir(directory):
        if match := TRACE_FILE.fullmatch(entry.name):
            windows.setdefault(int(match.group(2)), {})[int(match.group(1))] = entry.path
    if not windows:
        return None
    step = max(windows)
    return step, dict(sorted(windows[step].items()))


def read_rank_step(path: str) -> RankStep:
    """The last step of the trace ``path`` that holds colo ranges: the ``ProfilerStep#k`` range with the highest
    start holding one (a window cut short by the run's end may close on an empty one), and the colo ranges that
    start inside it, in ms from its start, each with its nesting depth (`_depths`).

    Raises:
        ValueError: ``path`` is not a Chrome trace (no ``traceEvents`` array, malformed JSON) or holds no colo range.
    """
    steps, ranges = [], []
    for event in _trace_events(path):
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        name, start, duration = event.get("name"), event.get("ts"), event.get("dur")
        if not (isinstance(name, str) and _is_number(start) and _is_number(duration)):
            continue
        if name.startswith("colo."):
            ranges.append((float(start), float(duration), name))
        elif match := _PROFILER_STEP.fullmatch(name):
            steps.append((float(start), float(duration), int(match.group(1))))
    if not ranges:
        raise ValueError(f"{path} holds no colo.* range: is it a trace of a colo run (profile.every_steps)?")
    chosen = None
    for start, duration, number in sorted(steps, reverse=True):
        inside = [r for r in ranges if start <= r[0] < start + duration]
        if inside:
            chosen, ranges = (start, duration, number), inside
            break
    if chosen is None:  # no ProfilerStep (or none holding a range): the whole trace is the step
        origin = min(r[0] for r in ranges)
        chosen = (origin, max(r[0] + r[1] for r in ranges) - origin, None)
    origin, duration, number = chosen
    ranges.sort(key=lambda r: (r[0], -r[1]))
    drawn = [
        TraceRange(name, range_kind(name), (start - origin) / 1e3, length / 1e3, depth)
        for (start, length, name), depth in zip(ranges, _depths(ranges), strict=True)
    ]
    return RankStep(path=path, profiler_step=number, duration_ms=duration / 1e3, ranges=drawn)


def _depths(ranges: list[tuple[float, float, str]]) -> list[int]:
    """Each range's lane (``ranges``: ``(start, duration, name)`` sorted by start, longest first): one below the
    deepest range that encloses it, moved further down past any open range it overlaps without being inside it
    (ranges of other threads may), so no two drawn bars of a rank cover each other."""
    depths: list[int] = []
    open_: list[tuple[float, float, int]] = []  # (start, end, depth) of the ranges not yet ended
    for start, duration, _ in ranges:
        end = start + duration
        open_ = [r for r in open_ if r[1] > start]
        enclosing = [d for s, e, d in open_ if s <= start and end <= e]
        depth = max(enclosing) + 1 if enclosing else 0
        taken = {d for _, _, d in open_}
        while depth in taken:
            depth += 1
        depths.append(depth)
        open_.append((start, end, depth))
    return depths


def _trace_events(path: str):
    """The events of the Chrome trace ``path`` one at a time: its ``traceEvents`` array (or the whole file, when it
    is a bare array), decoded a chunk of the file at a time."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as file:
        buffer, eof = file.read(_CHUNK_CHARS), False

        def more() -> bool:
            nonlocal buffer, eof
            chunk = "" if eof else file.read(_CHUNK_CHARS)
            eof = not chunk
            buffer += chunk
            return not eof

        if buffer.lstrip().startswith("["):
            position = buffer.index("[") + 1
        else:
            while (key := buffer.find('"traceEvents"')) < 0 and more():
                pass
            while key >= 0 and (bracket := buffer.find("[", key)) < 0 and more():
                pass
            if key < 0 or bracket < 0:
                raise ValueError(f"{path} is not a Chrome trace: it has no traceEvents array")
            position = bracket + 1
        while True:
            while True:  # skip whitespace and commas, reading on at the chunk's end
                while position < len(buffer) and buffer[position] in " \t\r\n,":
                    position += 1
                if position < len(buffer) or not more():
                    break
            if position >= len(buffer):
                raise ValueError(f"{path} ends inside its traceEvents array (a trace cut short?)")
            if buffer[position] == "]":
                return
            try:
                event, end = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError as error:
                if more():  # the event runs past the chunk: read on and decode it again
                    continue
                raise ValueError(f"{path} is not a Chrome trace: {error}") from None
            yield event
            position = end
            if position > _CHUNK_CHARS:  # drop what was decoded
                buffer, position = buffer[position:], 0


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
