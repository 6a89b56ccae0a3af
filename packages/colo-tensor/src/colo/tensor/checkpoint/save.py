"""`save_checkpoint`: every rank writes the pieces it owns; rank 0 writes the index and commits by one rename.

A save has three phases, shared by the foreground `save_checkpoint` and the background `AsyncCheckpointer`:

1. `begin_save` (collective): rank 0 checks the path, creates ``path.tmp-<id>`` and takes its lock (held until the
   save has committed or failed, so `remove_partial_saves` never deletes a live save), every rank learns its name;
2. `owned_pieces` + `write_pieces` (local): this rank's pieces and their CRCs (whole and per block), written to its
   safetensors file;
3. `finish_save` (collective): rank 0 gathers every rank's piece list (or failure), writes the index and renames
   the temporary directory into place; every rank learns the outcome and raises the same error on failure.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from colo.comm import Group, as_group, broadcast_object, gather_object

from ..layout import layout_of
from ..placement import Shard
from .files import BLOCK_BYTES, fsync_path, rank_file_name, tensor_checksums
from .index import INDEX_FILE, CheckpointError, CheckpointIndex, Piece, TensorEntry, dtype_name
from .partial_saves import SaveLock, create_save_directory, release_committed
from .regions import FlatShard


@dataclass(frozen=True)
class OwnedPiece:
    """A piece this rank writes: where it sits in tensor ``name`` and the data to write."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat_range: tuple[int, int] | None
    data: torch.Tensor


def _owned_piece(name: str, value: torch.Tensor | FlatShard, rank: int) -> OwnedPiece | None:
    """The piece this rank writes for ``name`` (``data`` is still the caller's tensor), or ``None``."""
    if isinstance(value, FlatShard):
        if value.tensor.numel() == 0 or value.replica:
            return None
        flat_range = (value.flat_start, value.flat_end)
        return OwnedPiece(name, value.global_shape, value.rect_offsets, value.rect_shape, flat_range, value.tensor)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"save_checkpoint: tensors[{name!r}] must be a torch.Tensor or FlatShard, not {type(value)}")
    layout = layout_of(value)
    if layout is None:  # a plain tensor: replicated over the group, written by rank 0
        shape = tuple(value.shape)
        return OwnedPiece(name, shape, (0,) * len(shape), shape, None, value) if rank == 0 else None
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
    return OwnedPiece(name, shape, tuple(layout.local_offsets()), tuple(layout.local_shape()), None, value)


