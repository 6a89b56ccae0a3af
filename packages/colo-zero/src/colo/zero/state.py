"""ZeRO state through the common checkpoint format (`colo.tensor.checkpoint`), loadable at any data-parallel size.

Every parameter is saved under its model name as the flat range of it that this rank's chunk shard holds (a
`FlatShard` piece): the fp32 master for trainable parameters (with mixed precision the masters, not the bf16
compute copies, are the weights), the compute copy for frozen ones. Optimizer state tensors the size of the
master are saved the same way as ``optim/<name>/<state>`` (``optim/layers.0.w.weight/exp_avg``); optimizer
scalars (AdamW's ``step``), the param groups' hyperparameters and the loss scaler go into the JSON metadata.
Nothing is pickled.

The optimizer is read and written only through the public core API (`colo.zero.core.ChunkOptimizer`:
``shard_tensors`` / ``shard_scalars`` / ``load_targets`` / ``finish_load``, ``state_dict`` / ``load_state_dict``),
so the same code saves and loads `ZeroOptimizer` and colo.gemini's `GeminiOptimizer`, whose checkpoints are
interchangeable.

Loading reads, on each rank, only the flat ranges its own chunks hold, so a run saved at dp=4 loads at dp=2
(or one process) and the other way round, whatever the chunk sizes. A same-layout load restores every byte
of masters and optimizer state, so resuming reproduces the uninterrupted run bit for bit in fp32.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from colo.tensor.checkpoint import (
    CheckpointError,
    FlatShard,
    load_checkpoint,
    read_index,
    save_checkpoint,
)

from .chunk import Chunk, ParamSlot

if TYPE_CHECKING:
    from .core import ChunkOptimizer

OPTIM_PREFIX = "optim/"
OPTIMIZER_KEY = "optimizer"
"""The metadata key of the optimizer's type, param groups and scalars (shared with unsharded checkpoints, so a
DDP checkpoint loads under ZeRO and back)."""
METADATA_KEY = "zero"
"""The metadata key of ZeRO's own state (stage, loss scaler); Gemini's is ``"gemini"``
(`ChunkOptimizer.checkpoint_key`)."""
OWN_STATE_KEYS = ("zero", "gemini")
"""Where a chunk optimizer's own state may be found, whichever optimizer saved it."""


def _slot_range(chunk: Chunk, slot: ParamSlot) -> tuple[int, int, int] | None:
    """``(start, end, flat_start)``: the part of ``slot`` inside this rank's shard, in shard coordinates, and
    where it starts in the parameter's own flattening; ``None`` when the shard holds none of it."""
    begin = max(slot.offset, chunk.shard_offset)
    end = min(slot.offset + slot.numel, chunk.shard_offset + chunk.shard_numel)
    if begin >= end:
        return None
    return begin - chunk.shard_offset, end - chunk.shard_offset, begin - slot.offset


def placement_of(zero: ChunkOptimizer, slot: ParamSlot) -> dict:
    """Where the parameter of ``slot`` lies in the global tensor: ``global_shape``, ``rect_offsets`` /
    ``rect_shape`` (its tensor-parallel shard, from its colo layout) and ``replica`` (another tensor-parallel rank
    holds the same elements and writes them: `ChunkOptimizer.is_tensor_parallel_replica`), as `FlatShard` keyword
    arguments."""
    from colo.tensor import layout_of

    layout = layout_of(slot.param)
    replica = zero.is_tensor_parallel_replica(slot.param)
    if layout is None:
        return {"global_shape": tuple(slot.shape), "replica": replica}
    return {
        "global_shape": tuple(layout.global_shape),
        "rect_offsets": tuple(layout.local_offsets()),
        "rect_shape": tuple(layout.local_shape()),
        "replica": replica,
    }


def _parts(checkpoint_names, slot: ParamSlot) -> list[tuple[str, int, int]] | None:
    """The checkpoint names of ``slot``'s parameter as ``(name, first row, rows)`` of its global tensor, from
    ``checkpoint_names``; ``None``: saved under its own name."""
    if checkpoint_names is None:
        return None
    return checkpoint_names(slot.name, slot.param)


def slot_checkpoint_names(slot: ParamSlot, checkpoint_names) -> list[str]:
    """The names ``slot``'s parameter is saved under, given a ``checkpoint_names`` function as `ZeroOptimizer`
    takes it (``None``: its own name)."""
    parts = _parts(checkpoint_names, slot)
    return [slot.name] if not parts else [name for name, _, _ in parts]


def checkpoint_names_of(zero: ChunkOptimizer, slot: ParamSlot) -> list[str]:
    """The names ``slot``'s parameter is saved under."""
    return slot_checkpoint_names(slot, zero.checkpoint_names)


