"""Pre-training datasets: documents tokenized and packed into fixed-length training rows.

Two ways to pack, both map-style torch datasets whose items are dicts of equal-shaped tensors (so the sampler and
`colo.apps.data.batches` serve either):

- `PackedDataset` (the default): every document, framed by ``bos``/``eos``, is concatenated into one token stream,
  cut into non-overlapping windows of ``seq_len`` tokens. No padding, no wasted compute; windows cross document
  boundaries (the ``eos``/``bos`` separators tell the model where one ends).
- `TokenBudgetDataset` (opt-in): whole documents are bin-packed into rows of ``seq_len`` token slots without being
  cut (except documents longer than a row), with ``position_ids`` restarting at every document and no loss on the
  first token of each (nothing predicts across a boundary); the model masks attention per document from the
  positions. A batch of ``batch_size`` rows is then a fixed token
  budget of ``batch_size * seq_len`` slots holding a variable number of variable-length documents.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .tokenizer import Tokenizer, encode_arrays

IGNORE_INDEX = -100
_ENCODE_CHUNK = 256  # documents tokenized per batched call


def tokenize_documents(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    *,
    add_bos: bool = True,
    add_eos: bool = True,
    max_tokens: int | None = None,
) -> Iterator[np.ndarray]:
    """Yield each document's tokens as an int32 array, framed by ``bos``/``eos``.

    Documents are tokenized in batches (`encode_arrays`), so a byte tokenizer runs at memory speed and a Hugging
    Face one on all its threads. Reading stops once ``max_tokens`` tokens have been yielded (the last array is cut).

    Args:
        documents (Iterable[str]): the texts (a conversation is an error: use `SFTDataset` for those).
        tokenizer (Tokenizer): the tokenizer.
        add_bos (bool): start every document with ``tokenizer.bos_id``. Default: ``True``.
        add_eos (bool): end every document with ``tokenizer.eos_id``. Default: ``True``.
        max_tokens (int | None): stop after this many tokens. Default: ``None`` (every document).

    Yields:
        np.ndarray: one document's int32 tokens.

    Raises:
        TypeError: a document is not a string.
    """
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be positive (or None for the whole corpus)")
    prefix = np.asarray([tokenizer.bos_id] if add_bos else [], dtype=np.int32)
    suffix = np.asarray([tokenizer.eos_id] if add_eos else [], dtype=np.int32)
    remaining = max_tokens
    pending: list[str] = []
    index = 0

    def flush() -> Iterator[np.ndarray]:
        nonlocal remaining
        for body in encode_arrays(tokenizer, pending):
            tokens = np.concatenate([prefix, body, suffix]) if prefix.size or suffix.size else body
            if remaining is not None:
                tokens = tokens[:remaining]
                remaining -= tokens.size
            yield tokens
            if remaining == 0:
                return

    for document in documents:
        if not isinstance(document, str):
            raise TypeError(
                f"document {index} is a {type(document).__name__}, not text; pre-training packs text (chat "
                "conversations go to SFTDataset, or read the text field with text_field=)"
            )
        pending.append(document)
        index += 1
        # Flush early when a cap is set so a huge corpus is not read past the tokens it needs.
        if len(pending) == _ENCODE_CHUNK or (remaining is not None and len(pending) * 64 >= remaining):
            yield from flush()
            pending = []
            if remaining == 0:
                return
    if pending:
        yield from flush()


class PackedDataset(Dataset):
    """Documents packed into one token stream and cut into non-overlapping windows of ``seq_len`` tokens.

    Every document is tokenized and framed as ``[bos] tokens [eos]``; the frames are concatenated in document order
    into `tokens` (a torch int32 tensor, capped at ``max_tokens``), and item ``i`` is the window
    ``tokens[i * seq_len : (i + 1) * seq_len]``. The trailing partial window is dropped. The labels are the inputs
    (Hugging Face's convention: the model shifts them), so every token but a window's first carries a loss.

    Args:
        documents (Iterable[str]): the texts, e.g. from `read_documents` or `default_corpus`.
        tokenizer (Tokenizer): the tokenizer.
        seq_len (int): tokens per window.
        max_tokens (int | None): cap on the token stream. Default: ``None`` (the whole corpus).
        add_bos (bool): start every document with ``bos``. Default: ``True``.
        add_eos (bool): end every document with ``eos``. Default: ``True``.

    Raises:
        ValueError: ``seq_len`` is not positive, or the corpus holds fewer than ``seq_len`` tokens.

    Example::

        dataset = PackedDataset(read_documents(default_corpus()), ByteTokenizer(), seq_len=256)
        dataset[0]  # {"input_ids": LongTensor(256), "labels": LongTensor(256)}
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        max_tokens: int | None = None,
        add_bos: bool = True,
        add_eos: bool = True,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.seq_len = seq_len
        self.tokenizer = tokenizer
        pieces = list(tokenize_documents(documents, tokenizer, add_bos=add_bos, add_eos=add_eos, max_tokens=max_tokens))
        self.num_documents = len(pieces)
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        self.tokens: torch.Tensor = torch.from_numpy(stream.astype(np.int32, copy=False))
        if len(self) == 0:
            raise ValueError(
                f"the corpus holds {self.num_tokens} tokens in {self.num_documents} documents, fewer than "
                f"seq_len={seq_len}; add data, raise max_tokens, or lower seq_len"
            )

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream (including the dropped tail)."""
        return self.tokens.numel()

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        index %= len(self)
        window = self.tokens[index * self.seq_len : (index + 1) * self.seq_len].long()
        return {"input_ids": window, "labels": window.clone()}


def pack_to_token_budget(lengths: Sequence[int], *, seq_len: int) -> list[list[int]]:
    """Bin-pack sequences into rows of ``seq_len`` slots: best fit, longest first.

    Each sequence goes into the fullest row that still has room for it, or a new row; sequences are placed longest
    first (ties by index), which packs within a few percent of optimal and is deterministic.

    Args:
        lengths (Sequence[int]): each sequence's length, every one in ``1..seq_len``.
        seq_len (int): slots per row.

    Returns:
        list[list[int]]: for each row, the indices of its sequences (longest first); rows in creation order.

    Raises:
        ValueError: a length outside ``1..seq_len``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # free slots -> rows with exactly that many free
    rooms: list[int] = []  # sorted distinct keys of by_room
    for index in order:
        length = lengths[index]
        if not 1 <= length <= seq_len:
            raise ValueError(f"sequence {index} has length {length}; pack_to_token_budget takes 1..{seq_len}")
        slot = bisect.bisect_left(rooms, length)
        if slot < len(rooms):
            room = rooms[slot]
            row = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], rooms[slot]
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(index)
        left = room - length
        if left:
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            by_room[left].append(row)
    return rows


