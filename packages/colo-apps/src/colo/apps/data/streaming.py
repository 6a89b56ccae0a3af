"""Streaming pre-training data: a corpus read, tokenized and packed while the model trains, not prepared first.

`StreamingPackedSource` reads a Hugging Face ``datasets`` streaming dataset (JSON Lines, text or Parquet files on
disk, via `load_streaming_corpus`, or an ``IterableDataset`` the caller built), keeps this data-parallel rank's share
(``datasets.distributed.split_dataset_by_node``), and in a background thread frames every document ``[bos] tokens
[eos]`` (`colo.apps.data.tokenize_documents`, as `PackedDataset` does), concatenates the frames into one token
stream and cuts it into windows of ``seq_len`` tokens, ``batch_size`` windows a batch. A bounded queue of
``prefetch_batches`` batches keeps memory bounded however large the corpus.

Resume is exact: `StreamingPackedSource.state_dict` names the token position just after the last batch *handed
out* (not the thread's read-ahead): the dataset's own ``state_dict()`` before the document that position lies in,
plus how many of that document's tokens were consumed. A window always ends at such a position, so the packer holds
no partial window there and a fresh source loaded from the state yields the next batch exactly as the uninterrupted
one would. The share of a rank depends on the number of ranks, so a state resumes only at the data-parallel size it
was saved at; a corpus prepared with ``colo data prepare`` resumes across sizes.

`HeldOutHead` reads the first windows of the unsplit corpus once (for evaluation) and says how many documents of
each rank's share to skip (``skip_documents``) so that the training stream starts after them.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from .packing import tokenize_documents
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from datasets import IterableDataset

BUILDERS = ("json", "text", "parquet")
_SUFFIX_BUILDERS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet"}
STATE_FORMAT = "colo.streaming_packed"
STATE_VERSION = 1
CHECKPOINT_KIND = "streaming"
"""The ``kind`` of a run checkpoint's data position when the run streamed (every data-parallel rank's state)."""
_POLL_SECONDS = 0.05  # how often a blocked worker looks for a stop request


def load_streaming_corpus(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    builder: Literal["json", "text", "parquet"] | None = None,
    text_sample_by: Literal["document", "paragraph", "line"] = "document",
) -> IterableDataset:
    """Open local files as a Hugging Face streaming dataset (nothing is read until it is iterated).

    Each entry of ``paths`` is a file, a directory (every file under it, sorted) or a glob pattern (matches sorted);
    entries are read in the order given, one shard per file.

    Args:
        paths (str | os.PathLike | Sequence[str | os.PathLike]): files, directories or glob patterns.
        builder (str | None): ``"json"`` (JSON Lines), ``"text"`` or ``"parquet"``. Default: ``None`` (from the
            suffixes: ``.jsonl``/``.ndjson``/``.json`` are JSON, ``.parquet`` Parquet, anything else text).
        text_sample_by (str): what a document is in a text file: the whole file (as `read_documents` reads it), a
            paragraph or a line. Default: ``"document"``.

    Returns:
        datasets.IterableDataset: the records, ``{"text": ...}`` for text files.

    Raises:
        FileNotFoundError: a path does not exist, or a glob or directory matches no file.
        ValueError: an unknown builder, or files of different formats without ``builder``.
        ImportError: ``datasets`` is missing or older than 2.18.
    """
    datasets = _import_datasets()
    files = expand_paths(paths)
    if builder is None:
        found = sorted({_SUFFIX_BUILDERS.get(Path(file).suffix.lower(), "text") for file in files})
        if len(found) > 1:
            raise ValueError(f"the data files mix the formats {found}; pass builder= one of {BUILDERS}")
        builder = found[0]
    if builder not in BUILDERS:
        raise ValueError(f"builder={builder!r} is not one of {BUILDERS}")
    options = {"sample_by": text_sample_by} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=files, streaming=True, split="train", **options)


class StreamingPackedSource:
    """This rank's batches of fixed ``seq_len`` windows, packed from a streamed corpus in a background thread.

    Over the documents of this rank's share the windows are exactly `PackedDataset`'s (each document framed
    ``[bos] tokens [eos]``, frames concatenated, the partial window at the end of a pass dropped), and batch ``k``
    holds windows ``k * batch_size`` to ``(k + 1) * batch_size - 1``. With ``repeat`` the stream starts a new pass
    (``IterableDataset.set_epoch``) when the corpus ends, so a batch may hold windows of two passes.

    Resume with `state_dict` / `load_state_dict` (JSON-able; exact, see the module docstring). Stop the thread with
    `close` or a ``with`` block; a source dropped or alive at interpreter exit stops it too. An exception raised
    while reading or tokenizing is re-raised by the next ``next()``, with its message.

    Args:
        corpus (datasets.IterableDataset | str | os.PathLike | Sequence): an unsplit streaming dataset, or paths
            for `load_streaming_corpus`. Shuffle buffers lose their content on resume (``datasets``' own limit).
        tokenizer (Tokenizer): the tokenizer.
        seq_len (int): tokens per window.
        batch_size (int): windows per batch on this rank.
        rank (int): this rank's index among the data-parallel ranks. Default: ``0``.
        world_size (int): data-parallel ranks that read different data. Default: ``1``.
        builder (str | None): `load_streaming_corpus`'s ``builder`` when ``corpus`` is paths. Default: ``None``.
        text_field (str): the record field holding the text. Default: ``"text"``.
        add_bos (bool): start every document with ``bos``. Default: ``True``.
        add_eos (bool): end every document with ``eos``. Default: ``True``.
        repeat (bool): start a new pass when the corpus ends (as ``batches(..., repeat=True)``); otherwise stop,
            dropping the last partial batch. Default: ``True``.
        prefetch_batches (int): batches the thread may read ahead. Default: ``4``.
        skip_documents (int): documents at the head of this rank's share never read, in every pass (a held-out
            head: `HeldOutHead.documents_to_skip`). Default: ``0``.

    Example::

        source = StreamingPackedSource("corpus/*.jsonl", tokenizer, seq_len=2048, batch_size=8, rank=r, world_size=w)
        with source:
            for batch in source:  # {"input_ids": LongTensor(8, 2048), "labels": LongTensor(8, 2048)}
                ...
                checkpoint["data"] = source.state_dict()
    """

    def __init__(
        self,
        corpus: IterableDataset | str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        builder: Literal["json", "text", "parquet"] | None = None,
        text_field: str = "text",
        add_bos: bool = True,
        add_eos: bool = True,
        repeat: bool = True,
        prefetch_batches: int = 4,
        skip_documents: int = 0,
    ) -> None:
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("prefetch_batches", prefetch_batches)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        if skip_documents < 0:
            raise ValueError(f"skip_documents={skip_documents} must not be negative")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in 0..world_size-1 with world_size={world_size} positive")
        datasets = _import_datasets()
        if isinstance(corpus, datasets.Dataset):
            raise TypeError("corpus is a map-style datasets.Dataset; pass dataset.to_iterable_dataset() or its files")
        if not isinstance(corpus, datasets.IterableDataset):
            corpus = load_streaming_corpus(corpus, builder=builder)
        if getattr(corpus, "_distributed", None) is not None:
            raise ValueError("corpus is already split by node; pass the unsplit dataset (the source splits it by rank)")
        self.corpus = corpus
        self.tokenizer = tokenizer
        self.seq_len, self.batch_size, self.rank, self.world_size = seq_len, batch_size, rank, world_size
        self.text_field, self.add_bos, self.add_eos, self.repeat = text_field, add_bos, add_eos, repeat
        self.prefetch_batches, self.skip_documents = prefetch_batches, skip_documents
        self.num_shards = corpus.num_shards
        self._position = _Position(epoch=0, dataset=None, document_offset=0, batches_yielded=0)
        self._producer: _Producer | None = None
        self._closed = self._exhausted = False
        self._failure: BaseException | None = None

    @property
    def batches_yielded(self) -> int:
        """Batches handed out since the stream began (counting those before a resume)."""
        return self._position.batches_yielded

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._closed:
            raise RuntimeError("the StreamingPackedSource is closed; make a new one (load its last state_dict)")
        if self._failure is not None:
            raise self._failure
        if self._exhausted:
            raise StopIteration
        if self._producer is None:
            self._producer = _Producer(self, self._position)
        item = self._producer.get()
        if item is _END:
            self._exhausted = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._producer.stop()
            item.error.add_note(f"(raised in the streaming data thread of rank {self.rank} of {self.world_size})")
            self._failure = item.error
            raise item.error
        batch, self._position = item
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (JSON-able); `load_state_dict` resumes just after it."""
        state = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_shards": self.num_shards,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "skip_documents": self.skip_documents,
            **vars(self._position),
        }
        return json.loads(json.dumps(state))  # a deep copy, and proof it is JSON

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the batch `state_dict` was taken at (any read-ahead is dropped).

        Raises:
            ValueError: the state is not this source's, or was saved at another data-parallel size, rank or corpus.
        """
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"not a StreamingPackedSource state (format {state.get('format')!r}, version "
                f"{state.get('version')!r}; expected {STATE_FORMAT!r}, version {STATE_VERSION})"
            )
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"the streaming data state was saved with {state['world_size']} data-parallel ranks and this run has "
                f"{self.world_size}: a streamed corpus splits by rank count, so its position does not carry over. "
                "Resume with the same data-parallel size, or prepare the corpus with `colo data prepare` for exact "
                "resume across data-parallel sizes"
            )
        if state["rank"] != self.rank:
            raise ValueError(
                f"the streaming data state is data-parallel rank {state['rank']}'s, loaded on rank {self.rank}; "
                "load each rank's own state"
            )
        if state["num_shards"] != self.num_shards:
            raise ValueError(
                f"the corpus has {self.num_shards} shards (files) and the state was saved over {state['num_shards']}; "
                "resume over the same files"
            )
        if state.get("skip_documents", 0) != self.skip_documents:
            raise ValueError(
                f"the streaming data state skipped {state.get('skip_documents', 0)} documents at the head of this "
                f"rank's share and this source skips {self.skip_documents} (a different held-out head); resume with "
                "the saved settings (in a run: eval.every_steps, eval.num_sequences, data.seq_len)"
            )
        self._stop_producer()
        self._position = _Position(
            epoch=int(state["epoch"]),
            dataset=state["dataset"],
            document_offset=int(state["document_offset"]),
            batches_yielded=int(state["batches_yielded"]),
        )
        self._exhausted, self._failure = False, None

    def close(self) -> None:
        """Stop and join the background thread; the source yields nothing more. Safe to call twice."""
        self._closed = True
        self._stop_producer()

    def _stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.stop()
            self._producer = None

    def __enter__(self) -> StreamingPackedSource:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _Position:
    """A token position in a rank's stream: the pass, the dataset state before a document, tokens of it consumed."""

    def __init__(self, *, epoch: int, dataset: dict | None, document_offset: int, batches_yielded: int) -> None:
        self.epoch, self.dataset, self.document_offset = epoch, dataset, document_offset
        self.batches_yielded = batches_yielded


