"""The workers of `colo data prepare`: each work unit tokenized into one shard, in processes forked from a server.

The server (multiprocessing's ``forkserver``) imports this module once; each worker forked from it loads the
tokenizer from its path (`HFTokenizer`) or builds the byte tokenizer, and its Rust thread pool gets the worker's share
of the CPUs. A worker streams its unit (`colo.apps.data.units.read_unit`), encodes ``_BATCH_DOCUMENTS`` documents
per batched call and appends them framed ``[bos] tokens [eos]`` through one `ShardWriter`, so its memory is bounded by
a batch; the shard's record is written beside it (``shard-NNNNN.json``) once its files are complete.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .shards import CorpusError, ShardWriter, _write_atomically
from .tokenizer import HFTokenizer, encode_arrays, load_tokenizer
from .units import WorkUnit, read_unit

_BATCH_DOCUMENTS = 1024  # documents tokenized per batched call in a worker
_BATCH_CHARS = 4 << 20  # ... or fewer, once this many characters are pending


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class ShardJob:
    """What every worker needs besides its unit (plain values: sent to spawned processes)."""

    def __init__(self, out: str, text_field: str, dtype: str, digest: str) -> None:
        self.out, self.text_field, self.dtype, self.digest = out, text_field, dtype, digest


def run_units(todo: list[WorkUnit], job: ShardJob, tokenizer, spec, *, workers: int, progress: bool):
    """Tokenize ``todo`` (biggest first) in ``workers`` processes (in this one when ``workers`` is 1 or one unit is
    left), yielding each shard's record as it finishes."""
    bar = _Progress(sum(unit.weight for unit in todo), len(todo)) if progress and todo else None
    order = sorted(todo, key=lambda unit: (-unit.weight, unit.number))
    try:
        if workers == 1 or len(todo) == 1:
            for unit in order:
                record = prepare_unit(unit, job, tokenizer)
                if bar:
                    bar.advance(unit.weight)
                yield record
            return
        yield from _run_in_processes(order, job, spec, workers=workers, bar=bar)
    finally:
        if bar:
            bar.stop()


def start_forkserver():
    """Start the server the workers fork from, in the background; it imports this module (colo, torch) once."""
    import multiprocessing
    import threading
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    threading.Thread(target=forkserver.ensure_running, name="colo-forkserver", daemon=True).start()
    return context


def _run_in_processes(order: list[WorkUnit], job: ShardJob, spec, *, workers: int, bar):
    context = start_forkserver()
    threads = max(1, available_cpus() // workers)
    with ProcessPoolExecutor(
        min(workers, len(order)), mp_context=context, initializer=_init_worker, initargs=(spec, threads)
    ) as pool:
        pending = {pool.submit(_prepare_in_worker, unit.to_json(), job): unit for unit in order}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    unit = pending.pop(future)
                    try:
                        record = future.result()
                    except BrokenProcessPool:
                        raise CorpusError(
                            f"a worker died while tokenizing {unit.name} (out of memory, or killed); the finished "
                            "shards are kept: run the same colo data prepare again to resume"
                        ) from None
                    if bar:
                        bar.advance(unit.weight)
                    yield record
        except BaseException:
            # An input error (or Ctrl-C) ends the run now: the other workers' units are not waited for (their
            # partial files are rewritten by the next run).
            processes = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            raise


_WORKER_TOKENIZER = None


def _init_worker(spec, threads: int) -> None:
    """Load the tokenizer once per worker process; its Rust thread pool gets this worker's share of the CPUs."""
    global _WORKER_TOKENIZER
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    if spec is None or isinstance(spec, str):
        _WORKER_TOKENIZER = load_tokenizer(spec)
    elif isinstance(spec, tuple):
        path, bos_id, eos_id, pad_id = spec
        _WORKER_TOKENIZER = HFTokenizer(path)
        _WORKER_TOKENIZER.bos_id, _WORKER_TOKENIZER.eos_id, _WORKER_TOKENIZER.pad_id = bos_id, eos_id, pad_id
    else:
        _WORKER_TOKENIZER = spec


def _prepare_in_worker(unit: dict, job: ShardJob) -> dict:
    return prepare_unit(WorkUnit.from_json(unit), job, _WORKER_TOKENIZER)


def prepare_unit(unit: WorkUnit, job: ShardJob, tokenizer) -> dict:
    """Tokenize one unit into its shard, streaming: ``_BATCH_DOCUMENTS`` documents (or ``_BATCH_CHARS``
    characters) are encoded in one batched call and written; returns the shard's record, also written beside it."""
    out = Path(job.out)
    writer = ShardWriter(out, unit.name, np.dtype(job.dtype))
    prefix = np.asarray([tokenizer.bos_id], dtype=np.int32)
    suffix = np.asarray([tokenizer.eos_id], dtype=np.int32)
    try:
        batch: list[str] = []
        chars = 0
        for text in read_unit(unit, text_field=job.text_field):
            batch.append(text)
            chars += len(text)
            if len(batch) >= _BATCH_DOCUMENTS or chars >= _BATCH_CHARS:
                _write_batch(writer, tokenizer, batch, prefix, suffix)
                batch, chars = [], 0
        if batch:
            _write_batch(writer, tokenizer, batch, prefix, suffix)
        shard = writer.finish()
    except BaseException:
        writer.abandon()
        raise
    record = {**asdict(shard), "fingerprint": job.digest, "unit": unit.to_json()}
    _write_atomically(out / f"{unit.name}.json", (json.dumps(record) + "\n").encode())
    return record


def _write_batch(writer: ShardWriter, tokenizer, texts: list[str], prefix: np.ndarray, suffix: np.ndarray) -> None:
    """Encode ``texts`` in one call and append them framed ``[bos] tokens [eos]``."""
    bodies = encode_arrays(tokenizer, texts)
    pieces = []
    for body in bodies:
        pieces += (prefix, body, suffix)
    lengths = np.fromiter((body.size for body in bodies), dtype=np.int64, count=len(bodies)) + 2
    writer.add_documents(np.concatenate(pieces), lengths)


class _Progress:
    """A rich progress bar on stderr over the input bytes of the units to tokenize."""

    def __init__(self, total_bytes: int, units: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn(f"tokenizing {units} shard{'s' if units != 1 else ''}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.task = self.progress.add_task("prepare", total=max(total_bytes, 1))
        self.progress.start()

    def advance(self, weight: int) -> None:
        self.progress.advance(self.task, weight)

    def stop(self) -> None:
        self.progress.stop()