def declared_tensors(tensors: Mapping[str, torch.Tensor | FlatShard]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (global shape, dtype name)`` of every tensor this rank holds, whether or not it writes a piece of
    it: the tensors the checkpoint must hold (a replica another rank should write included)."""
    declared = {}
    for name, value in tensors.items():
        if isinstance(value, FlatShard):
            shape, dtype = value.global_shape, value.tensor.dtype
        elif isinstance(value, torch.Tensor):
            layout = layout_of(value)
            shape, dtype = (value.shape if layout is None else layout.global_shape), value.dtype
        else:
            continue  # reported by `owned_pieces`
        declared[name] = (tuple(int(x) for x in shape), dtype_name(dtype))
    return declared


def check_expected_names(expected_names) -> list[str]:
    """``expected_names`` of `save_checkpoint` as a sorted list of strings."""
    if expected_names is None:
        return []
    if isinstance(expected_names, str) or not all(isinstance(name, str) for name in expected_names):
        raise TypeError(f"save_checkpoint: expected_names must be an iterable of tensor names, not {expected_names!r}")
    return sorted(expected_names)


def owned_pieces(
    tensors: Mapping[str, torch.Tensor | FlatShard],
    rank: int,
    *,
    copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> list[OwnedPiece]:
    """The pieces this rank writes, their data made CPU-contiguous (by ``copy(name, tensor)`` when given).

    Args:
        tensors: what the caller passed to save.
        rank: this rank's rank in the saving group.
        copy: makes the data to write from a caller's tensor; default: the tensor itself when it already is a
            contiguous CPU tensor (the foreground save), else a contiguous CPU copy.
    """
    pieces = []
    for name, value in tensors.items():
        piece = _owned_piece(name, value, rank)
        if piece is None:
            continue
        data = piece.data.detach()
        data = copy(name, data) if copy is not None else data.to("cpu", copy=False).contiguous()
        pieces.append(OwnedPiece(piece.name, piece.global_shape, piece.offsets, piece.shape, piece.flat_range, data))
    return pieces


def _write_file(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors file and flush it to disk."""
    save_file(tensors, path)
    fsync_path(path)


def write_pieces(directory: str, pieces: list[OwnedPiece], rank: int) -> list[tuple]:
    """Write ``pieces`` to this rank's file in ``directory``; return ``(name, global shape, dtype name, piece json)``
    for each. The only place checkpoint tensor data is written (foreground and background saves alike)."""
    file = rank_file_name(rank)
    records, data = [], {}
    for owned in pieces:
        data[owned.name] = owned.data
        crc32, block_crc32 = tensor_checksums(owned.data, BLOCK_BYTES)
        piece = Piece(
            file=file,
            key=owned.name,
            offsets=owned.offsets,
            shape=owned.shape,
            flat_range=owned.flat_range,
            crc32=crc32,
            block_bytes=BLOCK_BYTES,
            block_crc32=block_crc32,
        )
        records.append((owned.name, owned.global_shape, dtype_name(owned.data.dtype), piece.to_json()))
    if data:
        _write_file(os.path.join(directory, file), data)
    return records


def _build_index(gathered: list, metadata: dict, declared: list[dict], expected_names: list[str]) -> CheckpointIndex:
    """Merge every rank's records into the index, checking that ranks agree, that each tensor is covered, and that
    every tensor a rank holds (``declared``, per rank) or the saver named (``expected_names``) was written."""
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
    holders: dict[str, list[int]] = {}
    for rank, held in enumerate(declared):
        for name, (shape, dtype) in held.items():
            holders.setdefault(name, []).append(rank)
            if name in shapes and (tuple(shapes[name][0]), shapes[name][1]) != (tuple(shape), dtype):
                raise CheckpointError(
                    f"tensor {name!r}: rank {rank} holds shape {shape} {dtype} but the ranks save "
                    f"{shapes[name][0]} {shapes[name][1]}"
                )
    unwritten = sorted(name for name in holders if name not in shapes)
    if unwritten:
        shown = ", ".join(f"{name!r} (held by ranks {holders[name]})" for name in unwritten[:6])
        raise CheckpointError(
            f"{len(unwritten)} tensors are held by some rank but no rank wrote a piece of them: {shown}"
            f"{' ...' if len(unwritten) > 6 else ''}; each holder took another rank for its writer (a replica rule "
            "that does not match the layout)"
        )
    unknown = [name for name in expected_names if name not in shapes]
    if unknown:
        raise CheckpointError(
            f"the saver expects {len(unknown)} tensors that no rank holds: {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}; part of the model is missing from every rank"
        )
    index.expected = {name: index.tensors[name].shape for name in [*holders, *expected_names]}
    return index


def _commit(tmp: str, path: str, index: CheckpointIndex, lock: SaveLock | None) -> None:
    """Write the index into ``tmp``, flush it, rename ``tmp`` to ``path`` (the commit point), then drop the lock."""
    index_path = os.path.join(tmp, INDEX_FILE)
    with open(index_path, "w", encoding="utf-8") as file:
        file.write(index.to_json())
        file.flush()
        os.fsync(file.fileno())
    fsync_path(tmp)
    os.rename(tmp, path)
    release_committed(path, lock)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def check_metadata(metadata: dict | None) -> dict:
    """A copy of ``metadata``, or a `TypeError` if it is not JSON-serialisable."""
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as error:
        raise TypeError(f"save_checkpoint: metadata must be JSON-serialisable (no pickle): {error}") from None
    return metadata


def saving_group(group) -> Group | None:
    """The `Group` that saves together, or ``None`` when ``torch.distributed`` is not initialised."""
    return as_group(group) if dist.is_available() and dist.is_initialized() else None


def begin_save(path: str, group: Group | None) -> tuple[str, SaveLock | None]:
    """Phase 1 (collective over ``group``): rank 0 creates the temporary directory and takes its lock; every rank
    returns its path, and rank 0 the `SaveLock` that `finish_save` releases (``None`` on the others).

    Raises:
        FileExistsError: on every rank, when ``path`` already exists.
        OSError: on every rank, when rank 0 cannot create the temporary directory.
    """
    tmp: str | Exception | None = None
    lock = None
    if group is None or group.rank == 0:
        if os.path.exists(path):
            tmp = FileExistsError(f"save_checkpoint: {path} already exists; save each checkpoint to a new path")
        else:
            try:
                tmp, lock = create_save_directory(path)
            except OSError as error:
                tmp = error
    if group is not None:
        tmp = broadcast_object(tmp, src=0, group=group)
    if isinstance(tmp, Exception):
        raise tmp
    return tmp, lock


def failure_message(rank: int, error: BaseException) -> str:
    """How a rank's failure is reported to the others."""
    return f"rank {rank}: {type(error).__name__}: {error}"


def finish_save(
    path: str,
    tmp: str,
    records: list,
    failure: str | None,
    metadata: dict,
    group: Group | None,
    *,
    declared: dict,
    expected_names: list[str],
    lock: SaveLock | None = None,
) -> None:
    """Phase 3 (collective over ``group``): gather the records and what each rank holds (``declared``), commit on
    rank 0, raise the outcome on every rank. Rank 0 releases ``lock`` (from `begin_save`) whatever happens.

    Raises:
        CheckpointError: a rank failed (``failure``), ranks disagree, or the commit failed; nothing was committed
            and the temporary directory is removed.
    """
    rank = group.rank if group is not None else 0
    mine = (records, declared, failure)
    try:
        gathered = gather_object(mine, dst=0, group=group) if group is not None else [mine]
    except BaseException:
        if lock is not None:
            lock.release()  # the directory stays: a partial save that `remove_partial_saves` may now remove
        raise
    outcome = None
    if rank == 0:
        failures = [f for _, _, f in gathered if f is not None]
        try:
            if failures:
                raise CheckpointError(f"save_checkpoint({path}) failed; nothing was committed: " + "; ".join(failures))
            try:
                index = _build_index([r for r, _, _ in gathered], metadata, [d for _, d, _ in gathered], expected_names)
            except CheckpointError as error:
                raise CheckpointError(f"save_checkpoint({path}) failed; nothing was committed: {error}") from None
            _commit(tmp, path, index, lock)
        except Exception as error:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            outcome = error if isinstance(error, CheckpointError) else CheckpointError(f"{path}: {error!r}")
        finally:
            if lock is not None:
                lock.release()
    if group is not None:
        outcome = broadcast_object(None if outcome is None else str(outcome), src=0, group=group)
        outcome = None if outcome is None else CheckpointError(outcome)
    if outcome is not None:
        raise outcome


def save_checkpoint(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor | FlatShard],
    *,
    metadata: dict | None = None,
    group=None,
    expected_names=None,
) -> None:
    """Save a sharded state to the checkpoint directory ``path``; every rank of ``group`` calls it.

    Each rank writes the pieces it owns to ``rank-NNNNN.safetensors``: a tensor with a colo layout is saved as
    its local shard (replicated axes written once, by the rank at coordinate 0 of each), a plain tensor as a
    whole by group rank 0, a `FlatShard` as a flat range. Rank 0 gathers the piece lists and writes
    ``index.json``. Everything goes to ``path.tmp-<id>`` first, is fsynced, and is committed by one rename, so a
    failed save leaves an older checkpoint at another path (and ``path`` itself) untouched; rank 0 holds a lock on
    the temporary directory until then, so `remove_partial_saves` removes what a crashed save left, never a live
    one. To keep training
    while the files are written, use `AsyncCheckpointer` (same files, same index).

    Args:
        path: the checkpoint directory to create; it must not exist yet.
        tensors: name -> local tensor (with or without a layout) or `FlatShard`. Names are the model's
            unfused parameter names, e.g. ``"model.layers.0.mlp.up_proj.weight"``.
        metadata: JSON-serialisable state stored in the index (step, config, scheduler state). Default ``{}``.
        group: the group that saves together (a `colo.comm.Group`); default the world. Without
            ``torch.distributed`` initialised, the process saves alone.
        expected_names: names of tensors the checkpoint must hold besides those the ranks pass (a model's full
            parameter list when each pipeline stage passes only its own), the same on every rank. Default none.

    The index records every tensor some rank passed or ``expected_names`` lists (`CheckpointIndex.expected`);
    the save fails, committing nothing, when any of them has no piece written, and reading an index that lacks
    one fails too.

    Raises:
        CheckpointError: a rank failed to write (the error names the rank), ranks disagree on a tensor, or a
            tensor a rank holds or ``expected_names`` lists was not written.
        FileExistsError: ``path`` already exists.
    """
    path = os.fspath(path).rstrip("/")
    metadata = check_metadata(metadata)
    expected_names = check_expected_names(expected_names)
    group = saving_group(group)
    rank = group.rank if group is not None else 0
    tmp, lock = begin_save(path, group)
    declared: dict = {}
    try:
        declared = declared_tensors(tensors)
        records, failure = write_pieces(tmp, owned_pieces(tensors, rank), rank), None
    except Exception as error:  # reported to rank 0, so every rank fails together instead of hanging
        records, failure = [], failure_message(rank, error)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    finish_save(
        path, tmp, records, failure, metadata, group, declared=declared, expected_names=expected_names, lock=lock
    )
