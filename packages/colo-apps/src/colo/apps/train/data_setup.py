"""The run's data: tokenizer, packed sequences with a held-out tail for evaluation, and the resumable sampler
over this rank's share (colo.apps.data)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset, Subset

from ..data import PackedDataset, ResumableDistributedSampler, default_corpus, read_documents
from .config import RunConfig


@dataclass
class RunData:
    """What the trainer reads from.

    Attributes:
        tokenizer: encodes the corpus and decodes samples.
        train: the training sequences.
        eval: the held-out sequences (``None`` without evaluation).
        sampler: this rank's batches of ``train`` indices (resumable: its state goes into checkpoints).
        batch_size: sequences per step on this data-parallel rank.
    """

    tokenizer: object
    train: Dataset
    eval: Dataset | None
    sampler: ResumableDistributedSampler
    batch_size: int


def build_data(config: RunConfig, tokenizer, *, num_replicas: int, rank: int) -> RunData:
    """Read, tokenize and pack the corpus; split off the eval tail; make this rank's sampler.

    Args:
        config: the run config (``data``, ``eval``, ``seed``).
        tokenizer: from `load_tokenizer(config.data.tokenizer)`.
        num_replicas: data-parallel ranks that get different samples (``plugin.sample_axes``).
        rank: this rank's index among them.

    Raises:
        ValueError: the batch does not split over the ranks, or the corpus is too small (naming the field to change).
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
    paths = data.paths or default_corpus()
    documents = read_documents(paths, format=data.format, text_field=data.text_field)
    packed = PackedDataset(documents, tokenizer, seq_len=data.seq_len, max_tokens=data.max_tokens)
    held_out = config.eval.num_sequences if config.eval.every_steps else 0
    num_train = len(packed) - held_out
    if num_train < data.global_batch_size:
        raise ValueError(
            f"the corpus packs into {len(packed)} sequences of data.seq_len={data.seq_len}; after "
            f"eval.num_sequences={held_out} held out, fewer than one batch (data.global_batch_size="
            f"{data.global_batch_size}) is left; add data (data.paths, data.max_tokens) or lower these"
        )
    train = Subset(packed, range(num_train))
    evaluation = Subset(packed, range(num_train, len(packed))) if held_out else None
    sampler = ResumableDistributedSampler(
        num_train,
        num_replicas=num_replicas,
        rank=rank,
        batch_size=batch_size,
        shuffle=data.shuffle,
        seed=config.seed,
        drop_last=True,
    )
    return RunData(tokenizer=tokenizer, train=train, eval=evaluation, sampler=sampler, batch_size=batch_size)
