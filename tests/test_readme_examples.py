"""Every python block of the READMEs is an example file, byte for byte, and every example file runs and checks itself.

A README block is paired with its file by an HTML comment on the line just before the fence::

    <!-- example: examples/comm/all_reduce.py -->
    ```python
    ...
    ```

so a block cannot drift from its file, and a python block without the comment is an error (no fragments that look
runnable but are not). Each file under ``examples/`` then runs the way a user runs it, ``python
examples/<package>/<name>.py``: in a subprocess (the distributed ones start 2 local CPU ranks with
``colo.comm.launch``), with ``OMP_NUM_THREADS=1`` (and ``TRITON_INTERPRET=1`` without CUDA), from an empty working
directory with an empty ``TMPDIR`` of its own. It must exit 0, print a last line starting with ``ok:`` (examples
assert their own results before printing it), and leave both directories empty.

Starting Python, torch and the ranks is most of each example's time (about 2 s of CPU per process), so the selected
examples run two at a time, started together by a module fixture; each example's test waits for its own run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
EXAMPLES = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "examples").rglob("*.py"))
MARKER = re.compile(r"<!-- example: (\S+) -->")
FENCE = "```"
EXAMPLE_TIMEOUT = 300  # seconds for one example; each takes 2-15 s of CPU, but the machine may be shared
NUM_PARALLEL = 2  # examples running at once


@dataclass(frozen=True)
class Block:
    readme: str
    line: int  # 1-based line of the opening fence
    example: str | None  # the path the marker names, None without a marker
    text: str


def python_blocks(readme: Path) -> list[Block]:
    """The ```python blocks of ``readme`` with the example marker on the line before each, if any."""
    lines = readme.read_text().splitlines(keepends=True)
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].rstrip("\n") != FENCE + "python":
            i += 1
            continue
        start = i
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        i += 1
        while i < len(lines) and lines[i].rstrip("\n") != FENCE:
            i += 1
        name = readme.relative_to(ROOT).as_posix()
        blocks.append(Block(name, start + 1, marker.group(1) if marker else None, "".join(lines[start + 1 : i])))
        i += 1
    return blocks


BLOCKS = [block for readme in READMES for block in python_blocks(readme)]


def test_every_readme_python_block_is_an_example():
    unmarked = [f"{b.readme}:{b.line}" for b in BLOCKS if b.example is None]
    assert not unmarked, (
        f"python blocks without an '<!-- example: examples/... -->' line before them: {unmarked}; keep the code as "
        "a file under examples/ that runs and checks itself, and name it in that comment"
    )
    missing = [f"{b.readme}:{b.line} names {b.example}" for b in BLOCKS if b.example and b.example not in EXAMPLES]
    assert not missing, f"example files that do not exist: {missing}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.example], ids=lambda b: f"{b.readme}:{b.line}")
def test_readme_block_is_its_example_file(block: Block):
    expected = (ROOT / block.example).read_text()
    assert block.text == expected, (
        f"{block.readme} line {block.line} differs from {block.example}: copy the file into the block verbatim"
    )


def test_every_example_is_shown_in_a_readme():
    shown = {b.example for b in BLOCKS}
    assert not [e for e in EXAMPLES if e not in shown], "examples no README shows; add each to its package's README"


@dataclass
class Run:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    cpu_seconds: float  # user + system time of the example and the ranks it started
    leftovers: list[str]

    def describe(self, example: str) -> str:
        status = "timed out" if self.returncode is None else f"exit status {self.returncode}"
        return f"{example}: {status} after {self.seconds:.1f} s\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run_example(example: str, workdir: Path) -> Run:
    """``python <example>`` from an empty directory with an empty TMPDIR; its process group is killed on timeout."""
    cwd, tmp = workdir / "cwd", workdir / "tmp"
    cwd.mkdir(parents=True)
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "torchinductor")  # torch makes it at import; not a leftover
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    started = time.perf_counter()
    with open(workdir / "stdout", "w") as stdout, open(workdir / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / example)],
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # the example and the ranks it spawns: one process group to kill on timeout
        )
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        os.killpg(process.pid, signal.SIGKILL)

    timer = threading.Timer(EXAMPLE_TIMEOUT, kill)
    timer.start()
    _, status, usage = os.wait4(process.pid, 0)  # reaps it, with the CPU time of it and its waited-for children
    timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    leftovers = [p.relative_to(workdir).as_posix() for d in (cwd, tmp) for p in sorted(d.rglob("*"))]
    return Run(
        None if timed_out.is_set() else process.returncode,
        (workdir / "stdout").read_text(),
        (workdir / "stderr").read_text(),
        seconds,
        usage.ru_utime + usage.ru_stime,
        leftovers,
    )


@pytest.fixture(scope="module")
def example_runs(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """Start every selected example's run, ``NUM_PARALLEL`` at a time; each test waits for its own."""
    selected = [
        item.callspec.params["example"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_example_runs" and item.module is request.module
    ]
    pool = ThreadPoolExecutor(max_workers=NUM_PARALLEL, thread_name_prefix="example")
    runs = {}
    for example in selected:
        workdir = tmp_path_factory.mktemp(Path(example).stem)
        runs[example] = pool.submit(run_example, example, workdir)
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(example: str, example_runs: dict[str, Future], tmp_path: Path):
    future = example_runs.get(example)  # started by the fixture; run here if a plugin reordered the selection
    run = future.result() if future is not None else run_example(example, tmp_path)
    print(f"{example}: {run.seconds:.1f} s, {run.cpu_seconds:.1f} s of CPU")
    assert run.returncode == 0, run.describe(example)
    lines = run.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("ok:"), f"no final 'ok:' line\n{run.describe(example)}"
    assert not run.leftovers, f"{example} left files behind: {run.leftovers}"
