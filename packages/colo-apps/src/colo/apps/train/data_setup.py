"""The run's data: the rows of the run's task (a language-modelling task's are built here, as ``data.packing``
selects), a held-out tail for evaluation, and the resumable sampler over this rank's share (colo.apps.data).

- ``task='pretrain'``, ``packing='fixed'`` (the default): `PackedDataset`, rows ``input_ids`` and ``labels``
  (windows of one token stream, no padding);
- ``task='pretrain'``, ``packing='documents'``: `TokenBudgetDataset`, rows ``input_ids``, ``labels`` and
  ``position_ids`` (whole documents, positions restarting per document, a padded tail);
- ``task='sft'``: `SFTDataset`, rows ``input_ids`` and ``labels`` (one conversation, labels on the assistant's
  replies only, a padded tail); with ``packing='documents'`` several whole conversations per row and
  ``position_ids`` restarting per conversation.

``data.streaming`` reads ``data.paths`` while training instead (`colo.apps.train.streaming_data`).

``data.blend`` (or a prepared corpus in ``data.paths``) reads prepared token shards instead of tokenizing at
start-up (`open_prepared`): the same rows (`colo.apps.data.prepared`), blended by weight with each corpus's
held-out tail split off (`colo.apps.data.blend.Blend`), read from one global sample position that a run resumes at
any data-parallel size (`colo.apps.data.global_sampler.GlobalPositionSampler`).

Every key of a row reaches the model's forward (``Booster.train_step`` splits the batch dict into microbatches
along dim 0 and calls ``model(**microbatch)``), so ``position_ids`` restart per document in the Llama's rotary
embedding, and the model derives from them the document mask of its attention (nothing attends across documents).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ..data import (
    PackedDataset,
    ResumableDistributedSampler,
    SFTDataset,
    TokenBudgetDataset,
    check_token_ids,
    collate,
    default_corpus,
    read_documents,
)
from ..data.blend import Blend, RowLengths
from ..data.global_sampler import GlobalPositionSampler
from ..data.prepared import PreparedDocuments, PreparedWindows
from ..data.shards import CorpusError, TokenCorpus
from .config import DataSection

if TYPE_CHECKING:
    from .config import RunConfig


@dataclass
class RunData:
    """What the trainer reads from.

    Attributes:
        tokenizer: encodes the corpus and decodes samples.
        train: the training rows (``None`` when streamed: `colo.apps.train.streaming_data.StreamingRunData`).
        eval: the held-out rows (``None`` without evaluation).
        sampler: this rank's batches of ``train`` indices (resumable: its state goes into checkpoints): a
            `ResumableDistributedSampler`, or a `GlobalPositionSampler` over prepared corpora (``None`` when
            streamed).
        batch_size: rows per step on this data-parallel rank.
        tokens_per_row: the real (non-padding) tokens of ``train`` rows, indexed with a batch's indices; ``None``
            when every row is full (fixed windows).
        description: one line on what the rows hold, for the run's log.
        vocab_size: the model's vocabulary: every batch's ids and labels are checked to lie in it
            (`colo.apps.data.check_token_ids`); ``None``: not checked.
    """

    tokenizer: object
    train: Dataset | None
    eval: Dataset | None
    sampler: ResumableDistributedSampler | GlobalPositionSampler | None
    batch_size: int
    tokens_per_row: np.ndarray | RowLengths | None = None
    description: str = ""
    vocab_size: int | None = None

    def train_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """This rank's training batches, epoch after epoch, each with its number of real (non-padding) tokens.

        As `colo.apps.data.batches(train, sampler, repeat=True)`: a batch is loaded when asked for, so the
        sampler's state always matches what the trainer consumed.
        """
        while True:
            for indices in self.sampler:
                batch = collate([self.train[i] for i in indices])
                if self.vocab_size is not None:
                    check_token_ids(batch, self.vocab_size)
                if self.tokens_per_row is None:
                    yield batch, batch["input_ids"].numel()
                else:
                    yield batch, int(self.tokens_per_row[indices].sum())

    def state_dict(self, group) -> dict:
        """The data position a checkpoint keeps (JSON; the trainer saves rank 0's): the sampler's, the same on
        every rank of ``group`` (the data-parallel ranks)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict, group) -> None:
        """Continue at `state_dict`'s position (the message of a refusal names what differs)."""
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Release what reading holds (a stream's thread); nothing for rows in memory."""


def build_data(
    config: RunConfig,
    tokenizer,
    *,
    num_replicas: int,
    rank: int,
    vocab_size: int | None = None,
    rows: tuple[Dataset, np.ndarray | None, str] | None = None,
) -> RunData:
    """Read and tokenize the data into rows; split off the eval tail; make this rank's sampler.

    Args:
        config: the run config (``data``, ``eval``, ``seed``; ``plugin`` for what the layout can feed the model).
        tokenizer: from `load_tokenizer(config.data.tokenizer)`.
        rows: ``(dataset, real tokens of each row or None, description)``; ``None``: the rows of ``data.task``'s
            task (its ``dataset_rows``). Not read with ``data.streaming`` (`build_streaming_data`).
        num_replicas: data-parallel ranks that get different samples (``plugin.sample_axes``).
        rank: this rank's index among them.
        vocab_size: the model's vocabulary, which every batch's ids are checked against (`RunData.vocab_size`).

    Raises:
        ValueError: the batch does not split over the ranks, the data is too small, or the plugin cannot take the
            rows' ``position_ids`` (each message names the field to change).
    """
    data = config.data
    if data.global_batch_size % num_replicas:
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} does not divide over the {num_replicas} data-parallel "
            f"ranks; use a multiple of {num_replicas}"
        )
    batch_size = data.global_batch_size // num_replicas
    if batch_size % config.schedule.num_microbatches:
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} gives {batch_size} sequences per data-parallel rank, "
            f"which do not split into schedule.num_microbatches={config.schedule.num_microbatches}; make "
            f"global_batch_size a multiple of {num_replicas * config.schedule.num_microbatches}"
        )
    if data.streaming:
        from .streaming_data import build_streaming_data

        return build_streaming_data(
            config, tokenizer, num_replicas=num_replicas, rank=rank, batch_size=batch_size, vocab_size=vocab_size
        )
    if rows is None:
        from .task import task_spec

        rows = task_spec(data.task).load().dataset_rows(config, tokenizer)
    dataset, tokens_per_row, description = rows
    held_out = config.eval.num_sequences if config.eval.every_steps else 0
    if isinstance(dataset, PreparedSources):
        return _blended_data(config, dataset, description, tokenizer, num_replicas, rank, batch_size, vocab_size)
    if held_out and len(dataset) - held_out < data.global_batch_size:
        # a small data set (a user's first file of chats): hold out a tenth of it instead, when that leaves a batch
        smaller = min(held_out, max(len(dataset) // 10, num_replicas))
        if len(dataset) - smaller >= data.global_batch_size:
            description += (
                f"; eval.num_sequences={held_out} would leave fewer than one batch of the {len(dataset)} rows, so "
                f"{smaller} are held out instead (set eval.num_sequences to choose)"
            )
            held_out = smaller
    num_train = len(dataset) - held_out
    if num_train < data.global_batch_size:
        raise ValueError(
            f"the data gives {len(dataset)} rows of data.seq_len={data.seq_len} tokens; after "
            f"eval.num_sequences={held_out} held out, fewer than one batch (data.global_batch_size="
            f"{data.global_batch_size}) is left; add data (data.paths, data.max_tokens) or lower "
            "data.global_batch_size / eval.num_sequences"
        )
    train = Subset(dataset, range(num_train))
    evaluation = Subset(dataset, range(num_train, len(dataset))) if held_out else None
    sampler = ResumableDistributedSampler(
        num_train,
        num_replicas=num_replicas,
        rank=rank,
        batch_size=batch_size,
        shuffle=data.shuffle,
        seed=config.seed,
        drop_last=True,
    )
    return RunData(
        tokenizer=tokenizer,
        train=train,
        eval=evaluation,
        sampler=sampler,
        batch_size=batch_size,
        tokens_per_row=None if tokens_per_row is None else tokens_per_row[:num_train],
        description=description,
        vocab_size=vocab_size,
    )


def _blended_data(
    config: RunConfig,
    sources: PreparedSources,
    description: str,
    tokenizer,
    num_replicas: int,
    rank: int,
    batch_size: int,
    vocab_size: int | None,
) -> RunData:
    """`build_data` over prepared corpora: the blend, its held-out tails and the global-position sampler."""
    data = config.data
    held_out = config.eval.num_sequences if config.eval.every_steps else 0
    blend = Blend(
        sources.datasets,
        sources.weights,
        seed=config.seed,
        shuffle=data.shuffle,
        held_out=held_out,
        names=sources.names,
    )
    if len(blend.train) < data.global_batch_size:
        raise ValueError(
            f"the prepared corpora give {len(blend.train)} training rows of data.seq_len={data.seq_len} tokens (after "
            f"eval.num_sequences={held_out} held out), fewer than one batch (data.global_batch_size="
            f"{data.global_batch_size}); add data or lower data.global_batch_size / eval.num_sequences"
        )
    if held_out:
        shares = " + ".join(str(kept) for kept in blend.held_out)
        description += f"; {held_out} rows held out for eval ({shares}, the corpora's last rows)"
    if len(sources.datasets) > 1:
        description += "; each corpus's share of the samples is its weight, a new order every epoch of it"
    return RunData(
        tokenizer=tokenizer,
        train=blend.train,
        eval=blend.eval,
        sampler=GlobalPositionSampler(blend, num_replicas=num_replicas, rank=rank, batch_size=batch_size),
        batch_size=batch_size,
        tokens_per_row=None if data.packing == "fixed" else RowLengths(blend.train),
        description=description,
        vocab_size=vocab_size,
    )


@dataclass
class PreparedSources:
    """Prepared corpora opened as rows (`build_dataset`'s dataset for them), before the blend and its split.

    Attributes:
        datasets: each corpus's rows (`PreparedWindows` or `PreparedDocuments`).
        weights: their blend weights.
        names: their paths.
    """

    datasets: list[Dataset] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(dataset) for dataset in self.datasets)


def open_prepared(data: DataSection, tokenizer) -> list[tuple[str, TokenCorpus, float]]:
    """Open the run's prepared corpora, checking each was made with ``tokenizer``: ``(field, corpus, weight)``.

    Raises:
        ValueError: a corpus is missing, damaged or made with another tokenizer (the message names the field).
    """
    opened = []
    for name, path, weight in data.prepared_corpora():
        try:
            opened.append((name, TokenCorpus(path, tokenizer=tokenizer), weight))
        except CorpusError as error:
            raise ValueError(f"{name}={path!r}: {error}") from None
    return opened


def _prepared_rows(data: DataSection, tokenizer, cache_dir: str | None) -> tuple[PreparedSources, None, str]:
    sources = PreparedSources()
    parts = []
    for name, corpus, weight in open_prepared(data, tokenizer):
        try:
            if data.packing == "documents":
                rows = PreparedDocuments(
                    corpus,
                    seq_len=data.seq_len,
                    pad_id=tokenizer.pad_id,
                    max_tokens=data.max_tokens,
                    fallback_dirs=[cache_dir] if cache_dir else (),
                )
            else:
                rows = PreparedWindows(corpus, seq_len=data.seq_len, max_tokens=data.max_tokens)
        except (CorpusError, ValueError) as error:
            raise ValueError(f"{name}={str(corpus.directory)!r}: {error}") from None
        sources.datasets.append(rows)
        sources.weights.append(weight)
        sources.names.append(str(corpus.directory))
        packed = f", {rows.efficiency:.0%} of slots hold tokens" if data.packing == "documents" else ""
        parts.append(f"{corpus.directory} (weight {weight:g}: {rows.num_tokens:,} tokens, {len(rows):,} rows{packed})")
    how = (
        "documents packed into rows, position_ids restart per document"
        if data.packing == "documents"
        else f"fixed windows of {data.seq_len} tokens"
    )
    return sources, None, f"prepared corpora, {how}: " + " + ".join(parts)


def build_dataset(
    data: DataSection, tokenizer, *, chats: bool, cache_dir: str | None = None
) -> tuple[Dataset | PreparedSources, np.ndarray | None, str]:
    """Language-modelling rows: chat records (``chats``, ``data.task: sft``) or text, as ``data.packing`` says (see
    the module docstring); prepared corpora (``data.blend``, or one in ``data.paths``) as `PreparedSources`, which
    `build_data` blends.

    Args:
        cache_dir: where a documents row index goes when a prepared corpus's folder is read-only (the run's).

    Returns:
        ``(dataset, real tokens of each row or None when every row is full, a one-line description)``.
    """
    if not chats and data.prepared_corpora():
        return _prepared_rows(data, tokenizer, cache_dir)
    documents = read_documents(
        data.paths or default_corpus(),
        format=data.format,
        text_field=data.text_field,
        messages_field=data.messages_field,
        prompt_field=data.prompt_field,
        response_field=data.response_field,
    )
    if chats:
        packing = "documents" if data.packing == "documents" else "none"
        try:
            sft = SFTDataset(
                documents, tokenizer, seq_len=data.seq_len, template=data.chat_template.template(), packing=packing
            )
        except ValueError as error:
            raise ValueError(f"data.task='sft': {error}") from None
        lengths = sft.row_lengths
        description = (
            f"sft: {sft.num_conversations} conversations in {len(sft)} rows"
            + (" (packed, position_ids restart per conversation)" if packing == "documents" else "")
            + f", {lengths.mean() / data.seq_len:.0%} of slots hold tokens, {sft.num_truncated} cut at "
            f"data.seq_len, {sft.num_skipped} skipped (no assistant token within it)"
        )
        return sft, lengths, description
    try:
        if data.packing == "documents":
            packed = TokenBudgetDataset(documents, tokenizer, seq_len=data.seq_len, max_tokens=data.max_tokens)
            description = (
                f"documents: {packed.num_documents} documents in {len(packed)} rows, {packed.efficiency:.0%} of "
                "slots hold tokens, position_ids restart per document"
            )
            return packed, packed.row_lengths, description
        windows = PackedDataset(documents, tokenizer, seq_len=data.seq_len, max_tokens=data.max_tokens)
        return windows, None, f"fixed windows of {windows.num_tokens} tokens from {windows.num_documents} documents"
    except TypeError as error:  # a chat record in pre-training data
        raise ValueError(
            f"data.task='pretrain': {error}; set data.task='sft' to train on chat records, or data.text_field to "
            "the records' text field"
        ) from None