def flat_pieces(
    chunk: Chunk, slot: ParamSlot, *, checkpoint_names, placement: dict
) -> list[tuple[str, int, int, dict]]:
    """What this rank saves (and loads) of ``slot``: ``(checkpoint name, start, end, FlatShard fields)`` with
    ``[start, end)`` in shard coordinates. A parameter the names split by rows (a fused q/k/v weight saved as q,
    k and v) becomes one flat range per part it overlaps. Shared by ZeRO and Gemini checkpoints.

    Args:
        chunk: the chunk holding ``slot``.
        slot: the parameter.
        checkpoint_names: ``fn(name, parameter) -> [(checkpoint name, first row, rows), ...] | None`` or ``None``.
        placement: `FlatShard` fields of the parameter's place in its global tensor: ``global_shape``,
            ``replica`` and, for a tensor-parallel shard, ``rect_offsets`` / ``rect_shape``.
    """
    where = _slot_range(chunk, slot)
    if where is None:
        return []
    start, end, flat_start = where
    parts = _parts(checkpoint_names, slot)
    global_shape = placement["global_shape"]
    if not parts:
        return [(slot.name, start, end, {"flat_start": flat_start, **placement})]
    if len(parts) == 1 and parts[0][1:] == (0, global_shape[0]):  # a rename
        return [(parts[0][0], start, end, {"flat_start": flat_start, **placement})]
    if "rect_shape" in placement:
        raise ValueError(
            f"checkpoint_names splits {slot.name!r} by rows, but it is a tensor-parallel shard; split only whole "
            "parameters (a tensor-parallel plan gives the parts their own parameters)"
        )
    columns = math.prod(global_shape[1:])
    flat_end = flat_start + (end - start)
    pieces = []
    for name, first_row, rows in parts:
        low, high = max(flat_start, first_row * columns), min(flat_end, (first_row + rows) * columns)
        if low < high:
            fields = {
                "flat_start": low - first_row * columns,
                "global_shape": (rows, *global_shape[1:]),
                "replica": placement["replica"],
            }
            pieces.append((name, start + low - flat_start, start + high - flat_start, fields))
    return pieces


def _named_pieces(zero: ChunkOptimizer, chunk: Chunk, slot: ParamSlot) -> list[tuple[str, int, int, dict]]:
    """`flat_pieces` of ``slot`` with ``zero``'s names and the parameter's tensor-parallel placement."""
    return flat_pieces(chunk, slot, checkpoint_names=zero.checkpoint_names, placement=placement_of(zero, slot))


def _chunk_pieces(zero: ChunkOptimizer, chunk: Chunk, tensors: dict[str, torch.Tensor], *, copy_shared: bool):
    """Name -> `FlatShard` of ``tensors`` (``"master"``: the weights, else optimizer states by name) over every
    piece of the chunk's parameters. With ``copy_shared`` a range saved under several names (LoRA's A shared by q,
    k and v) is copied for the later names: a safetensors file holds no aliases."""
    pieces: dict[str, FlatShard] = {}
    for slot in chunk.slots:
        saved_ranges: set[tuple[int, int]] = set()
        for name, start, end, fields in _named_pieces(zero, chunk, slot):
            shared = copy_shared and (start, end) in saved_ranges
            saved_ranges.add((start, end))
            for key, tensor in tensors.items():
                piece = tensor[start:end].clone() if shared else tensor[start:end]
                pieces[name if key == "master" else f"{OPTIM_PREFIX}{name}/{key}"] = FlatShard(piece, **fields)
    return pieces


def checkpoint_state(zero: ChunkOptimizer) -> tuple[dict[str, FlatShard], dict]:
    """The tensors and the JSON metadata to pass to `save_checkpoint` (no collective; no copy where the state is
    in memory).

    Returns:
        ``(tensors, metadata)``: name -> `FlatShard` of this rank's part of every parameter and optimizer
        state, and ``{"optimizer": {type, param_groups, scalars}, <checkpoint_key>: {loss_scaler, ...}}``.
    """
    zero.before_checkpoint()
    tensors: dict[str, FlatShard] = {}
    scalars: dict[str, dict] = {}
    for chunk in zero.chunks:
        chunk_scalars = zero.shard_scalars(chunk) if chunk.trainable else {}
        if chunk_scalars:
            for slot in chunk.slots:
                for name in checkpoint_names_of(zero, slot):
                    scalars[name] = chunk_scalars
        tensors.update(_chunk_pieces(zero, chunk, zero.shard_tensors(chunk), copy_shared=True))
    own = zero.state_dict()
    optimizer = own.pop("optimizer")
    metadata = {OPTIMIZER_KEY: {**optimizer, "scalars": scalars}, zero.checkpoint_key: own}
    return tensors, metadata