class _Failure:
    """An exception of the worker, on its way to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Stopped(Exception):
    """Unwinds the worker when a stop is requested."""


_END = object()


class _Producer:
    """The background thread: reads, tokenizes and packs from a position into a bounded queue of batches.

    It holds the settings, not the source, so a dropped source is collected and its finalizer stops the thread.
    """

    def __init__(self, source: StreamingPackedSource, start: _Position) -> None:
        from datasets.distributed import split_dataset_by_node

        self.dataset = split_dataset_by_node(source.corpus, rank=source.rank, world_size=source.world_size)
        if source.skip_documents:  # after the split: of this rank's share (see HeldOutHead.documents_to_skip)
            self.dataset = self.dataset.skip(source.skip_documents)
        self.tokenizer, self.text_field = source.tokenizer, source.text_field
        self.add_bos, self.add_eos, self.repeat = source.add_bos, source.add_eos, source.repeat
        self.seq_len, self.batch_size, self.start = source.seq_len, source.batch_size, start
        self.where = f"rank {source.rank} of {source.world_size}"
        self.queue: queue.Queue = queue.Queue(maxsize=source.prefetch_batches)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"colo-streaming-rank{source.rank}", daemon=True)
        self._finalizer = weakref.finalize(source, self.stop)
        self.thread.start()

    def get(self):
        """The next queued item (a ``(batch, position)`` pair, `_END` or a `_Failure`), waiting for it."""
        while True:
            try:
                return self.queue.get(timeout=1.0)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    return _Failure(RuntimeError(f"the streaming data thread of {self.where} ended without a word"))

    def stop(self) -> None:
        """Ask the thread to stop, unblock it, and join it."""
        self._finalizer.detach()
        self.stopping.set()
        while self.thread.is_alive():
            try:
                while True:
                    self.queue.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(timeout=_POLL_SECONDS)

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                continue
        raise _Stopped

    def _run(self) -> None:
        try:
            self._produce()
            self._put(_END)
        except _Stopped:
            pass
        except BaseException as error:  # noqa: BLE001 - every failure goes to the consumer
            try:
                self._put(_Failure(error))
            except _Stopped:
                pass

    def _produce(self) -> None:
        capacity = self.seq_len * self.batch_size
        epoch, before, skip = self.start.epoch, self.start.dataset, self.start.document_offset
        batches = self.start.batches_yielded
        buffer, filled = np.empty(capacity, dtype=np.int64), 0
        while True:
            whole_pass, tokens_read = before is None and skip == 0, 0
            for tokens, state in self._documents(epoch, before):
                position, skip = skip, 0
                tokens_read += tokens.size - position
                while position < tokens.size:
                    take = min(tokens.size - position, capacity - filled)
                    buffer[filled : filled + take] = tokens[position : position + take]
                    filled, position = filled + take, position + take
                    if filled == capacity:
                        batches += 1
                        input_ids = torch.from_numpy(buffer).view(self.batch_size, self.seq_len)
                        batch = {"input_ids": input_ids, "labels": input_ids.clone()}
                        after = _Position(epoch=epoch, dataset=state, document_offset=position, batches_yielded=batches)
                        self._put((batch, after))
                        buffer, filled = np.empty(capacity, dtype=np.int64), 0
            if whole_pass and tokens_read < self.seq_len:
                raise ValueError(
                    f"the share of {self.where} of the streamed corpus holds {tokens_read} tokens, fewer than "
                    f"seq_len={self.seq_len}; add data, lower seq_len, or use fewer data-parallel ranks"
                )
            filled -= filled % self.seq_len  # the pass's partial window is dropped, as PackedDataset drops it
            if not self.repeat:
                if batches == 0:
                    raise ValueError(
                        f"the share of {self.where} of the streamed corpus holds {tokens_read} tokens, fewer than one "
                        f"batch of {self.batch_size} x {self.seq_len}; add data, or lower batch_size or seq_len"
                    )
                return
            epoch, before, skip = epoch + 1, None, 0

    def _documents(self, epoch: int, before: dict | None) -> Iterator[tuple[np.ndarray, dict | None]]:
        """This rank's framed documents of pass ``epoch`` from ``before``, each with the dataset state before it."""
        dataset = self.dataset
        dataset.set_epoch(epoch)
        if before is not None:
            dataset.load_state_dict(before)
        states: deque = deque()

        def texts() -> Iterator[str]:
            state = before
            for index, record in enumerate(dataset):
                if self.stopping.is_set():
                    raise _Stopped
                if not isinstance(record, Mapping) or self.text_field not in record:
                    fields = list(record) if isinstance(record, Mapping) else type(record).__name__
                    raise ValueError(
                        f"record {index} of pass {epoch} on {self.where} has no field {self.text_field!r} (it has "
                        f"{fields}); pass text_field= naming the field that holds the text"
                    )
                states.append(state)
                yield record[self.text_field]
                state = dataset.state_dict()

        # tokenize_documents yields one array per document, in order, so states line up with its output
        for tokens in tokenize_documents(texts(), self.tokenizer, add_bos=self.add_bos, add_eos=self.add_eos):
            yield tokens, states.popleft()


