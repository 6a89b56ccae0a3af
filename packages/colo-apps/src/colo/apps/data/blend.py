"""Blends: several row sources interleaved so that each one's share of the samples is its weight.

Megatron-LM's `BlendedDataset` semantics, computed per sample in O(1) instead of from an index array as long as the
run: the sample stream is cut into blocks of `BLOCK` samples; in each block source ``k`` gets its largest-remainder
share ``quota[k]`` of the slots, at fixed slots spread out over the block (source ``k``'s ``j``-th slot at the
block's ``(j + 1/2) / quota[k]`` fraction, ties to the lower source). Global sample ``i`` is then source ``k``'s
``m``-th sample with ``m = (i // BLOCK) * quota[k] + (its rank among k's slots)``, and that is row
``order(m mod n_k)`` of the source's epoch ``m // n_k`` — a `KeyedPermutation` keyed by the seed, the source and the
epoch — so a source whose share asks for more samples than it holds runs through more epochs, each in a new order.

The held-out split is carved from each source's tail before anything is drawn: the last ``held_out[k]`` rows of
source ``k`` (``eval.num_sequences`` shared by weight) are the evaluation rows and never enter the training order.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset

from .order import KeyedPermutation

BLOCK = 10_000
"""Samples per block of the interleave: each source's share is exact to 1 / BLOCK."""


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights``: floors, then one more to the largest remainders (ties to the
    lower index). The parts sum to ``total``."""
    weights = np.asarray(weights, dtype=np.float64)
    exact = total * weights / weights.sum()
    parts = np.floor(exact).astype(np.int64)
    remainders = exact - parts
    for index in sorted(range(len(parts)), key=lambda i: (-remainders[i], i))[: total - int(parts.sum())]:
        parts[index] += 1
    return parts.tolist()


class BlendPattern:
    """Which source each slot of a block of ``block`` samples goes to (see the module docstring).

    Args:
        weights: the sources' weights (positive; normalized here).
        block: samples per block. Default: `BLOCK` (1 for a single source).

    Raises:
        ValueError: a weight is not positive, or too small to get a slot in a block.
    """

    def __init__(self, weights: Sequence[float], *, block: int | None = None) -> None:
        if not weights or any(not weight > 0 for weight in weights):
            raise ValueError(f"blend weights {list(weights)} must be positive")
        self.block = block if block is not None else (1 if len(weights) == 1 else BLOCK)
        self.quotas = largest_remainder(self.block, weights)
        if 0 in self.quotas:
            small = self.quotas.index(0)
            raise ValueError(
                f"a blend weight of {weights[small] / sum(weights):.2g} of the total gets no sample in {self.block}; "
                f"raise it above {1 / (2 * self.block):.2g} of the total or drop the source"
            )
        sources = np.repeat(np.arange(len(self.quotas)), self.quotas)
        ranks = np.concatenate([np.arange(quota) for quota in self.quotas])
        times = (ranks + 0.5) / np.repeat(self.quotas, self.quotas)
        order = np.lexsort((sources, times))
        self.sources = sources[order]
        """Each slot's source."""
        self.ranks = ranks[order]
        """Each slot's rank among its source's slots."""

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(source, the source's sample number)`` of each global sample in ``positions`` (``int64`` arrays)."""
        positions = np.asarray(positions, dtype=np.int64)
        blocks, slots = np.divmod(positions, self.block)
        sources = self.sources[slots]
        return sources, blocks * np.asarray(self.quotas, dtype=np.int64)[sources] + self.ranks[slots]


class ConcatRows(Dataset):
    """Ranges of several datasets as one map-style dataset: ``parts`` of ``(dataset, start, stop)``, in order."""

    def __init__(self, parts: Sequence[tuple[Dataset, int, int]]) -> None:
        self.parts = [(dataset, start, stop) for dataset, start, stop in parts if stop > start]
        self.offsets = np.cumsum([0] + [stop - start for _, start, stop in self.parts]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """``(part, row of that part's dataset)`` of item ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        part = bisect.bisect_right(self.offsets, index) - 1
        return part, self.parts[part][1] + index - self.offsets[part]

    def __getitem__(self, index: int):
        part, row = self.locate(int(index))
        return self.parts[part][0][row]

    def row_lengths(self, indices) -> np.ndarray:
        """Real (non-padding) tokens of each of ``indices`` (``row_lengths`` of the datasets)."""
        located = [self.locate(int(index)) for index in np.ravel(indices)]
        lengths = [int(self.parts[part][0].row_lengths([row])[0]) for part, row in located]
        return np.asarray(lengths, dtype=np.int64).reshape(np.shape(indices))


class RowLengths:
    """``row_lengths`` of a dataset behind ``[indices]`` (what `RunData.tokens_per_row` is indexed with)."""

    def __init__(self, rows: ConcatRows) -> None:
        self.rows = rows

    def __getitem__(self, indices) -> np.ndarray:
        return self.rows.row_lengths(indices)


class Blend:
    """Sources of rows blended by weight, each held-out tail split off, as one endless training order.

    Args:
        sources: map-style datasets (`PreparedWindows` or `PreparedDocuments`: with ``row_lengths`` and
            ``identity``).
        weights: their weights (normalized).
        seed: the order's seed.
        shuffle: permute each source's epochs (else each source's rows in order). Default: ``True``.
        held_out: rows held out for evaluation, shared by weight over the sources' tails. Default: ``0``.
        names: the sources' names for messages (their paths). Default: ``source 0``, ...

    Attributes:
        train: the training rows (`ConcatRows` of each source's head); `samples` indexes it.
        eval: the held-out rows (each source's tail), or ``None``.
        num_train: training rows of each source.
        held_out: held-out rows of each source.

    Raises:
        ValueError: a source would keep no training row.
    """

    def __init__(
        self,
        sources: Sequence[Dataset],
        weights: Sequence[float],
        *,
        seed: int,
        shuffle: bool = True,
        held_out: int = 0,
        names: Sequence[str] | None = None,
    ) -> None:
        if len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources and {len(weights)} weights")
        self.sources = list(sources)
        self.names = list(names) if names is not None else [f"source {k}" for k in range(len(sources))]
        total = float(sum(weights))
        self.weights = [weight / total for weight in weights]
        self.pattern = BlendPattern(self.weights)
        self.seed = seed
        self.shuffle = shuffle
        self.held_out = largest_remainder(held_out, self.weights) if held_out else [0] * len(sources)
        self.num_train = [len(source) - kept for source, kept in zip(self.sources, self.held_out)]
        for name, rows, kept in zip(self.names, self.num_train, self.held_out):
            if rows < 1:
                raise ValueError(
                    f"{name} has {rows + kept} rows; holding out {kept} of them for evaluation leaves none to train "
                    "on: lower eval.num_sequences or add data"
                )
        self.train = ConcatRows([(source, 0, rows) for source, rows in zip(self.sources, self.num_train)])
        self._train_offsets = np.asarray(self.train.offsets[:-1], dtype=np.int64)
        tails = [(source, rows, len(source)) for source, rows in zip(self.sources, self.num_train)]
        self.eval = ConcatRows(tails) if held_out else None

    def source_samples(self, source: int, numbers) -> np.ndarray:
        """Rows (of ``source``'s training head) of the source's samples number ``numbers``."""
        numbers = np.asarray(numbers, dtype=np.int64)
        size = self.num_train[source]
        epochs, positions = np.divmod(numbers, size)
        if not self.shuffle:
            return positions
        rows = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            rows[mask] = KeyedPermutation(size, seed=self.seed, epoch=epoch, stream=source)(positions[mask])
        return rows

    def samples(self, positions) -> np.ndarray:
        """The `train` indices of the global samples ``positions`` (``int64``)."""
        positions = np.asarray(positions, dtype=np.int64)
        sources, numbers = self.pattern.locate(positions)
        out = np.empty_like(positions)
        for source in np.unique(sources).tolist():
            mask = sources == source
            out[mask] = self._train_offsets[source] + self.source_samples(source, numbers[mask])
        return out

    def identity(self) -> dict:
        """What a resumed run must read the same (JSON): seed, shuffle, and per source its dataset's identity,
        weight and split."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "block": self.pattern.block,
            "sources": [
                {**source.identity(), "weight": weight, "train_rows": rows, "held_out": kept}
                for source, weight, rows, kept in zip(self.sources, self.weights, self.num_train, self.held_out)
            ],
        }
