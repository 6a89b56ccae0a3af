"""Prepared corpora on disk: memory-mapped token shards, their document index, checksums and a manifest.

A prepared corpus is a directory that `colo data prepare` writes once and every training run maps:

- ``manifest.json``: the format and its version, the tokenizer's identity (`tokenizer_identity`), the token dtype,
  the vocabulary size, the totals and one record per shard (`ShardRecord`); the only file that is parsed;
- ``shard-NNNNN.tokens``: the shard's documents back to back, each framed ``[bos] tokens [eos]``, as raw
  little-endian integers of the smallest unsigned dtype that holds the vocabulary (``uint16`` up to 65,536 ids,
  else ``uint32``);
- ``shard-NNNNN.index``: ``documents + 1`` little-endian ``int64`` offsets into the shard's tokens, document ``d``
  spanning ``[index[d], index[d + 1])``;
- ``shard-NNNNN.tokens.crc32`` / ``shard-NNNNN.index.crc32``: the CRC-32 of every `BLOCK_BYTES` block of the file
  (little-endian ``uint32``).

Nothing is pickled. Opening a corpus (`TokenCorpus`) reads the manifest and checks the files' sizes; the token and
index files are mapped, not loaded, so start-up time and memory do not grow with the corpus. Each block is checked
against its CRC the first time a read touches it (`CheckedArray`): a corrupted shard fails the read that meets it,
naming the file, the block and the fix.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT = "colo-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
BLOCK_BYTES = 1 << 16
"""Bytes per checksummed block of a shard's files (a corpus records its own; older ones used 1 MiB). A training row
read at random checks the blocks it lies in the first time: 64 KiB keeps that read near the row's own size
(a 2048-token row of ``uint16`` is 4 KiB) instead of pulling a whole MiB from disk per row of a cold corpus."""


class CorpusError(ValueError):
    """A prepared corpus that cannot be read as asked: missing, corrupted, or made with another tokenizer."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned little-endian dtype that holds ids ``0..vocab_size - 1``."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise CorpusError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token ids")


def tokenizer_identity(tokenizer) -> dict:
    """What names a tokenizer in a manifest: its kind, vocabulary size, special ids and a SHA-256 of its definition
    (``tokenizer.json``'s bytes; the byte tokenizer's fixed layout), so a corpus is never read with another one."""
    path = getattr(tokenizer, "path", None)
    if path is not None:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        name = str(path)
    else:
        digest = hashlib.sha256(f"{type(tokenizer).__name__}:{tokenizer.vocab_size}".encode()).hexdigest()
        name = type(tokenizer).__name__
    return {
        "name": name,
        "kind": type(tokenizer).__name__,
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": int(tokenizer.bos_id),
        "eos_id": int(tokenizer.eos_id),
        "pad_id": int(tokenizer.pad_id),
        "sha256": digest,
    }


def check_tokenizer(corpus_dir: str | os.PathLike, recorded: dict, tokenizer) -> None:
    """Raise `CorpusError` when ``tokenizer`` is not the one the corpus was prepared with (compared by SHA-256)."""
    current = tokenizer_identity(tokenizer)
    if recorded.get("sha256") != current["sha256"]:
        raise CorpusError(
            f"{corpus_dir} was prepared with the tokenizer {recorded.get('name')!r} ({recorded.get('kind')}, "
            f"{recorded.get('vocab_size')} ids); this run's tokenizer is {current['name']!r} ({current['kind']}, "
            f"{current['vocab_size']} ids): set data.tokenizer to the corpus's tokenizer, or prepare the corpus again "
            "with this one (colo data prepare)"
        )


@dataclass(frozen=True)
class ShardRecord:
    """One shard in the manifest: its file stem, sizes and the CRC-32 of each checksum file."""

    name: str
    tokens: int
    documents: int
    tokens_crc32_crc32: int
    """CRC-32 of the ``.tokens.crc32`` file (so the block checksums themselves are checked)."""
    index_crc32_crc32: int
    """CRC-32 of the ``.index.crc32`` file."""


