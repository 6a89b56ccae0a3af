"""The run's data: the dataset ``data.task`` and ``data.packing`` select, a held-out tail for evaluation, and the
resumable sampler over this rank's share (colo.apps.data).

- ``task='pretrain'``, ``packing='fixed'`` (the default): `PackedDataset`, rows ``input_ids`` and ``labels``
  (windows of one token stream, no padding);
- ``task='pretrain'``, ``packing='documents'``: `TokenBudgetDataset`, rows ``input_ids``, ``labels`` and
  ``position_ids`` (whole documents, positions restarting per document, a padded tail);
- ``task='sft'``: `SFTDataset`, rows ``input_ids`` and ``labels`` (one conversation, labels on the assistant's
  replies only, a padded tail); with ``packing='documents'`` several whole conversations per row and
  ``position_ids`` restarting per conversation.

Every key of a row reaches the model's forward (``Booster.train_step`` splits the batch dict into microbatches
along dim 0 and calls ``model(**microbatch)``), so ``position_ids`` restart per document in the Llama's rotary
embedding, and the model derives from them the document mask of its attention (nothing attends across documents).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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
from .config import DataSection, RunConfig


@dataclass
class RunData:
    """What the trainer reads from.

    Attributes:
        tokenizer: encodes the corpus and decodes samples.
        train: the training rows.
        eval: the held-out rows (``None`` without evaluation).
        sampler: this rank's batches of ``train`` indices (resumable: its state goes into checkpoints).
        batch_size: rows per step on this data-parallel rank.
        tokens_per_row: the real (non-padding) tokens of each ``train`` row; ``None`` when every row is full
            (fixed windows).
        description: one line on what the rows hold, for the run's log.
        vocab_size: the model's vocabulary: every batch's ids and labels are checked to lie in it
            (`colo.apps.data.check_token_ids`); ``None``: not checked.
    """

    tokenizer: object
    train: Dataset
    eval: Dataset | None
    sampler: ResumableDistributedSampler
    batch_size: int
    tokens_per_row: np.ndarray | None = None
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


def build_data(config: RunConfig, tokenizer, *, num_replicas: int, rank: int, vocab_size: int | None = None) -> RunData:
    """Read and tokenize the data into rows; split off the eval tail; make this rank's sampler.

    Args:
        config: the run config (``data``, ``eval``, ``seed``; ``plugin`` for what the layout can feed the model).
        tokenizer: from `load_tokenizer(config.data.tokenizer)`.
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
    rollout = config.ppo if data.task == "ppo" else config.grpo  # the online RL task's prompt settings
    dataset, tokens_per_row, description = build_dataset(data, tokenizer, config.preference, rollout)
    held_out = config.eval.num_sequences if config.eval.every_steps else 0
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


def build_dataset(data: DataSection, tokenizer, preference=None, grpo=None) -> tuple[Dataset, np.ndarray | None, str]:
    """The dataset ``data.task`` and ``data.packing`` select (see the module docstring).

    Returns:
        ``(dataset, real tokens of each row or None when every row is full, a one-line description)``.
    """
    if data.task in ("rm", "dpo"):
        return build_preference_dataset(data, preference, tokenizer)
    if data.task in ("grpo", "ppo"):
        return build_prompt_dataset(data, grpo, tokenizer)
    documents = read_documents(
        data.paths or default_corpus(),
        format=data.format,
        text_field=data.text_field,
        messages_field=data.messages_field,
        prompt_field=data.prompt_field,
        response_field=data.response_field,
    )
    if data.task == "sft":
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


def build_preference_dataset(data: DataSection, preference, tokenizer) -> tuple[Dataset, np.ndarray, str]:
    """``task='rm' | 'dpo'``: `colo.apps.rlhf.PreferenceDataset` items (chosen and rejected rows of one record as one
    ``(2, seq_len)`` item), from ``data.paths`` or the embedded Python-line set (``preference.synthetic_records``)."""
    from ..rlhf import PreferenceDataset, read_preference_records
    from ..rlhf.synthetic import python_line_records

    if data.paths:
        records = read_preference_records(data.paths, format=data.format)
        source = ", ".join(data.paths)
    else:
        records = python_line_records(preference.synthetic_records, seed=0)
        source = f"{preference.synthetic_records} synthetic records (Python lines vs their words shuffled)"
    template = data.chat_template.template() if "chat_template" in data.model_fields_set else None
    try:
        pairs = PreferenceDataset(
            records, tokenizer, seq_len=data.seq_len, template=template, max_prompt_len=preference.max_prompt_len
        )
    except ValueError as error:
        raise ValueError(f"data.task={data.task!r}: {error}") from None
    description = (
        f"{data.task}: {len(pairs)} preference pairs from {source} (chosen and rejected in one forward), "
        f"{pairs.num_prompts_truncated} prompts truncated from the left, {pairs.num_responses_truncated} pairs "
        "with responses cut at data.seq_len"
    )
    return pairs, pairs.row_lengths, description


def build_prompt_dataset(data: DataSection, grpo, tokenizer) -> tuple[Dataset, np.ndarray, str]:
    """``task='grpo'`` or ``'ppo'`` (``grpo`` is then the ``ppo`` section): `colo.apps.rlhf.prompts.PromptDataset`
    items (a prompt's ids, text and other columns), from ``data.paths`` or the embedded arithmetic prompts
    (``grpo.synthetic_prompts``); every prompt within ``grpo.max_prompt_len`` tokens (else a `ValueError` naming
    the record)."""
    from ..rlhf.data import read_preference_records
    from ..rlhf.prompts import PromptDataset
    from ..rlhf.synthetic import arithmetic_prompts

    if data.paths:
        records = read_preference_records(data.paths, format=data.format)
        source = ", ".join(data.paths)
    else:
        records = arithmetic_prompts(grpo.synthetic_prompts, seed=0, max_operand=grpo.max_operand)
        source = f"{grpo.synthetic_prompts} synthetic addition prompts (operands below {grpo.max_operand})"
    try:
        prompts = PromptDataset(records, tokenizer, max_prompt_len=grpo.max_prompt_len, prompt_field=data.prompt_field)
    except ValueError as error:
        raise ValueError(f"data.task={data.task!r}: {error}") from None
    description = (
        f"{data.task}: {len(prompts)} prompts from {source}, {grpo.group_size} completions each per step, up to "
        f"{grpo.max_new_tokens} new tokens"
    )
    return prompts, prompts.prompt_lengths, description