class TokenBudgetDataset(Dataset):
    """Whole documents bin-packed into rows of ``seq_len`` slots, with positions restarting at each document.

    Each document is framed ``[bos] tokens [eos]``; one longer than ``seq_len`` is cut into ``seq_len`` pieces
    (each piece then counts as its own sequence). Sequences are packed by `pack_to_token_budget`, and a row's
    unused tail is padding. Item ``i`` is row ``i``:

    - ``input_ids``: the row's sequences back to back, then ``pad_id``;
    - ``labels``: ``input_ids``, with ``-100`` on padding and on the first token of every sequence, so no token is
      trained to predict the start of an unrelated document;
    - ``position_ids``: ``0, 1, ...`` restarting at every sequence (``0`` on padding).

    A batch of ``batch_size`` rows is a fixed budget of ``batch_size * seq_len`` token slots (fixed shapes for
    compiled models and for splitting into microbatches) holding however many sequences fit. colo's Llama (and
    transformers 5's) derives document ids from the restarted ``position_ids`` and masks attention per document, so
    no token attends to an earlier sequence of its row: the row trains as its sequences would one per row.

    Args:
        documents (Iterable[str]): the texts.
        tokenizer (Tokenizer): the tokenizer.
        seq_len (int): slots per row.
        max_tokens (int | None): cap on the tokens read. Default: ``None``.
        add_bos (bool): start every document with ``bos``. Default: ``True``.
        add_eos (bool): end every document with ``eos``. Default: ``True``.

    Attributes:
        sequence_rows: for each row, the ``(start, length)`` of its sequences in `tokens`.
        efficiency: the fraction of slots holding tokens (not padding).
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        max_tokens: int | None = None,
        add_bos: bool = True,
        add_eos: bool = True,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.seq_len = seq_len
        self.pad_id = tokenizer.pad_id
        pieces = list(tokenize_documents(documents, tokenizer, add_bos=add_bos, add_eos=add_eos, max_tokens=max_tokens))
        self.num_documents = len(pieces)
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        self.tokens: torch.Tensor = torch.from_numpy(stream.astype(np.int32, copy=False))
        starts, lengths, offset = [], [], 0
        for piece in pieces:
            for start in range(0, piece.size, seq_len):
                starts.append(offset + start)
                lengths.append(min(seq_len, piece.size - start))
            offset += piece.size
        if not lengths:
            raise ValueError("the corpus holds no tokens; add data")
        rows = pack_to_token_budget(lengths, seq_len=seq_len)
        self.sequence_rows: list[list[tuple[int, int]]] = [[(starts[i], lengths[i]) for i in row] for row in rows]
        self.efficiency = sum(lengths) / (len(rows) * seq_len)

    @property
    def row_lengths(self) -> np.ndarray:
        """Tokens (not padding) in each row, int64: what a tokens-per-second count should count."""
        return np.asarray([sum(length for _, length in row) for row in self.sequence_rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sequence_rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(self.seq_len, dtype=torch.long)
        cursor = 0
        for start, length in self.sequence_rows[index]:
            end = cursor + length
            input_ids[cursor:end] = self.tokens[start : start + length]
            labels[cursor + 1 : end] = input_ids[cursor + 1 : end]
            position_ids[cursor:end] = torch.arange(length)
            cursor = end
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