def save_state(
    zero: ChunkOptimizer,
    path: str | os.PathLike,
    *,
    metadata: dict | None = None,
    group=None,
    expected_names=None,
) -> None:
    """Save ``zero``'s parameters and optimizer state to the checkpoint directory ``path`` (every rank calls it).

    Args:
        zero: the optimizer to save (a `ZeroOptimizer` or a `GeminiOptimizer`).
        path: a new checkpoint directory.
        metadata: more JSON-serialisable state to store (step, data position, RNG ...).
        group: the ranks saving together; default the world (every rank's pieces go into one checkpoint).
        expected_names: tensors the checkpoint must hold besides this rank's (`save_checkpoint`'s).
    """
    tensors, own = checkpoint_state(zero)
    save_checkpoint(path, tensors, metadata={**(metadata or {}), **own}, group=group, expected_names=expected_names)


@torch.no_grad()
def load_state(zero: ChunkOptimizer, path: str | os.PathLike, *, check_names: bool = True) -> dict:
    """Load parameters and optimizer state saved by `save_state` (at any data-parallel size) into ``zero``.

    Every rank reads only the flat ranges its chunk shards hold; the compute copies are then rebuilt from the
    loaded masters (`ChunkOptimizer.finish_load`: an all-gather per chunk at ZeRO stages 1/2, which has landed
    when it returns): the model's parameters hold the loaded values. Call it on every rank, before or between
    steps. A checkpoint written before the first optimizer step, without optimizer states, loads.

    Args:
        zero: the optimizer to load into.
        path: the checkpoint directory.
        check_names: require the checkpoint to hold exactly ``zero``'s parameters; ``False`` for an optimizer over
            a part of a model (`ExpertParallelZero`'s parts: it checks the whole model's names itself).

    Returns:
        The checkpoint's metadata (including what was passed to `save_state`).

    Raises:
        CheckpointError: a parameter or state is missing or mismatched, or the optimizer differs.
    """
    zero.before_checkpoint()
    directory = os.fspath(path)
    index = read_index(directory)
    saved = index.metadata.get(OPTIMIZER_KEY)
    if saved is None:
        raise CheckpointError(f"{directory}: no optimizer metadata ({OPTIMIZER_KEY!r}); it holds no training state")
    own = {key: index.metadata.get(key) or {} for key in (zero.checkpoint_key, *OWN_STATE_KEYS)}
    scaler = next((state["loss_scaler"] for state in own.values() if state.get("loss_scaler") is not None), None)
    state = {"optimizer": saved, "loss_scaler": scaler}
    try:
        zero.check_state_dict(state, where=directory)
    except ValueError as error:
        raise CheckpointError(str(error)) from error
    if check_names:
        _check_same_parameters(zero, index.tensors, directory)
    targets: dict[str, FlatShard] = {}
    loaded: dict[int, dict[str, torch.Tensor]] = {}
    scalars: dict[int, dict[str, list]] = {}
    for chunk in zero.chunks:
        names = {name for slot in chunk.slots for name in checkpoint_names_of(zero, slot)}
        state_names = sorted(
            {
                name.rsplit("/", 1)[1]
                for name in index.tensors
                if name != parameter_of(name) and parameter_of(name) in names
            }
        )
        loaded[chunk.index] = zero.load_targets(chunk, state_names if chunk.trainable else [])
        pieces = _chunk_pieces(zero, chunk, loaded[chunk.index], copy_shared=False)
        targets.update({name: piece for name, piece in pieces.items() if name in index.tensors})
        if chunk.trainable:
            scalars[chunk.index] = saved["scalars"].get(checkpoint_names_of(zero, chunk.slots[0])[0])
    metadata, _ = load_checkpoint(directory, targets, strict=False)
    zero.load_state_dict(state)
    zero.finish_load(loaded, scalars)
    return metadata


def _check_same_parameters(zero: ChunkOptimizer, names, where: str) -> None:
    """The checkpoint must hold exactly the model's parameters (optimizer states may be absent: before step 1); a
    pipeline stage holds part of the model, so there the stages' parameters together are the model's."""
    model_names = {name for chunk in zero.chunks for slot in chunk.slots for name in checkpoint_names_of(zero, slot)}
    pipeline_axis = getattr(zero.config, "pipeline_axis", None)  # Gemini has none
    if pipeline_axis is not None and zero.mesh.size(pipeline_axis) > 1:
        from colo.comm import all_gather_object

        for stage_names in all_gather_object(sorted(model_names), group=zero.mesh.group(pipeline_axis)):
            model_names.update(stage_names)
    saved = {parameter_of(name) for name in names}
    unexpected, missing = sorted(saved - model_names), sorted(model_names - saved)
    if unexpected or missing:
        raise CheckpointError(
            f"{where}: the checkpoint does not match the model: unexpected {unexpected[:3]} ({len(unexpected)}), "
            f"missing {missing[:3]} ({len(missing)}); load it into the model it was saved from"
        )


def parameter_of(name: str) -> str:
    """The parameter a checkpoint tensor belongs to (``optim/<name>/<state>`` -> ``<name>``)."""
    return name.removeprefix(OPTIM_PREFIX).rsplit("/", 1)[0] if name.startswith(OPTIM_PREFIX) else name
