"""Which implementation runs a collective, per backend and message size.

Some backends are slow or incomplete for some collectives: gloo's own reduce_scatter is slower than its
all_reduce from about 1 MB up (an all-reduce and a local slice, twice the bytes, is then faster), its own
all_gather is about half as fast as sending each piece straight to each rank from 1 MB up, and gloo has no uneven
all-gather (colo pads). The forms:

- ``native``: torch.distributed's own collective.
- ``all_reduce``: reduce_scatter as an all-reduce and a local slice; all_gather as an all-reduce of a zero buffer
  holding this rank's piece (twice the bytes in both cases).
- ``all_to_all`` (reduce_scatter): an all-to-all of the parts, then a local reduction of this rank's copies.
- ``p2p``: batched point-to-point sends and receives between every pair of ranks (a direct exchange, fine within
  a host, not a ring for many ranks): all_gather sends this rank's piece to each rank and receives theirs into
  their regions of the output; reduce_scatter sends each rank its part and adds the copies of its own it gets.

Calibrated on 2 CPU ranks (``python -m colo.comm.bench --nprocs 2 --calibrate PATH``; the figures are in
``benchmarks/results/comm_algorithms_cpu.json``): all_gather at 16 MiB takes 6.8 ms as p2p against 13.2 ms native,
so gloo's table uses p2p from 1 MiB; inside ZeRO-3 it also measured faster and lighter (no gloo staging buffer).
The all-to-all and p2p reduce_scatter forms are the fastest in isolation (8.8-9.9 ms at 16 MiB against 16.3 ms as
all-reduce and 18.6 ms native), but not inside ZeRO: their local reduction runs on the caller's thread when the
handle is waited on and their receive buffer stays alive per reduction in flight; ZeRO-2 measured 4-12% fewer
tokens/s with the all-to-all form and ZeRO-3 no gain with the p2p one (`benchmarks/zero_dp.py`,
`benchmarks/zero_profile.py`, alternated A/B), so reduce_scatter stays an all-reduce from 1 MiB. The table maps
``backend -> op -> [(min_bytes, algorithm), ...]``: the last entry whose ``min_bytes`` does not exceed the message
size wins; calibrate on your own machine and point ``COLO_COMM_ALGORITHMS`` at the JSON file it writes (or call
`load_algorithm_table`), or `force_algorithm`, to use other choices.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

ALTERNATIVES: dict[str, tuple[str, ...]] = {
    "reduce_scatter": ("native", "all_reduce", "all_to_all", "p2p"),
    "all_gather": ("native", "all_reduce", "p2p"),
}
"""For each collective with a choice, its implementations: ``native`` is torch.distributed's own."""

BUILTIN_TABLE: dict[str, dict[str, list[tuple[int, str]]]] = {
    "gloo": {
        "reduce_scatter": [(0, "native"), (1 << 20, "p2p")],
        "all_gather": [(0, "native"), (1 << 20, "p2p")],
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
    """The table in force: the built-in one, overlaid by ``COLO_COMM_ALGORITHMS`` or `load_algorithm_table`.

    Loaded on first use, outside compiled code: a collective traced by ``torch.compile`` inside an autograd function
    may not change module state, so there the table is built without being kept (load it first, as
    ``compile_blocks`` does, so that compiled code only reads it)."""
    if _table:
        return _table
    table = _validate(BUILTIN_TABLE)
    env_path = os.environ.get("COLO_COMM_ALGORITHMS")
    if env_path:
        for backend, ops in _validate(json.loads(Path(env_path).read_text()).get("table", {})).items():
            table.setdefault(backend, {}).update(ops)
    if not torch.compiler.is_compiling():
        _table.update(table)
    return table


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
