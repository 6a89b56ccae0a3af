"""Placements: how a tensor lies along one mesh axis (`Shard`, `Replicate`, `Partial`), and torch.chunk arithmetic.

A layout holds one placement per mesh axis. ``Shard(dim)`` splits tensor dimension ``dim`` over the axis with
``torch.chunk`` semantics: every rank but the trailing ones gets ``ceil(extent / n)`` elements, the trailing
ones get what is left, possibly nothing (this is how DTensor splits uneven dimensions). ``Replicate()`` keeps
the whole value on every rank of the axis. ``Partial(reduce)`` means every rank holds a partial value and the
tensor is their reduction (``"sum"``, ``"avg"`` or ``"max"``) over the axis.
"""

from __future__ import annotations

from dataclasses import dataclass

PARTIAL_REDUCTIONS = ("sum", "avg", "max")
"""Reductions a `Partial` placement may name."""


@dataclass(frozen=True)
class Shard:
    """Tensor dimension ``dim`` is split over the mesh axis with ``torch.chunk`` semantics.

    Args:
        dim: the tensor dimension to split (negative values count from the end and are normalised by `Layout`).
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard(dim={self.dim!r}): dim must be an int naming a tensor dimension")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh axis holds the whole value."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """Every rank of the mesh axis holds a partial value; the tensor is their reduction over the axis.

    Args:
        reduce: ``"sum"`` (the default), ``"avg"`` or ``"max"``.
    """

    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in PARTIAL_REDUCTIONS:
            raise ValueError(f"Partial(reduce={self.reduce!r}) is not supported; use one of {PARTIAL_REDUCTIONS}")

    def __repr__(self) -> str:
        return f"Partial({self.reduce!r})"


Placement = Shard | Replicate | Partial
"""One of `Shard`, `Replicate`, `Partial`."""


def check_placement(placement: object, where: str) -> Placement:
    """Return ``placement`` if it is a colo placement, else raise a `TypeError` that says what ``where`` expects."""
    if not isinstance(placement, (Shard, Replicate, Partial)):
        raise TypeError(f"{where} must be a placement (Shard(dim), Replicate() or Partial('sum')), not {placement!r}")
    return placement


def chunk_size(extent: int, num_chunks: int) -> int:
    """The size of a full chunk when ``extent`` elements are split into ``num_chunks`` with ``torch.chunk``."""
    return -(-extent // num_chunks) if num_chunks else 0


def chunk_range(extent: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of chunk ``index`` when ``extent`` elements are split into ``num_chunks``.

    Chunks have ``ceil(extent / num_chunks)`` elements; trailing chunks are smaller or empty (the offset of an
    empty chunk is ``extent``). ``torch.chunk`` returns fewer chunks in that case; the missing ones are empty.
    """
    full = chunk_size(extent, num_chunks)
    offset = min(index * full, extent)
    return offset, min(full, extent - offset)


def chunk_sizes(extent: int, num_chunks: int) -> list[int]:
    """The size of every chunk when ``extent`` elements are split into ``num_chunks`` (see `chunk_range`)."""
    return [chunk_range(extent, num_chunks, i)[1] for i in range(num_chunks)]