class HeldOutHead:
    """The first ``num_windows`` windows of an unsplit streamed corpus, held out of training for evaluation.

    The head is read once, in file order, on every rank alike (so every rank holds the same windows): documents
    framed and packed as `StreamingPackedSource` packs them, until ``num_windows * seq_len`` tokens are taken. The
    training stream starts after the documents those windows used (the rest of the last one is not trained on
    either): each rank's `StreamingPackedSource` is given ``skip_documents=documents_to_skip(rank, world_size)``.

    Indexing gives rows ``{"input_ids", "labels"}`` as `PackedDataset` does.

    Args:
        corpus (datasets.IterableDataset): the unsplit streaming dataset (one shard per file, read in order).
        tokenizer (Tokenizer): the tokenizer.
        num_windows (int): windows to hold out.
        seq_len (int): tokens per window.
        text_field (str): the record field holding the text. Default: ``"text"``.
        add_bos (bool): start every document with ``bos``. Default: ``True``.
        add_eos (bool): end every document with ``eos``. Default: ``True``.

    Raises:
        ValueError: the corpus holds fewer than ``num_windows * seq_len`` tokens, or a record lacks ``text_field``.
    """

    def __init__(
        self,
        corpus: IterableDataset,
        tokenizer: Tokenizer,
        *,
        num_windows: int,
        seq_len: int,
        text_field: str = "text",
        add_bos: bool = True,
        add_eos: bool = True,
    ) -> None:
        if num_windows <= 0 or seq_len <= 0:
            raise ValueError(f"num_windows={num_windows} and seq_len={seq_len} must be positive")
        needed = num_windows * seq_len
        tokens, filled = np.empty(needed, dtype=np.int64), 0
        self.documents_per_file = [0] * corpus.num_shards
        for index in range(corpus.num_shards):
            if filled == needed:
                break
            shard = corpus.shard(num_shards=corpus.num_shards, index=index)
            texts = _texts(shard, text_field, where=f"file {index} of the held-out head")
            for document in tokenize_documents(texts, tokenizer, add_bos=add_bos, add_eos=add_eos):
                take = min(document.size, needed - filled)
                tokens[filled : filled + take] = document[:take]
                filled += take
                self.documents_per_file[index] += 1
                if filled == needed:
                    break
        if filled < needed:
            raise ValueError(
                f"the streamed corpus holds {filled} tokens, fewer than the {num_windows} held-out windows of "
                f"{seq_len} tokens; add data or hold out fewer windows"
            )
        self.windows = torch.from_numpy(tokens).view(num_windows, seq_len)

    @property
    def num_documents(self) -> int:
        """Documents the held-out windows used (the last one perhaps in part)."""
        return sum(self.documents_per_file)

    def documents_to_skip(self, rank: int, world_size: int) -> int:
        """The ``skip_documents`` of rank ``rank``'s `StreamingPackedSource`: its share starts after the head.

        ``datasets.distributed.split_dataset_by_node`` gives a rank every ``world_size``-th file when the files
        divide by the ranks: the held-out documents among its files are then the head of its share (the head is the
        first files' first documents). Otherwise it gives a rank every ``world_size``-th document of the whole
        stream, and ``IterableDataset.skip`` after that split skips the whole stream's first documents: all of them.
        """
        num_files = len(self.documents_per_file)
        if num_files % world_size:
            return self.num_documents
        return sum(self.documents_per_file[rank::world_size])

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window.clone()}


