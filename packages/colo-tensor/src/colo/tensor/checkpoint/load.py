"""`load_checkpoint`: each rank assembles exactly the slice its targets need from the pieces that overlap it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..layout import layout_of
from .files import PieceReader
from .index import CheckpointError, CheckpointIndex, Piece, TensorEntry, read_index
from .regions import FlatShard, Region, intersect, local_flat_index


@dataclass
class LoadStats:
    """What a `load_checkpoint` call read on this rank.

    Attributes:
        elements_read: tensor name -> number of elements read from the pieces (the parts that overlap the slice).
        pieces_read: tensor name -> number of pieces that overlapped the requested slice.
        bytes_read: tensor name -> bytes read from files, with what verifying them took (the covering checksummed
            blocks; a whole piece of an older checkpoint without block CRCs).
    """

    elements_read: dict[str, int] = field(default_factory=dict)
    pieces_read: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)


def _target_region(name: str, target: torch.Tensor | FlatShard) -> tuple[Region, torch.Tensor]:
    """The region ``target`` needs and the tensor to fill."""
    if isinstance(target, FlatShard):
        return target.region, target.tensor
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


def _copy_flat_overlap(
    reader: PieceReader, name: str, dtype: torch.dtype, piece: Piece, region: Region, out: torch.Tensor
) -> int:
    """Copy what ``piece`` holds of ``region`` when both lie in the same rectangle (ZeRO flat shards of one tensor,
    saved and loaded at any data-parallel size): the overlap is one run of the rectangle's row-major elements, so
    it is read as a slice and copied, with no per-element index. Returns the number of elements copied."""
    numel = math.prod(piece.shape)
    piece_start, piece_end = piece.flat_range if piece.flat_range is not None else (0, numel)
    region_start, region_end = region.flat_range if region.flat_range is not None else (0, numel)
    low, high = max(piece_start, region_start), min(piece_end, region_end)
    if high <= low:
        return 0
    if piece.flat_range is not None:
        values = reader.read(piece, name, dtype, (slice(low - piece_start, high - piece_start),))
    else:  # a whole rectangle: read the rows that hold the run (a contiguous block of its row-major elements)
        box_offsets, box_shape = Region(piece.offsets, piece.shape, (low, high)).bounding_box()
        index = tuple(slice(o - p, o - p + size) for o, p, size in zip(box_offsets, piece.offsets, box_shape))
        box_start = sum(
            (o - p) * math.prod(piece.shape[d + 1 :]) for d, (o, p) in enumerate(zip(box_offsets, piece.offsets))
        )
        values = reader.read(piece, name, dtype, index).reshape(-1)[low - box_start : high - box_start]
    out.view(-1)[low - region_start : high - region_start].copy_(values)
    return high - low


def _fill(reader: PieceReader, name: str, entry, region: Region, out: torch.Tensor, stats: LoadStats) -> None:
    """Fill ``out`` (the tensor of ``region``) from every piece of ``entry`` that overlaps it."""
    written = 0
    before, bytes_before = reader.elements_read, reader.bytes_read
    want = region.bounding_box()
    for piece in entry.pieces:
        stored = Region(piece.offsets, piece.shape, piece.flat_range)
        box = intersect(want, stored.bounding_box())
        if box is None or region.numel == 0:
            continue
        stats.pieces_read[name] = stats.pieces_read.get(name, 0) + 1
        same_rectangle = (piece.offsets, piece.shape) == (region.offsets, region.shape)
        if same_rectangle and (piece.flat_range, region.flat_range) != (None, None) and out.is_contiguous():
            written += _copy_flat_overlap(reader, name, entry.dtype, piece, region, out)
            continue
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
    stats.bytes_read[name] = reader.bytes_read - bytes_before
    if written != region.numel:
        raise CheckpointError(
            f"{reader.directory}: tensor {name!r}: the pieces cover {written} of the {region.numel} elements this "
            f"rank needs (region {region}); the checkpoint is incomplete"
        )


def read_whole_tensor(reader: PieceReader, name: str, entry: TensorEntry) -> torch.Tensor:
    """Tensor ``name`` assembled whole from its pieces, each read whole (so every CRC is checked).

    Raises:
        CheckpointError: a piece is unreadable or corrupt, or the pieces do not cover the tensor.
    """
    out = torch.empty(entry.shape, dtype=entry.dtype)
    flat_out = out.view(-1)
    whole = Region((0,) * len(entry.shape), entry.shape)
    written = 0
    for piece in entry.pieces:
        if len(piece.offsets) != len(entry.shape) or any(
            o < 0 or o + s > extent for o, s, extent in zip(piece.offsets, piece.shape, entry.shape)
        ):
            raise CheckpointError(
                f"{reader.directory}: tensor {name!r}: piece {piece.offsets}+{piece.shape} in {piece.file} lies "
                f"outside the tensor's shape {entry.shape}"
            )
        values = reader.read(piece, name, entry.dtype)
        if piece.flat_range is None:
            view = out
            for dim, (offset, size) in enumerate(zip(piece.offsets, piece.shape)):
                view = view.narrow(dim, offset, size)
            view.copy_(values)
        elif piece.shape == entry.shape:  # a flat range of the whole tensor (ZeRO): one contiguous run
            flat_out[piece.flat_range[0] : piece.flat_range[1]].copy_(values)
        else:  # a flat range of a rectangle (ZeRO over a tensor-parallel shard)
            flat = local_flat_index((piece.offsets, piece.shape), whole).reshape(-1)
            flat_out[flat[piece.flat_range[0] : piece.flat_range[1]]] = values
        written += values.numel()
    if written != entry.numel:
        raise CheckpointError(
            f"{reader.directory}: tensor {name!r}: its pieces hold {written} elements but its shape {entry.shape} "
            f"has {entry.numel}; the index is inconsistent (run verify)"
        )
    return out


def load_checkpoint(
    path: str | os.PathLike,
    targets: Mapping[str, torch.Tensor | FlatShard],
    *,
    strict: bool = True,
) -> tuple[dict, LoadStats]:
    """Fill ``targets`` in place from the checkpoint at ``path``, whatever layout it was saved with.

    Each rank reads only the parts of the pieces that overlap the slice each target needs: a tensor with a colo
    layout needs its local shard, a plain tensor the whole tensor, a `FlatShard` its flat range. Every read is
    verified: the CRC-32s of the blocks covering it (a piece of an older checkpoint without block CRCs: its whole
    CRC, once). No communication: every rank reads for itself.

    Args:
        path: a committed checkpoint directory (see `latest_checkpoint`).
        targets: name -> tensor or `FlatShard` to fill; dtypes and global shapes must match the checkpoint.
        strict: raise if the checkpoint holds tensors not in ``targets`` (missing ones always raise).

    Returns:
        ``(metadata, stats)``: the metadata saved with the checkpoint and what this rank read (`LoadStats`).

    Raises:
        CheckpointError: a tensor is missing, mismatched, or a file is truncated or corrupt (naming both).
        CheckpointFormatError: the index misses a required field or one is malformed (naming the file, the tensor
            and the field).
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
