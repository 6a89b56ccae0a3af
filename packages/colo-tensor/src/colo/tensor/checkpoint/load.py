"""`load_checkpoint`: each rank assembles exactly the slice its targets need from the pieces that overlap it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..layout import layout_of
from .files import PieceReader
from .index import CheckpointError, CheckpointIndex, Piece, read_index
from .regions import FlatShard, Region, intersect, local_flat_index


@dataclass
class LoadStats:
    """What a `load_checkpoint` call read on this rank.

    Attributes:
        elements_read: tensor name -> number of elements read from files (what was allocated for reading).
        pieces_read: tensor name -> number of pieces that overlapped the requested slice.
    """

    elements_read: dict[str, int] = field(default_factory=dict)
    pieces_read: dict[str, int] = field(default_factory=dict)


def _target_region(name: str, target: torch.Tensor | FlatShard) -> tuple[Region, torch.Tensor]:
    """The region ``target`` needs and the tensor to fill."""
    if isinstance(target, FlatShard):
        shape = target.global_shape
        return Region((0,) * len(shape), shape, (target.flat_start, target.flat_end)), target.tensor
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"load_checkpoint: targets[{name!r}] must be a torch.Tensor or FlatShard, not {type(target)}")
    layout = layout_of(target)
    if layout is None:
        return Region((0,) * target.dim(), tuple(target.shape)), target
    if layout.partial_axes:
        raise ValueError(
            f"load_checkpoint: targets[{name!r}] is Partial over {layout.partial_axes}; load into "
            "a Replicate or Shard layout"
        )
    return Region(tuple(layout.local_offsets()), tuple(layout.local_shape())), target


def _read_overlap(
    reader: PieceReader, name: str, dtype: torch.dtype, piece: Piece, box
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values of ``piece`` on rectangle ``box`` (shape of ``box``) and a mask of which are stored (None: all)."""
    stored = Region(piece.offsets, piece.shape, piece.flat_range)
    if piece.flat_range is None:
        index = tuple(slice(o - po, o - po + s) for o, po, s in zip(box[0], piece.offsets, box[1]))
        return reader.read(piece, name, dtype, index), None
    start, end = piece.flat_range
    flat = local_flat_index(box, stored)
    low, high = max(start, int(flat.min())), min(end, int(flat.max()) + 1)
    if high <= low:
        return torch.empty(box[1], dtype=dtype), torch.zeros(box[1], dtype=torch.bool)
    values = reader.read(piece, name, dtype, (slice(low - start, high - start),))
    mask = (flat >= low) & (flat < high)
    out = torch.empty(box[1], dtype=dtype)
    out[mask] = values[flat[mask] - low]
    return out, mask


def _fill(reader: PieceReader, name: str, entry, region: Region, out: torch.Tensor, stats: LoadStats) -> None:
    """Fill ``out`` (the tensor of ``region``) from every piece of ``entry`` that overlaps it."""
    written = 0
    before = reader.elements_read
    want = region.bounding_box()
    for piece in entry.pieces:
        stored = Region(piece.offsets, piece.shape, piece.flat_range)
        box = intersect(want, stored.bounding_box())
        if box is None or region.numel == 0:
            continue
        stats.pieces_read[name] = stats.pieces_read.get(name, 0) + 1
        values, mask = _read_overlap(reader, name, entry.dtype, piece, box)
        if region.flat_range is None:
            view = out
            for dim, (offset, size) in enumerate(zip(box[0], box[1])):
                view = view.narrow(dim, offset - region.offsets[dim], size)
            if mask is None:
                view.copy_(values)
                written += values.numel()
            else:
                view[mask] = values[mask]
                written += int(mask.sum())
        else:
            start, end = region.flat_range
            flat = local_flat_index(box, region)
            keep = (flat >= start) & (flat < end)
            if mask is not None:
                keep &= mask
            out[flat[keep] - start] = values[keep]
            written += int(keep.sum())
    stats.elements_read[name] = reader.elements_read - before
    if written != region.numel:
        raise CheckpointError(
            f"{reader.directory}: tensor {name!r}: the pieces cover {written} of the {region.numel} elements this "
            f"rank needs (region {region}); the checkpoint is incomplete"
        )


def load_checkpoint(
    path: str | os.PathLike,
    targets: Mapping[str, torch.Tensor | FlatShard],
    *,
    strict: bool = True,
) -> tuple[dict, LoadStats]:
    """Fill ``targets`` in place from the checkpoint at ``path``, whatever layout it was saved with.

    Each rank reads, with safetensors' lazy slicing, only the parts of the pieces that overlap the slice each
    target needs: a tensor with a colo layout needs its local shard, a plain tensor the whole tensor, a
    `FlatShard` its flat range. No communication: every rank reads for itself.

    Args:
        path: a committed checkpoint directory (see `latest_checkpoint`).
        targets: name -> tensor or `FlatShard` to fill; dtypes and global shapes must match the checkpoint.
        strict: raise if the checkpoint holds tensors not in ``targets`` (missing ones always raise).

    Returns:
        ``(metadata, stats)``: the metadata saved with the checkpoint and what this rank read (`LoadStats`).

    Raises:
        CheckpointError: a tensor is missing, mismatched, or a file is truncated or corrupt (naming both).
    """
    directory = os.fspath(path)
    index: CheckpointIndex = read_index(directory)
    missing = sorted(set(targets) - set(index.tensors))
    if missing:
        raise CheckpointError(f"{directory}: no tensor {missing[0]!r} in the checkpoint ({len(missing)} missing)")
    unexpected = sorted(set(index.tensors) - set(targets))
    if strict and unexpected:
        raise CheckpointError(
            f"{directory}: the checkpoint holds {unexpected[0]!r} ({len(unexpected)} tensors) that targets do not "
            "name; pass strict=False to skip them"
        )
    stats = LoadStats()
    with PieceReader(directory) as reader:
        for name, target in targets.items():
            entry = index.tensors[name]
            region, out = _target_region(name, target)
            global_shape = (
                target.global_shape
                if isinstance(target, FlatShard)
                else (tuple(layout_of(target).global_shape) if layout_of(target) is not None else tuple(target.shape))
            )
            if tuple(global_shape) != entry.shape or out.dtype != entry.dtype:
                raise CheckpointError(
                    f"{directory}: tensor {name!r} is {entry.shape} {entry.dtype} in the checkpoint but the target is "
                    f"{tuple(global_shape)} {out.dtype}"
                )
            with torch.no_grad():
                _fill(reader, name, entry, region, out, stats)
    return index.metadata, stats