def _texts(dataset: IterableDataset, text_field: str, *, where: str) -> Iterator[str]:
    """The ``text_field`` of each record of ``dataset`` (a record without it: a `ValueError` naming the fields)."""
    for index, record in enumerate(dataset):
        if not isinstance(record, Mapping) or text_field not in record:
            fields = list(record) if isinstance(record, Mapping) else type(record).__name__
            raise ValueError(
                f"record {index} of {where} has no field {text_field!r} (it has {fields}); pass text_field= naming "
                "the field that holds the text"
            )
        yield record[text_field]


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files `load_streaming_corpus` reads for ``paths`` (files, directories, globs), each entry's sorted, in the
    order given, as absolute paths."""
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not entries:
        raise ValueError("no data files given; pass files, directories or glob patterns")
    files: list[str] = []
    for entry in entries:
        path = Path(entry)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        else:
            found = sorted(Path(p) for p in glob.glob(str(entry), recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"data path {str(entry)!r} matches no file; pass files, directories or globs")
        files += [str(p.resolve()) for p in found]
    return files


def _import_datasets():
    """The ``datasets`` package, at least 2.18 (resumable ``IterableDataset.state_dict``)."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("streaming data needs the `datasets` package: pip install 'datasets>=2.18'") from error
    major, minor = (int(part) for part in datasets.__version__.split(".")[:2])
    if (major, minor) < (2, 18):
        raise ImportError(
            f"streaming data needs datasets>=2.18 (resumable IterableDataset.state_dict); found "
            f"{datasets.__version__}: pip install -U datasets"
        )
    return datasets
