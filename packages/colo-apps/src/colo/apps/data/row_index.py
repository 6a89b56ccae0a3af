"""The row index of documents packed over a prepared corpus: computed once, cached as raw arrays beside it.

Packing whole documents into rows (``data.packing: documents``) needs to know which pieces of the stream each row
holds. Over a prepared corpus (`colo.apps.data.shards.TokenCorpus`) the documents are taken in order, in groups of
`GROUP_DOCUMENTS`; each document is cut into ``seq_len`` pieces from its start when longer than a row (the cuts of
`TokenBudgetDataset`), and each group's pieces are bin-packed by `pack_to_token_budget` (best fit, longest first)
into rows emitted in creation order. A corpus of at most `GROUP_DOCUMENTS` documents is thus packed exactly as
`TokenBudgetDataset` packs the same documents; a larger one group by group, so memory stays bounded by a group
(and one shard's document index) whatever the corpus's size, at an efficiency within a fraction of a percent of
packing it whole. The packing depends on the document sequence alone, not on how it is sharded.

The index is two files of little-endian ``int64``: ``.rows`` (``rows + 1`` offsets into the pieces: row ``r`` holds
pieces ``[rows[r], rows[r + 1])``) and ``.pieces`` (``(stream start, length)`` pairs, each row's longest first),
each with CRC-32 block checksums (`colo.apps.data.shards.block_crc32s` layout), and a JSON record naming the corpus
(the SHA-256 of its ``manifest.json``) and the settings. It is written once, atomically (the JSON last, so a
complete record means complete arrays; ranks starting together take a file lock and the others wait), and nothing
is pickled. Later runs map it and check its blocks on first touch, like the shards.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .packing import pack_to_token_budget
from .shards import BLOCK_BYTES, MANIFEST, CheckedArray, CorpusError, TokenCorpus

FORMAT = "colo-documents-row-index"
VERSION = 1
CACHE_DIR = "cache"
"""The folder of a corpus (or of a run, when the corpus is read-only) that holds its row indexes."""
GROUP_DOCUMENTS = 65536
"""Documents bin-packed together (a corpus this small is packed as `TokenBudgetDataset` packs it)."""


def corpus_fingerprint(corpus: TokenCorpus) -> str:
    """The SHA-256 of the corpus's ``manifest.json`` (its shards, their checksums, its tokenizer)."""
    return hashlib.sha256((corpus.directory / MANIFEST).read_bytes()).hexdigest()


def stream_length(corpus: TokenCorpus, max_tokens: int | None) -> int:
    """Tokens of the corpus a run reads: all of them, or the first ``max_tokens``."""
    return corpus.num_tokens if max_tokens is None else min(corpus.num_tokens, max_tokens)


def document_bounds(corpus: TokenCorpus, *, max_tokens: int | None = None, group: int) -> Iterator[np.ndarray]:
    """The stream offsets of the documents' boundaries, ``group`` documents at a time (``group + 1`` offsets, fewer
    at the end), over the first ``max_tokens`` tokens (the document holding the cut ends there)."""
    end = stream_length(corpus, max_tokens)
    pending = np.zeros(0, dtype=np.int64)
    for shard in range(len(corpus.shards)):
        if corpus.token_starts[shard] >= end:
            break
        offsets = corpus.document_offsets(shard)
        starting = min(int(np.searchsorted(offsets, end, side="left")), offsets.size - 1)  # documents before the end
        offsets = np.minimum(offsets[: starting + 1], end)
        pending = np.concatenate([pending[:-1], offsets]) if pending.size else offsets
        while pending.size > group + 1:
            yield pending[: group + 1]
            pending = pending[group:]
    if pending.size > 1:
        yield pending


