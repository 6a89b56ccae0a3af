"""`save_checkpoint`: every rank writes the pieces it owns; rank 0 writes the index and commits by one rename."""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from colo.comm import as_group, broadcast_object, gather_object

from ..layout import layout_of
from ..placement import Shard
from .files import fsync_path, rank_file_name, tensor_crc32
from .index import INDEX_FILE, CheckpointError, CheckpointIndex, Piece, TensorEntry, dtype_name
from .regions import FlatShard


def _owned_piece(name: str, value: torch.Tensor | FlatShard, rank: int):
    """``(global shape, dtype, offsets, shape, flat_range, data)`` this rank writes for ``name``, or ``None``."""
    if isinstance(value, FlatShard):
        if value.tensor.numel() == 0:
            return None
        shape = value.global_shape
        return shape, value.tensor.dtype, (0,) * len(shape), shape, (value.flat_start, value.flat_end), value.tensor
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"save_checkpoint: tensors[{name!r}] must be a torch.Tensor or FlatShard, not {type(value)}")
    layout = layout_of(value)
    if layout is None:  # a plain tensor: replicated over the group, written by rank 0
        shape = tuple(value.shape)
        return (shape, value.dtype, (0,) * len(shape), shape, None, value) if rank == 0 else None
    if layout.partial_axes:
        raise ValueError(
            f"save_checkpoint: tensors[{name!r}] is Partial over {layout.partial_axes}; redistribute it to "
            "Replicate or Shard before saving"
        )
    coord = layout.mesh.coord
    replicated_axes = [a for a, p in zip(layout.mesh.axis_names, layout.placements) if not isinstance(p, Shard)]
    if any(coord[axis] != 0 for axis in replicated_axes) or value.numel() == 0:
        return None  # the lowest rank holding this piece writes it
    shape = tuple(layout.global_shape)
    return shape, value.dtype, layout.local_offsets(), tuple(layout.local_shape()), None, value


def _write_file(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors file and flush it to disk."""
    save_file(tensors, path)
    fsync_path(path)


def _write_rank(directory: str, tensors: Mapping[str, torch.Tensor | FlatShard], rank: int) -> list[tuple]:
    """Write this rank's pieces; return ``(name, global shape, dtype name, piece json)`` for each."""
    file = rank_file_name(rank)
    records, data = [], {}
    for name, value in tensors.items():
        owned = _owned_piece(name, value, rank)
        if owned is None:
            continue
        shape, dtype, offsets, rect, flat_range, local = owned
        local = local.detach().to("cpu", copy=False).contiguous()
        data[name] = local
        piece = Piece(
            file=file,
            key=name,
            offsets=tuple(offsets),
            shape=tuple(rect),
            flat_range=flat_range,
            crc32=tensor_crc32(local),
        )
        records.append((name, tuple(shape), dtype_name(dtype), piece.to_json()))
    if data:
        _write_file(os.path.join(directory, file), data)
    return records


def _build_index(gathered: list, metadata: dict) -> CheckpointIndex:
    """Merge every rank's records into the index, checking that ranks agree and that each tensor is covered."""
    shapes: dict[str, tuple] = {}
    pieces: dict[str, list[Piece]] = {}
    for rank, records in enumerate(gathered):
        for name, shape, dtype, piece in records:
            if shapes.setdefault(name, (shape, dtype)) != (shape, dtype):
                raise CheckpointError(
                    f"tensor {name!r}: rank {rank} saves shape {shape} {dtype} but another rank saves "
                    f"{shapes[name][0]} {shapes[name][1]}"
                )
            pieces.setdefault(name, []).append(Piece.from_json(piece, where=f"rank {rank}"))
    index = CheckpointIndex(metadata=metadata)
    for name, (shape, dtype) in shapes.items():
        stored = sum(piece.numel for piece in pieces[name])
        if stored != math.prod(shape):
            raise CheckpointError(
                f"tensor {name!r}: the ranks save {stored} elements of a tensor of shape {shape} "
                f"({math.prod(shape)} elements); some flat shards overlap or are missing"
            )
        entry = TensorEntry(shape=shape, dtype=getattr(torch, dtype), pieces=tuple(pieces[name]))
        index.tensors[name] = entry
    return index


def _commit(tmp: str, path: str, index: CheckpointIndex) -> None:
    """Write the index into ``tmp``, flush it, and rename ``tmp`` to ``path`` (the commit point)."""
    index_path = os.path.join(tmp, INDEX_FILE)
    with open(index_path, "w", encoding="utf-8") as file:
        file.write(index.to_json())
        file.flush()
        os.fsync(file.fileno())
    fsync_path(tmp)
    os.rename(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def save_checkpoint(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor | FlatShard],
    *,
    metadata: dict | None = None,
    group=None,
) -> None:
    """Save a sharded state to the checkpoint directory ``path``; every rank of ``group`` calls it.

    Each rank writes the pieces it owns to ``rank-NNNNN.safetensors``: a tensor with a colo layout is saved as
    its local shard (replicated axes written once, by the rank at coordinate 0 of each), a plain tensor as a
    whole by group rank 0, a `FlatShard` as a flat range. Rank 0 gathers the piece lists and writes
    ``index.json``. Everything goes to ``path.tmp-<id>`` first, is fsynced, and is committed by one rename, so a
    failed save leaves an older checkpoint at another path (and ``path`` itself) untouched.

    Args:
        path: the checkpoint directory to create; it must not exist yet.
        tensors: name -> local tensor (with or without a layout) or `FlatShard`. Names are the model's
            unfused parameter names, e.g. ``"model.layers.0.mlp.up_proj.weight"``.
        metadata: JSON-serialisable state stored in the index (step, config, scheduler state). Default ``{}``.
        group: the group that saves together (a `colo.comm.Group`); default the world. Without
            ``torch.distributed`` initialised, the process saves alone.

    Raises:
        CheckpointError: a rank failed to write (the error names the rank), or ranks disagree on a tensor.
        FileExistsError: ``path`` already exists.
    """
    path = os.fspath(path).rstrip("/")
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as error:
        raise TypeError(f"save_checkpoint: metadata must be JSON-serialisable (no pickle): {error}") from None
    distributed = dist.is_available() and dist.is_initialized()
    group = as_group(group) if distributed else None
    rank = group.rank if group is not None else 0

    tmp = None
    if rank == 0:
        if os.path.exists(path):
            tmp = FileExistsError(f"save_checkpoint: {path} already exists; save each checkpoint to a new path")
        else:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            os.makedirs(tmp)
    if group is not None:
        tmp = broadcast_object(tmp, src=0, group=group)
    if isinstance(tmp, Exception):
        raise tmp

    try:
        records, failure = _write_rank(tmp, tensors, rank), None
    except Exception as error:  # reported to rank 0, so every rank fails together instead of hanging
        records, failure = [], f"rank {rank}: {type(error).__name__}: {error}"
    gathered = gather_object((records, failure), dst=0, group=group) if group is not None else [(records, failure)]

    outcome = None
    if rank == 0:
        failures = [f for _, f in gathered if f is not None]
        try:
            if failures:
                raise CheckpointError(f"save_checkpoint({path}) failed; nothing was committed: " + "; ".join(failures))
            _commit(tmp, path, _build_index([r for r, _ in gathered], metadata))
        except Exception as error:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = error if isinstance(error, CheckpointError) else CheckpointError(f"{path}: {error!r}")
    if group is not None:
        outcome = broadcast_object(None if outcome is None else str(outcome), src=0, group=group)
        outcome = None if outcome is None else CheckpointError(outcome)
    if outcome is not None:
        raise outcome
