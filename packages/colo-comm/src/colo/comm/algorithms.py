"""Which implementation runs a collective, per backend and message size.

Some backends are slow or incomplete for some collectives: gloo's own reduce_scatter is slower than its
all_reduce from about 1 MB up (an all-reduce and a local slice, twice the bytes, is then faster), and gloo has no
uneven all-gather (colo pads). A third form of reduce_scatter, an all-to-all of the parts followed by a local
reduction of this rank's copies (the reduce-scatter's own bytes), is the fastest in isolation on gloo
(``python -m colo.comm.bench --nprocs 2 --calibrate PATH``: 8.5 ms at 16 MiB against 13.3 ms native and 15.5 ms as
all-reduce), but not inside ZeRO: its local reduction runs on the caller's thread when the handle is waited on, and
its receive buffer (the message's size) stays alive per reduction in flight; ZeRO-2 on 2 CPU ranks measured 4-12%
fewer tokens/s and ~100 MB more memory with it (`benchmarks/zero_dp.py`, alternated A/B). So the built-in table
keeps the earlier calibration (``benchmarks/results/comm_algorithms_cpu.json`` records both): reduce_scatter as
all-reduce from 1 MiB; gloo's own all-gather at every size. The table maps ``backend -> op -> [(min_bytes,
algorithm), ...]``: the last entry whose ``min_bytes`` does not exceed the message size wins; calibrate on your
own machine and point ``COLO_COMM_ALGORITHMS`` at the JSON file it writes (or call `load_algorithm_table`), or
`force_algorithm`, to use other choices.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

ALTERNATIVES: dict[str, tuple[str, ...]] = {
    "reduce_scatter": ("native", "all_reduce", "all_to_all"),
    "all_gather": ("native", "all_reduce"),
}
"""For each collective with a choice, its implementations: ``native`` is torch.distributed's own."""

BUILTIN_TABLE: dict[str, dict[str, list[tuple[int, str]]]] = {
    "gloo": {
        "reduce_scatter": [(0, "native"), (1 << 20, "all_reduce")],
        "all_gather": [(0, "native")],
    },
    "nccl": {"reduce_scatter": [(0, "native")], "all_gather": [(0, "native")]},
}

_table: dict[str, dict[str, list[tuple[int, str]]]] = {}
_forced: dict[str, str] = {}


def _validate(table: dict) -> dict[str, dict[str, list[tuple[int, str]]]]:
    clean: dict[str, dict[str, list[tuple[int, str]]]] = {}
    for backend, ops in table.items():
        for op, entries in ops.items():
            if op not in ALTERNATIVES:
                raise ValueError(
                    f"algorithm table names op {op!r}, which has no alternatives; known: {list(ALTERNATIVES)}"
                )
            rows = sorted((int(min_bytes), str(name)) for min_bytes, name in entries)
            for _, name in rows:
                if name not in ALTERNATIVES[op]:
                    raise ValueError(f"algorithm {name!r} for {op} is unknown; choose from {ALTERNATIVES[op]}")
            clean.setdefault(backend, {})[op] = rows
    return clean


def load_algorithm_table(path: str | os.PathLike) -> None:
    """Use the table in a JSON file written by ``python -m colo.comm.bench --calibrate``."""
    data = json.loads(Path(path).read_text())
    _table.clear()
    _table.update(_validate(data.get("table", data)))


def current_table() -> dict[str, dict[str, list[tuple[int, str]]]]:
    """The table in force: the built-in one, overlaid by ``COLO_COMM_ALGORITHMS`` or `load_algorithm_table`."""
    if not _table:
        _table.update(_validate(BUILTIN_TABLE))
        env_path = os.environ.get("COLO_COMM_ALGORITHMS")
        if env_path:
            for backend, ops in _validate(json.loads(Path(env_path).read_text()).get("table", {})).items():
                _table.setdefault(backend, {}).update(ops)
    return _table


def choose_algorithm(op: str, backend: str, nbytes: int) -> str:
    """The implementation of ``op`` to run on ``backend`` for a message of ``nbytes`` bytes."""
    if op in _forced:
        return _forced[op]
    rows = current_table().get(backend, {}).get(op)
    if not rows:
        return "native"
    chosen = rows[0][1]
    for min_bytes, name in rows:
        if nbytes >= min_bytes:
            chosen = name
    return chosen


@contextlib.contextmanager
def force_algorithm(op: str, algorithm: str) -> Iterator[None]:
    """Run ``op`` with ``algorithm`` regardless of size inside the block (for tests and benchmarks)."""
    if algorithm not in ALTERNATIVES.get(op, ("native",)):
        raise ValueError(
            f"algorithm {algorithm!r} for {op} is unknown; choose from {ALTERNATIVES.get(op, ('native',))}"
        )
    previous = _forced.get(op)
    _forced[op] = algorithm
    try:
        yield
    finally:
        if previous is None:
            _forced.pop(op, None)
        else:
            _forced[op] = previous
