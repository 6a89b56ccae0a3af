"""Training rows read from a prepared corpus (`colo.apps.data.shards.TokenCorpus`), as the in-memory datasets give.

- `PreparedWindows`: `PackedDataset`'s items — row ``i`` is the stream's window ``[i * seq_len, (i + 1) * seq_len)``,
  ``input_ids`` and ``labels`` equal; set up in O(1).
- `PreparedDocuments`: `TokenBudgetDataset`'s items — whole documents packed into rows of ``seq_len`` slots (cut
  only when longer than a row, at the same places), ``labels`` ``-100`` on each sequence's first token and on the
  padding, ``position_ids`` restarting per sequence — from a row index computed once and cached beside the corpus
  (`colo.apps.data.row_index`: `TokenBudgetDataset`'s best-fit packing, over groups of documents in order; the same
  rows as `TokenBudgetDataset` for a corpus of one group).

Neither reads a token at construction; an item reads its own slice of the mapped shards (whose blocks are
CRC-checked on first touch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .packing import IGNORE_INDEX
from .row_index import corpus_fingerprint, documents_row_index, stream_length
from .shards import MANIFEST, TokenCorpus


def is_prepared_corpus(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a prepared corpus directory (holds ``manifest.json``)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


class PreparedWindows(Dataset):
    """A prepared corpus's token stream cut into windows of ``seq_len`` tokens (`PackedDataset`'s items).

    Args:
        corpus (TokenCorpus): the opened corpus.
        seq_len (int): tokens per window.
        max_tokens (int | None): read only the stream's first ``max_tokens`` tokens. Default: ``None``.

    Raises:
        ValueError: the stream holds fewer than ``seq_len`` tokens.
    """

    packing = "fixed"

    def __init__(self, corpus: TokenCorpus, *, seq_len: int, max_tokens: int | None = None) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.corpus = corpus
        self.seq_len = seq_len
        self.max_tokens = max_tokens
        self.num_tokens = stream_length(corpus, max_tokens)
        self.fingerprint = corpus_fingerprint(corpus)
        if len(self) == 0:
            raise ValueError(
                f"{corpus.directory} holds {self.num_tokens} tokens, fewer than seq_len={seq_len}; add data or lower "
                "seq_len"
            )

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        index %= len(self)
        window = torch.from_numpy(self.corpus.read(index * self.seq_len, (index + 1) * self.seq_len))
        return {"input_ids": window, "labels": window.clone()}

    def row_lengths(self, rows) -> np.ndarray:
        """Tokens of each of ``rows``: every window is full."""
        return np.full(np.shape(rows), self.seq_len, dtype=np.int64)

    def identity(self) -> dict:
        """What a resumed run must read the same: the corpus, the packing, ``seq_len`` and the tokens read."""
        return {
            "corpus": self.fingerprint,
            "packing": self.packing,
            "seq_len": self.seq_len,
            "tokens": self.num_tokens,
        }


class PreparedDocuments(Dataset):
    """A prepared corpus's documents packed into rows of ``seq_len`` slots (`TokenBudgetDataset`'s items).

    Args:
        corpus (TokenCorpus): the opened corpus.
        seq_len (int): slots per row.
        pad_id (int): the id of padding slots.
        max_tokens (int | None): read only the stream's first ``max_tokens`` tokens (the last document cut there).
            Default: ``None``.
        fallback_dirs (Sequence): where to cache the row index when the corpus's folder is read-only (a run's
            folder). Default: none.

    Attributes:
        efficiency: the fraction of slots holding tokens (not padding).
    """

    packing = "documents"

    def __init__(
        self,
        corpus: TokenCorpus,
        *,
        seq_len: int,
        pad_id: int,
        max_tokens: int | None = None,
        fallback_dirs: Sequence[str | Path] = (),
    ) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.max_tokens = max_tokens
        self.index = documents_row_index(corpus, seq_len=seq_len, max_tokens=max_tokens, fallback_dirs=fallback_dirs)
        self.num_tokens = self.index.num_tokens
        self.fingerprint = corpus_fingerprint(corpus)
        if self.index.num_rows == 0:
            raise ValueError(f"{corpus.directory} holds no tokens; add data")
        self.efficiency = self.num_tokens / (self.index.num_rows * seq_len)

    def __len__(self) -> int:
        return self.index.num_rows

    @property
    def sequence_rows(self) -> list[list[tuple[int, int]]]:
        """For each row, the ``(stream start, length)`` of its sequences (reads the whole index: for tests and
        small corpora; `TokenBudgetDataset.sequence_rows`'s layout)."""
        return [[tuple(piece) for piece in self.index.row(row).tolist()] for row in range(len(self))]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(self.seq_len, dtype=torch.long)
        cursor = 0
        for start, length in self.index.row(index % len(self)).tolist():
            end = cursor + length
            input_ids[cursor:end] = torch.from_numpy(self.corpus.read(start, start + length))
            labels[cursor + 1 : end] = input_ids[cursor + 1 : end]
            position_ids[cursor:end] = torch.arange(length)
            cursor = end
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}

    def row_lengths(self, rows) -> np.ndarray:
        """Tokens (not padding) of each of ``rows``."""
        return self.index.row_lengths(rows)

    def identity(self) -> dict:
        """What a resumed run must read the same: the corpus, the packing, ``seq_len`` and the tokens read."""
        return {
            "corpus": self.fingerprint,
            "packing": self.packing,
            "seq_len": self.seq_len,
            "tokens": self.num_tokens,
        }
