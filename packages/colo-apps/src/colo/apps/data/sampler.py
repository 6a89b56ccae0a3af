"""A distributed batch sampler that resumes mid-epoch, and the loop that turns its batches into tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .streaming import CHECKPOINT_KIND

_STATE_VERSION = 1


class ResumableDistributedSampler:
    """Batches of sample indices for one data-parallel rank, with a state that resumes at the exact next sample.

    Every epoch the ``dataset_len`` indices are permuted by a generator seeded with ``(seed, epoch)`` (numpy's
    PCG64 through ``SeedSequence``: the same permutation on every machine). The permutation is read in global
    batches of ``num_replicas * batch_size`` indices; rank ``r`` takes every ``num_replicas``-th index of each,
    starting at ``r``, so the ranks' batches are disjoint and together cover the epoch. With ``drop_last`` the
    last incomplete global batch is dropped; without it the permutation is wrapped around to fill it (a few samples
    then appear twice, as with torch's ``DistributedSampler``).

    Iterating yields this epoch's remaining batches, then moves to the next epoch. The state counts the batches
    yielded, so `state_dict` taken after the trainer received batch ``k`` resumes at batch ``k + 1`` — when batches
    are consumed as they are yielded (`batches`, or a ``DataLoader(batch_sampler=...)`` with ``num_workers=0``;
    worker processes prefetch ahead of the count).

    Args:
        dataset_len (int): the number of samples.
        num_replicas (int): the data-parallel size. Default: ``1``.
        rank (int): this rank's data-parallel index. Default: ``0``.
        batch_size (int): samples per batch on each rank.
        shuffle (bool): permute every epoch (else the natural order). Default: ``True``.
        seed (int): the permutation seed, the same on every rank. Default: ``0``.
        drop_last (bool): drop the last incomplete global batch. Default: ``True``.

    Raises:
        ValueError: a size that is not positive, a rank out of range, or (with ``drop_last``) fewer samples than
            one global batch.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be at least 1 (the data-parallel size)")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in 0..{num_replicas - 1} (the data-parallel rank)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        if dataset_len < 1:
            raise ValueError(f"dataset_len={dataset_len}: the dataset is empty; add data")
        global_batch = num_replicas * batch_size
        if drop_last and dataset_len < global_batch:
            raise ValueError(
                f"the dataset has {dataset_len} samples, fewer than one global batch of {global_batch} "
                f"(batch_size={batch_size} x num_replicas={num_replicas}); add data, lower the batch size, or "
                "set drop_last=False"
            )
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batches_consumed = 0

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks: ``num_replicas * batch_size``."""
        return self.num_replicas * self.batch_size

    @property
    def num_batches(self) -> int:
        """Batches per epoch on each rank (the same on every rank)."""
        if self.drop_last:
            return self.dataset_len // self.global_batch_size
        return -(-self.dataset_len // self.global_batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def permutation(self, epoch: int) -> np.ndarray:
        """The global order of epoch ``epoch``, before the split over ranks (int64 indices)."""
        if not self.shuffle:
            return np.arange(self.dataset_len, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len).astype(np.int64)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All of this rank's batches of epoch ``epoch``."""
        order = self.permutation(epoch)
        total = self.num_batches * self.global_batch_size
        if total > order.size:  # drop_last=False: wrap around to fill the last global batch
            order = np.resize(order, total)
        share = order[:total].reshape(self.num_batches, self.batch_size, self.num_replicas)[:, :, self.rank]
        return share.tolist()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch."""
        self.epoch = epoch
        self.batches_consumed = 0

    def __iter__(self) -> Iterator[list[int]]:
        if self.batches_consumed >= self.num_batches:  # a state saved right after an epoch's last batch
            self.set_epoch(self.epoch + 1)
        epoch = self.epoch
        for batch in self.epoch_batches(epoch)[self.batches_consumed :]:
            if self.epoch != epoch:  # set_epoch or load_state_dict was called mid-iteration
                return
            self.batches_consumed += 1
            yield batch
        self.set_epoch(epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able state: ``epoch``, ``batches_consumed`` (this epoch, per rank), ``samples_consumed`` (this
        epoch, over all ranks) and the settings that must match on resume. The same on every rank."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "samples_consumed": self.batches_consumed * self.global_batch_size,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_replicas": self.num_replicas,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from `state_dict`): the next batch is the one after the last consumed.

        The data-parallel size or batch size may differ from the saved run's when the samples consumed this epoch
        fill whole global batches of the new size: the permutation depends only on ``(seed, epoch)``, so the run
        continues at the same sample.

        Raises:
            ValueError: the dataset length, seed, shuffle or drop_last differ from the saved run's (the message
                names the field), or the consumed samples do not divide into the new global batch size.
        """
        if state.get("kind") is not None:  # a GlobalPositionSampler's or a stream's state
            what = (
                "streamed data.paths (data.streaming)"
                if state["kind"] == CHECKPOINT_KIND
                else "read prepared corpora (data.blend or a prepared corpus in data.paths)"
            )
            raise ValueError(
                f"cannot resume the sampler: the checkpoint's run {what}, this run reads raw files tokenized in "
                "memory; resume with the checkpoint's data settings, or start a fresh run (checkpoint.resume=none)"
            )
        for name in ("dataset_len", "seed", "shuffle", "drop_last"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"cannot resume the sampler: the checkpoint has {name}={state[name]!r}, this run "
                    f"{name}={getattr(self, name)!r}; use the checkpoint's data and seed, or start a fresh run"
                )
        samples = int(state.get("samples_consumed", state["batches_consumed"] * self.global_batch_size))
        if samples % self.global_batch_size:
            raise ValueError(
                f"cannot resume the sampler: {samples} samples were consumed this epoch, not a whole number of "
                f"global batches of {self.global_batch_size} (batch_size={self.batch_size} x "
                f"num_replicas={self.num_replicas}); resume with a global batch size that divides {samples}"
            )
        self.epoch = int(state["epoch"])
        self.batches_consumed = samples // self.global_batch_size


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of samples (dicts of equal-shaped tensors) into one batch dict.

    Raises:
        ValueError: the samples have different keys.
    """
    keys = list(items[0])
    for item in items[1:]:
        if list(item) != keys:
            raise ValueError(f"samples disagree on their fields: {keys} vs {list(item)}")
    return {key: torch.stack([item[key] for item in items]) for key in keys}


def check_token_ids(batch: Mapping[str, Any], vocab_size: int, *, ignore_index: int = -100) -> None:
    """Raise an `IndexError` when a batch's ``input_ids`` (or ``labels``, but for ``ignore_index``) hold an id
    outside ``[0, vocab_size)``: the error one process's embedding raises, in every layout (a vocabulary-parallel
    embedding would otherwise give a zero row for it and train on). A min and a max per tensor.

    Args:
        batch: a batch dict (other keys, and values that are not tensors, are not looked at).
        vocab_size: the model's vocabulary size.
        ignore_index: the label of tokens without a loss. Default: ``-100``.
    """
    for key, allowed in (("input_ids", None), ("labels", ignore_index)):
        values = batch.get(key)
        if not isinstance(values, torch.Tensor) or values.is_floating_point():
            continue
        valid = values if allowed is None else values[values != allowed]
        if valid.numel() == 0:
            continue
        low, high = int(valid.min()), int(valid.max())
        if low < 0 or high >= vocab_size:
            also = "" if allowed is None else f", or {allowed} for no loss"
            raise IndexError(
                f"the batch's {key} hold token id {high if high >= vocab_size else low}, out of range for the "
                f"model's vocabulary of {vocab_size} (ids must be in [0, {vocab_size}){also}); tokenize the data "
                "with the model's tokenizer (data.tokenizer) or give the model a vocabulary that holds every id "
                "(model.vocab_size)"
            )


def batches(
    dataset,
    sampler: ResumableDistributedSampler,
    *,
    repeat: bool = False,
    collate_fn: Callable[[list], Any] = collate,
) -> Iterator[dict[str, torch.Tensor]]:
    """Collated batches of ``dataset`` in the order ``sampler`` gives this rank.

    Loads in this process, as each batch is asked for, so the sampler's state always matches what was consumed
    (the datasets here hold their tokens in memory; a batch costs an index and a ``torch.stack``).

    Args:
        dataset: a map-style dataset whose items are dicts of tensors.
        sampler (ResumableDistributedSampler): this rank's sampler (its state decides where to start).
        repeat (bool): go on with the next epochs forever; else stop at the end of the current epoch.
            Default: ``False``.
        collate_fn (Callable): turns a list of items into a batch. Default: `collate` (``torch.stack`` per key).

    Yields:
        dict[str, torch.Tensor]: ``(batch_size, ...)`` tensors per key.
    """
    while True:
        for indices in sampler:
            yield collate_fn([dataset[i] for i in indices])
        if not repeat:
            return