def pack_documents(
    corpus: TokenCorpus, *, seq_len: int, max_tokens: int | None = None, group: int = GROUP_DOCUMENTS
) -> Iterator[tuple[list[int], np.ndarray]]:
    """The packing of the module docstring, a group at a time: ``(pieces per row, (start, length) of each piece in
    row order)``."""
    for offsets in document_bounds(corpus, max_tokens=max_tokens, group=group):
        lengths = np.diff(offsets)
        counts = -(-lengths // seq_len)  # an empty document gives no piece
        firsts = np.repeat(np.cumsum(counts) - counts, counts)
        starts = np.repeat(offsets[:-1], counts) + seq_len * (np.arange(int(counts.sum()), dtype=np.int64) - firsts)
        sizes = np.minimum(np.append(starts[1:], offsets[-1]) - starts, seq_len)
        if not starts.size:
            continue
        rows = pack_to_token_budget(sizes.tolist(), seq_len=seq_len)
        order = np.fromiter((piece for row in rows for piece in row), dtype=np.int64, count=starts.size)
        yield [len(row) for row in rows], np.stack([starts[order], sizes[order]], axis=1)


class _ChecksummedWriter:
    """Writes a file under a temporary name with its CRC-32 block checksums; `finish` publishes both."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        self.file = open(self.partial, "wb")
        self.crcs: list[int] = []
        self.block = bytearray()
        self.count = 0

    def add(self, values: np.ndarray) -> None:
        payload = np.ascontiguousarray(values, dtype="<i8").tobytes()
        self.file.write(payload)
        self.count += values.size
        self.block += payload
        while len(self.block) >= BLOCK_BYTES:
            self.crcs.append(zlib.crc32(memoryview(self.block)[:BLOCK_BYTES]))
            del self.block[:BLOCK_BYTES]

    def finish(self) -> int:
        """Publish the file and its ``.crc32``; returns the CRC-32 of the checksums."""
        if self.block:
            self.crcs.append(zlib.crc32(self.block))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        crcs = np.asarray(self.crcs, dtype="<u4").tobytes()
        _replace(self.path.with_name(self.path.name + ".crc32"), crcs)
        os.replace(self.partial, self.path)
        return zlib.crc32(crcs)


def _replace(path: Path, payload: bytes) -> None:
    partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(partial, "wb") as file:
        file.write(payload)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _checked(path: Path, expected_crc: int, values: int) -> CheckedArray:
    crc_path = path.with_name(path.name + ".crc32")
    raw = crc_path.read_bytes()
    if zlib.crc32(raw) != expected_crc:
        raise CorpusError(f"{crc_path} fails the CRC-32 in its record; delete {path.parent} to rebuild it")
    array = CheckedArray(path, np.dtype("<i8"), np.frombuffer(raw, dtype="<u4"), BLOCK_BYTES)
    if len(array) != values:
        raise CorpusError(f"{path} holds {len(array)} values, its record says {values}; delete {path.parent}")
    return array


class RowIndex:
    """A documents row index (see the module docstring), mapped and checked on first touch.

    Attributes:
        num_rows: rows of the packing.
        num_pieces: sequences (documents or their ``seq_len`` pieces) in them.
        num_tokens: tokens they hold (the stream read).
    """

    def __init__(self, directory: Path, stem: str, record: dict) -> None:
        self.num_rows = int(record["rows"])
        self.num_pieces = int(record["pieces"])
        self.num_tokens = int(record["tokens"])
        self.row_offsets = _checked(directory / f"{stem}.rows", record["rows_crc32"], self.num_rows + 1)
        self.pieces = _checked(directory / f"{stem}.pieces", record["pieces_crc32"], 2 * self.num_pieces)

    def row(self, row: int) -> np.ndarray:
        """Row ``row``'s sequences as ``(stream start, length)`` rows of an ``int64`` array."""
        first, stop = self.row_offsets.read(row, row + 2).tolist()
        return self.pieces.read(2 * first, 2 * stop).reshape(-1, 2).astype(np.int64)

    def row_lengths(self, rows) -> np.ndarray:
        """Tokens (not padding) of each of ``rows``, ``int64``."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = [int(self.row(row)[:, 1].sum()) for row in rows.ravel().tolist()]
        return np.asarray(lengths, dtype=np.int64).reshape(rows.shape)


def _open_cached(directory: Path, stem: str, settings: dict) -> RowIndex | None:
    try:
        record = json.loads((directory / f"{stem}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if any(record.get(key) != value for key, value in settings.items()):
        return None
    try:
        return RowIndex(directory, stem, record)
    except (OSError, CorpusError):
        return None


def _write(directory: Path, stem: str, corpus: TokenCorpus, settings: dict, max_tokens, group: int) -> RowIndex:
    """Compute the index into ``directory``, streamed to disk a group at a time; the record last."""
    rows = _ChecksummedWriter(directory / f"{stem}.rows")
    pieces = _ChecksummedWriter(directory / f"{stem}.pieces")
    rows.add(np.zeros(1, dtype=np.int64))
    num_pieces = 0
    try:
        for sizes, spans in pack_documents(corpus, seq_len=settings["seq_len"], max_tokens=max_tokens, group=group):
            rows.add(num_pieces + np.cumsum(sizes, dtype=np.int64))
            pieces.add(spans)
            num_pieces += len(spans)
    except BaseException:
        for writer in (rows, pieces):
            writer.file.close()
            writer.partial.unlink(missing_ok=True)
        raise
    record = {
        **settings,
        "rows": rows.count - 1,
        "pieces": num_pieces,
        "rows_crc32": rows.finish(),
        "pieces_crc32": pieces.finish(),
    }
    _replace(directory / f"{stem}.json", (json.dumps(record, indent=1) + "\n").encode())
    return RowIndex(directory, stem, record)


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def documents_row_index(
    corpus: TokenCorpus,
    *,
    seq_len: int,
    max_tokens: int | None = None,
    fallback_dirs: Sequence[str | Path] = (),
    group: int = GROUP_DOCUMENTS,
) -> RowIndex:
    """The corpus's documents row index for ``seq_len`` (and ``max_tokens``): the cached one, or computed now.

    Looks in ``<corpus>/cache`` and then each of ``fallback_dirs`` (a run's own folder) for a record matching the
    corpus and settings; otherwise computes it into the first of them that is writable (under a file lock, so
    ranks starting together compute it once).

    Raises:
        CorpusError: no folder to write the index in.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive")
    num_tokens = stream_length(corpus, max_tokens)
    settings = {
        "format": FORMAT,
        "version": VERSION,
        "corpus": corpus_fingerprint(corpus),
        "seq_len": seq_len,
        "tokens": num_tokens,
        "group_documents": group,
    }
    stem = f"documents-seq{seq_len}-tokens{num_tokens}-group{group}"
    directories = [corpus.directory / CACHE_DIR, *(Path(path) for path in fallback_dirs)]
    for directory in directories:
        index = _open_cached(directory, stem, settings)
        if index is not None:
            return index
    for directory in directories:
        if not _writable(directory):
            continue
        with open(directory / f"{stem}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be writing it: wait, then use its result
            try:
                index = _open_cached(directory, stem, settings)
                return index or _write(directory, stem, corpus, settings, max_tokens, group)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    raise CorpusError(
        f"no writable folder for the documents row index of {corpus.directory} ({', '.join(map(str, directories))}); "
        "make one of them writable"
    )