def block_crc32s(data: memoryview | bytes, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """The CRC-32 of every ``block_bytes`` block of ``data`` (the last one may be shorter), as ``uint32``."""
    view = memoryview(data).cast("B")
    return np.asarray(
        [zlib.crc32(view[start : start + block_bytes]) for start in range(0, len(view), block_bytes)], dtype="<u4"
    )


def _write_atomically(path: Path, payload: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        file.write(payload)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


class ShardWriter:
    """Writes one shard: documents appended as they are tokenized, so memory stays bounded by one document.

    The token file grows under a temporary name; `finish` writes the index and the checksum files and renames the
    token file last, so a shard whose ``.tokens`` exists is complete (a crash leaves only ``.tmp`` files, which the
    next `colo data prepare` rewrites).

    Args:
        directory: the corpus directory.
        name: the shard's file stem (``shard-00012``).
        dtype: the token dtype (`token_dtype`).
    """

    def __init__(self, directory: str | os.PathLike, name: str, dtype: np.dtype) -> None:
        self.directory = Path(directory)
        self.name = name
        self.dtype = np.dtype(dtype)
        self.limit = np.iinfo(self.dtype).max
        self._tokens_path = self.directory / f"{name}.tokens"
        self._partial = self.directory / f"{name}.tokens.tmp"
        self._file = open(self._partial, "wb")
        self._offsets = [0]
        self._crcs: list[int] = []
        self._block = bytearray()

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add(self, tokens: np.ndarray) -> None:
        """Append one document's tokens (already framed with bos/eos)."""
        self.add_documents(tokens, [int(np.size(tokens))])

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append several documents at once: ``tokens`` holds them back to back, ``lengths`` their sizes (one write
        and one range check for the batch: the fast path of `colo data prepare`)."""
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size or (lengths.size and int(lengths.min()) < 0):
            raise ValueError(f"the document lengths sum to {int(lengths.sum())}, the tokens hold {tokens.size}")
        if tokens.size and (int(tokens.max()) > self.limit or int(tokens.min()) < 0):
            raise CorpusError(f"a token id outside 0..{self.limit} cannot be stored as {self.dtype}")
        payload = memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)).cast("B")
        self._file.write(payload)
        start = 0
        if self._block:  # complete the pending block first
            start = min(BLOCK_BYTES - len(self._block), len(payload))
            self._block += payload[:start]
            if len(self._block) == BLOCK_BYTES:
                self._crcs.append(zlib.crc32(self._block))
                self._block = bytearray()
        while len(payload) - start >= BLOCK_BYTES:
            self._crcs.append(zlib.crc32(payload[start : start + BLOCK_BYTES]))
            start += BLOCK_BYTES
        self._block += payload[start:]
        self._offsets.extend((self._offsets[-1] + np.cumsum(lengths)).tolist())

    def finish(self) -> ShardRecord:
        """Write the index and checksums, publish the token file; returns the shard's manifest record."""
        if self._block:
            self._crcs.append(zlib.crc32(self._block))
            self._block = bytearray()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        index = np.asarray(self._offsets, dtype="<i8").tobytes()
        _write_atomically(self.directory / f"{self.name}.index", index)
        index_crcs = block_crc32s(index).tobytes()
        token_crcs = np.asarray(self._crcs, dtype="<u4").tobytes()
        _write_atomically(self.directory / f"{self.name}.index.crc32", index_crcs)
        _write_atomically(self.directory / f"{self.name}.tokens.crc32", token_crcs)
        os.replace(self._partial, self._tokens_path)
        return ShardRecord(
            name=self.name,
            tokens=self.num_tokens,
            documents=len(self._offsets) - 1,
            tokens_crc32_crc32=zlib.crc32(token_crcs),
            index_crc32_crc32=zlib.crc32(index_crcs),
        )

    def abandon(self) -> None:
        """Close and delete the partial token file (an error while preparing)."""
        self._file.close()
        self._partial.unlink(missing_ok=True)


def write_manifest(directory: str | os.PathLike, *, tokenizer: dict, shards: Sequence[ShardRecord], **extra) -> dict:
    """Write ``manifest.json`` (atomically) for ``shards`` in order; ``extra`` keys (the inputs' fingerprint, say)
    are stored beside them. Returns the manifest."""
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer,
        "dtype": token_dtype(tokenizer["vocab_size"]).str,
        "block_bytes": BLOCK_BYTES,
        "num_tokens": sum(shard.tokens for shard in shards),
        "num_documents": sum(shard.documents for shard in shards),
        "shards": [asdict(shard) for shard in shards],
        **extra,
    }
    _write_atomically(Path(directory) / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a prepared corpus, checked for format and version."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CorpusError(
            f"{directory} is not a prepared corpus (no {MANIFEST}); prepare it with `colo data prepare`, or list the "
            "raw files in data.paths"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CorpusError(f"{path} is not valid JSON ({error}); prepare the corpus again") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CorpusError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; this colo reads "
            f"{FORMAT!r} version {VERSION}: prepare the corpus again"
        )
    return manifest


class CheckedArray:
    """A read-only memory-mapped file of fixed-size integers whose blocks are CRC-checked on first touch.

    Args:
        path: the data file.
        dtype: its element dtype.
        crcs: the block CRC-32s (``uint32``), from the ``.crc32`` file.
        block_bytes: bytes per block.
    """

    def __init__(self, path: Path, dtype: np.dtype, crcs: np.ndarray, block_bytes: int = BLOCK_BYTES) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        size = path.stat().st_size
        if size % self.dtype.itemsize:
            raise CorpusError(f"{path}: {size} bytes is not a whole number of {self.dtype} values; prepare it again")
        self.array = np.memmap(path, dtype=self.dtype, mode="r") if size else np.zeros(0, dtype=self.dtype)
        self.bytes = np.frombuffer(self.array, dtype=np.uint8) if size else np.zeros(0, dtype=np.uint8)
        self.block_bytes = block_bytes
        self.crcs = crcs
        if len(crcs) != -(-size // block_bytes):
            raise CorpusError(
                f"{path}: {size} bytes need {-(-size // block_bytes)} block checksums, the checksum file holds "
                f"{len(crcs)}; the shard is incomplete or altered: prepare the corpus again"
            )
        self.checked = np.zeros(len(crcs), dtype=bool)

    def __len__(self) -> int:
        return self.array.shape[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` (a view of the map), after checking the blocks they lie in."""
        if stop > start:
            first = start * self.dtype.itemsize // self.block_bytes
            last = (stop * self.dtype.itemsize - 1) // self.block_bytes
            for block in range(first, last + 1):
                if not self.checked[block]:
                    self._check(block)
        return self.array[start:stop]

    def _check(self, block: int) -> None:
        begin = block * self.block_bytes
        crc = zlib.crc32(self.bytes[begin : begin + self.block_bytes])
        if crc != int(self.crcs[block]):
            raise CorpusError(
                f"{self.path}: block {block} (bytes {begin}..{min(begin + self.block_bytes, self.bytes.size)}) fails "
                f"its CRC-32 (stored {int(self.crcs[block]):#010x}, read {crc:#010x}); the shard was altered or "
                "damaged: prepare the corpus again (colo data prepare --verify rewrites only the damaged shards)"
            )
        self.checked[block] = True

    def verify(self) -> None:
        """Check every block now (`colo data inspect --verify`)."""
        for block in range(len(self.crcs)):
            if not self.checked[block]:
                self._check(block)


def _read_crcs(path: Path, expected: int) -> np.ndarray:
    if not path.is_file():
        raise CorpusError(f"{path} is missing; the shard is incomplete: prepare the corpus again")
    raw = path.read_bytes()
    if zlib.crc32(raw) != expected:
        raise CorpusError(f"{path} fails its CRC-32 in the manifest; the shard was altered: prepare the corpus again")
    return np.frombuffer(raw, dtype="<u4")


class TokenShard:
    """One shard: its token file and document index, both mapped and CRC-checked on first touch."""

    def __init__(self, directory: Path, record: dict, dtype: np.dtype, block_bytes: int) -> None:
        self.name = record["name"]
        self.num_tokens = int(record["tokens"])
        self.num_documents = int(record["documents"])
        tokens_path = directory / f"{self.name}.tokens"
        index_path = directory / f"{self.name}.index"
        for path in (tokens_path, index_path):
            if not path.is_file():
                raise CorpusError(f"{path} is missing; prepare the corpus again (finished shards are kept)")
        self.tokens = CheckedArray(
            tokens_path,
            dtype,
            _read_crcs(directory / f"{self.name}.tokens.crc32", record["tokens_crc32_crc32"]),
            block_bytes,
        )
        self.index = CheckedArray(
            index_path,
            np.dtype("<i8"),
            _read_crcs(directory / f"{self.name}.index.crc32", record["index_crc32_crc32"]),
            block_bytes,
        )
        if len(self.tokens) != self.num_tokens or len(self.index) != self.num_documents + 1:
            raise CorpusError(
                f"{tokens_path}: the manifest records {self.num_tokens} tokens and {self.num_documents} documents, the "
                f"files hold {len(self.tokens)} tokens and {len(self.index) - 1} documents: prepare the corpus again"
            )


class LazyShards(Sequence):
    """A corpus's shards, each a `TokenShard` opened (mapped, its checksum files read and checked) when first asked
    for."""

    def __init__(self, directory: Path, records: list[dict], dtype: np.dtype, block_bytes: int) -> None:
        self.directory, self.records, self.dtype, self.block_bytes = directory, records, dtype, block_bytes
        self.opened: dict[int, TokenShard] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, number: int) -> TokenShard:
        if not isinstance(number, int):
            raise TypeError("shards are looked up one at a time, by number")
        number = range(len(self.records))[number]
        shard = self.opened.get(number)
        if shard is None:
            shard = TokenShard(self.directory, self.records[number], self.dtype, self.block_bytes)
            self.opened[number] = shard
        return shard


class TokenCorpus:
    """A prepared corpus opened for reading: its shards' tokens as one stream, in shard order.

    Opening reads only the manifest; a shard's files are mapped (and its small checksum files read) the first time
    a read needs it, so opening costs the same for 20 shards or 20,000.

    Args:
        directory: the corpus directory (with ``manifest.json``).
        tokenizer: when given, it must be the tokenizer the corpus was prepared with (`CorpusError` otherwise).

    Attributes:
        manifest: the parsed manifest.
        num_tokens: tokens in the corpus.
        num_documents: documents in the corpus.
        vocab_size: the preparing tokenizer's vocabulary.
    """

    def __init__(self, directory: str | os.PathLike, *, tokenizer=None) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if tokenizer is not None:
            check_tokenizer(self.directory, self.manifest["tokenizer"], tokenizer)
        records = self.manifest["shards"]
        self.shards = LazyShards(
            self.directory, records, np.dtype(self.manifest["dtype"]), int(self.manifest["block_bytes"])
        )
        """The shards (`TokenShard`), each opened on first access."""
        self.num_tokens = int(self.manifest["num_tokens"])
        self.num_documents = int(self.manifest["num_documents"])
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self.token_starts = np.cumsum([0] + [int(record["tokens"]) for record in records]).tolist()
        """Offset of each shard's first token in the stream (and the total last)."""
        self.document_starts = np.cumsum([0] + [int(record["documents"]) for record in records]).tolist()
        """Number of each shard's first document in the corpus (and the total last)."""

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (across shard boundaries), as ``int64``."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) out of range for a corpus of {self.num_tokens}")
        pieces = []
        shard = bisect.bisect_right(self.token_starts, start) - 1
        while start < stop:
            begin = self.token_starts[shard]
            end = min(stop, self.token_starts[shard + 1])
            pieces.append(self.shards[shard].tokens.read(start - begin, end - begin))
            start = end
            shard += 1
        if not pieces:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(pieces).astype(np.int64) if len(pieces) > 1 else pieces[0].astype(np.int64)

    def document_span(self, document: int) -> tuple[int, int]:
        """``(start, stop)`` of document ``document`` in the stream."""
        if not 0 <= document < self.num_documents:
            raise IndexError(f"document {document} out of range for {self.num_documents}")
        shard = bisect.bisect_right(self.document_starts, document) - 1
        local = document - self.document_starts[shard]
        begin, end = self.shards[shard].index.read(local, local + 2)
        return self.token_starts[shard] + int(begin), self.token_starts[shard] + int(end)

    def document_offsets(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s document boundaries as stream offsets (``documents + 1`` values, ``int64``; maps and
        checks the whole index of that shard)."""
        index = self.shards[shard].index
        return index.read(0, len(index)).astype(np.int64) + self.token_starts[shard]

    def verify(self) -> None:
        """Check every block of every shard against its CRC-32 (reads the whole corpus)."""
        for shard in self.shards:
            shard.tokens.verify()
            shard.index.verify()
