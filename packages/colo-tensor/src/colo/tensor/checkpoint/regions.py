"""Geometry of pieces and requested slices: rectangles of the global tensor, optionally narrowed to a flat range.

A `Region` is what a rank stores or needs: ``offsets``/``shape`` of a rectangle in the global tensor and an
optional ``[start, end)`` range of that rectangle's row-major elements. Overlaps are computed on bounding
rectangles first, so only the elements near an overlap are ever indexed or read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatShard:
    """A ZeRO-style flat shard: this rank holds elements ``[flat_start, flat_start + tensor.numel())`` of the
    row-major flattening of a global tensor of shape ``global_shape`` -- or, when ``rect_shape`` is given, of the
    rectangle ``rect_offsets``/``rect_shape`` of it (a ZeRO shard of a tensor-parallel shard).

    Pass one to `save_checkpoint` to save the elements it holds, or to `load_checkpoint` to fill ``tensor``.

    Args:
        tensor: the local elements, a 1-D tensor (its dtype is the global tensor's).
        global_shape: the shape of the whole tensor.
        flat_start: the index of ``tensor[0]`` in the flattened rectangle (the whole tensor by default).
        rect_offsets: where the rectangle starts in the global tensor; default all zeros.
        rect_shape: the rectangle's shape; default ``global_shape``.
        replica: another rank holds the same elements and writes them (a tensor-parallel replica); this one
            only loads. Default ``False``.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    flat_start: int
    rect_offsets: tuple[int, ...] | None = None
    rect_shape: tuple[int, ...] | None = None
    replica: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(x) for x in self.global_shape))
        rect_shape = self.global_shape if self.rect_shape is None else tuple(int(x) for x in self.rect_shape)
        rect_offsets = (0,) * len(rect_shape) if self.rect_offsets is None else tuple(int(x) for x in self.rect_offsets)
        object.__setattr__(self, "rect_shape", rect_shape)
        object.__setattr__(self, "rect_offsets", rect_offsets)
        if not isinstance(self.tensor, torch.Tensor) or self.tensor.dim() != 1:
            raise ValueError(f"FlatShard(tensor=...) must be a 1-D torch.Tensor, not {_describe(self.tensor)}")
        if len(rect_shape) != len(self.global_shape) or len(rect_offsets) != len(rect_shape):
            raise ValueError(
                f"FlatShard: rect_offsets {rect_offsets} and rect_shape {rect_shape} need one entry per dim of "
                f"global_shape {self.global_shape}"
            )
        if any(o < 0 or o + n > g for o, n, g in zip(rect_offsets, rect_shape, self.global_shape)):
            raise ValueError(
                f"FlatShard: the rectangle at {rect_offsets} of shape {rect_shape} lies outside a tensor of shape "
                f"{self.global_shape}"
            )
        total = math.prod(rect_shape)
        if not 0 <= self.flat_start <= self.flat_start + self.tensor.numel() <= total:
            raise ValueError(
                f"FlatShard: elements [{self.flat_start}, {self.flat_start + self.tensor.numel()}) lie outside a "
                f"rectangle of shape {rect_shape} ({total} elements)"
            )

    @property
    def flat_end(self) -> int:
        """One past the last element held."""
        return self.flat_start + self.tensor.numel()

    @property
    def region(self) -> Region:
        """The part of the global tensor this shard holds."""
        return Region(self.rect_offsets, self.rect_shape, (self.flat_start, self.flat_end))


def _describe(obj: object) -> str:
    return f"a tensor of shape {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else type(obj).__name__


@dataclass(frozen=True)
class Region:
    """A rectangle (``offsets``, ``shape``) of the global tensor, optionally narrowed to ``flat_range``."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat_range: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        """Number of elements of the region."""
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(self.shape)

    def bounding_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A small rectangle (global offsets, shape) holding the region, narrowing dims outer to inner."""
        if self.flat_range is None:
            return self.offsets, self.shape
        start, end = self.flat_range
        offsets, sizes = list(self.offsets), list(self.shape)
        if end <= start:
            return tuple(offsets), (0,) * len(sizes)
        for dim in range(len(self.shape)):
            stride = math.prod(self.shape[dim + 1 :])
            low, high = start // stride, (end - 1) // stride
            offsets[dim] += low
            sizes[dim] = high - low + 1
            if low != high:
                break
            start, end = start - low * stride, end - low * stride
        return tuple(offsets), tuple(sizes)


def intersect(
    a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two rectangles ``(offsets, shape)``, or ``None`` if it is empty."""
    offsets, shape = [], []
    for (a_off, a_size), (b_off, b_size) in zip(zip(*a), zip(*b)):
        low, high = max(a_off, b_off), min(a_off + a_size, b_off + b_size)
        if high <= low:
            return None
        offsets.append(low)
        shape.append(high - low)
    return tuple(offsets), tuple(shape)


def local_flat_index(box: tuple[tuple[int, ...], tuple[int, ...]], region: Region) -> torch.Tensor:
    """For every element of rectangle ``box`` (global coordinates), its index in ``region``'s row-major rectangle."""
    offsets, shape = box
    index = torch.zeros((), dtype=torch.int64)
    for dim, (offset, size) in enumerate(zip(offsets, shape)):
        stride = math.prod(region.shape[dim + 1 :])
        coords = torch.arange(offset - region.offsets[dim], offset - region.offsets[dim] + size, dtype=torch.int64)
        view = [1] * len(shape)
        view[dim] = size
        index = index + (coords * stride).view(view)
    return index.expand(shape) if shape else index
