"""ZeRO state through the common checkpoint format (`colo.tensor.checkpoint`), loadable at any data-parallel size.

Every parameter is saved under its model name as the flat range of it that this rank's chunk shard holds (a
`FlatShard` piece): the fp32 master for trainable parameters (with mixed precision the masters, not the bf16
compute copies, are the weights), the compute copy for frozen ones. Optimizer state tensors the size of the
master are saved the same way as ``optim/<name>/<state>`` (``optim/layers.0.w.weight/exp_avg``); optimizer
scalars (AdamW's ``step``), the param groups' hyperparameters and the loss scaler go into the JSON metadata.
Nothing is pickled.

Loading reads, on each rank, only the flat ranges its own chunks hold, so a run saved at dp=4 loads at dp=2
(or one process) and the other way round, whatever the chunk sizes. A same-layout load restores every byte
of masters and optimizer state, so resuming reproduces the uninterrupted run bit for bit in fp32.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from colo.comm import all_gather
from colo.tensor.checkpoint import (
    CheckpointError,
    FlatShard,
    load_checkpoint,
    read_index,
    save_checkpoint,
)

from .chunk import Chunk, ParamSlot

if TYPE_CHECKING:
    from .zero_optimizer import ZeroOptimizer

OPTIM_PREFIX = "optim/"
OPTIMIZER_KEY = "optimizer"
"""The metadata key of the optimizer's type, param groups and scalars (shared with unsharded checkpoints, so a
DDP checkpoint loads under ZeRO and back)."""
METADATA_KEY = "zero"
"""The metadata key of ZeRO's own state (stage, loss scaler)."""


def _slot_range(chunk: Chunk, slot: ParamSlot) -> tuple[int, int, int] | None:
    """``(start, end, flat_start)``: the part of ``slot`` inside this rank's shard, in shard coordinates, and
    where it starts in the parameter's own flattening; ``None`` when the shard holds none of it."""
    begin = max(slot.offset, chunk.shard_offset)
    end = min(slot.offset + slot.numel, chunk.shard_offset + chunk.shard_numel)
    if begin >= end:
        return None
    return begin - chunk.shard_offset, end - chunk.shard_offset, begin - slot.offset


def _placement_of(zero: ZeroOptimizer, slot: ParamSlot) -> dict:
    """Where the parameter of ``slot`` lies in the global tensor: ``global_shape``, ``rect_offsets`` /
    ``rect_shape`` (its tensor-parallel shard, from its colo layout) and ``replica`` (another tensor-parallel rank
    holds the same elements and writes them: `ZeroOptimizer.is_tensor_parallel_replica`), as `FlatShard` keyword
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


def checkpoint_names_of(zero: ZeroOptimizer, slot: ParamSlot) -> list[str]:
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


def _named_pieces(zero: ZeroOptimizer, chunk: Chunk, slot: ParamSlot) -> list[tuple[str, int, int, dict]]:
    """`flat_pieces` of ``slot`` with ``zero``'s names and the parameter's tensor-parallel placement."""
    return flat_pieces(chunk, slot, checkpoint_names=zero.checkpoint_names, placement=_placement_of(zero, slot))


def _value_shard(zero: ZeroOptimizer, chunk: Chunk) -> torch.Tensor:
    """This rank's shard of the tensor saved as the chunk's weights: the fp32 master, or the frozen compute copy."""
    if chunk.trainable:
        return chunk.buffer("master")
    if chunk.has_buffer("param_shard"):
        return chunk.buffer("param_shard")
    return chunk.shard_of(chunk.buffer("param"))


def _optimizer_tensors(zero: ZeroOptimizer, chunk: Chunk) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """The chunk master's optimizer state split into per-element tensors and JSON scalars ``[value, dtype]``."""
    tensors, scalars = {}, {}
    master = chunk.buffer("master")
    for key, value in zero.optimizer.state.get(master, {}).items():
        if isinstance(value, torch.Tensor) and value.shape == master.shape:
            tensors[key] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[key] = [value.item(), str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, (int, float, bool)):
            scalars[key] = [value, None]
        else:
            raise TypeError(
                f"optimizer state {key!r} of {type(zero.optimizer).__name__} is a {type(value).__name__}; ZeRO "
                "checkpoints hold per-element tensors and scalars only"
            )
    return tensors, scalars


def _json_safe(value):
    return list(value) if isinstance(value, tuple) else value


def checkpoint_state(zero: ZeroOptimizer) -> tuple[dict[str, FlatShard], dict]:
    """The tensors and the JSON metadata to pass to `save_checkpoint` (no collective, no copy).

    Returns:
        ``(tensors, metadata)``: name -> `FlatShard` of this rank's part of every parameter and optimizer
        state, and ``{"optimizer": {type, param_groups, scalars}, "zero": {stage, loss_scaler}}``.
    """
    zero.wait_params()
    tensors: dict[str, FlatShard] = {}
    scalars: dict[str, dict] = {}
    for chunk in zero.chunks:
        value = _value_shard(zero, chunk)
        states, chunk_scalars = _optimizer_tensors(zero, chunk) if chunk.trainable else ({}, {})
        for slot in chunk.slots:
            if chunk_scalars:
                for name in checkpoint_names_of(zero, slot):
                    scalars[name] = chunk_scalars
            saved_ranges: set[tuple[int, int]] = set()
            for name, start, end, fields in _named_pieces(zero, chunk, slot):
                # a range saved under several names (LoRA's A shared by q, k and v) is copied for the later names:
                # a safetensors file holds no aliases
                copy = (lambda t: t.clone()) if (start, end) in saved_ranges else (lambda t: t)
                saved_ranges.add((start, end))
                tensors[name] = FlatShard(copy(value[start:end]), **fields)
                for key, state in states.items():
                    tensors[f"{OPTIM_PREFIX}{name}/{key}"] = FlatShard(copy(state[start:end]), **fields)
    groups = [
        {key: _json_safe(value) for key, value in group.items() if key != "params"}
        for group in zero.optimizer.param_groups
    ]
    scaler = zero.loss_scaler
    metadata = {
        OPTIMIZER_KEY: {"type": type(zero.optimizer).__name__, "param_groups": groups, "scalars": scalars},
        METADATA_KEY: {
            "stage": zero.config.stage,
            "loss_scaler": None
            if scaler is None
            else {"scale": scaler.scale, "clean_steps": scaler.clean_steps, "num_skipped": scaler.num_skipped},
        },
    }
    return tensors, metadata


def save_state(zero: ZeroOptimizer, path: str | os.PathLike, *, metadata: dict | None = None, group=None) -> None:
    """Save ``zero``'s parameters and optimizer state to the checkpoint directory ``path`` (every rank calls it).

    Args:
        zero: the optimizer to save.
        path: a new checkpoint directory.
        metadata: more JSON-serialisable state to store (step, data position, RNG ...).
        group: the ranks saving together; default the world (every rank's pieces go into one checkpoint).
    """
    tensors, own = checkpoint_state(zero)
    save_checkpoint(path, tensors, metadata={**(metadata or {}), **own}, group=group)


def _restore_scalars(zero: ZeroOptimizer, chunk: Chunk, saved: dict) -> None:
    if not chunk.trainable:
        return
    first = checkpoint_names_of(zero, chunk.slots[0])[0]
    if first not in saved:
        return
    state = zero.optimizer.state[chunk.buffer("master")]
    for key, (value, dtype) in saved[first].items():
        if dtype is None:
            state[key] = value
        else:
            state[key] = torch.tensor(value, dtype=getattr(torch, dtype), device=chunk.buffer("master").device)


def _restore_param_groups(zero: ZeroOptimizer, groups: list[dict], where: str) -> None:
    if len(groups) != len(zero.optimizer.param_groups):
        raise CheckpointError(
            f"{where}: the checkpoint has {len(groups)} optimizer param groups, this optimizer "
            f"{len(zero.optimizer.param_groups)}; build the optimizer with the same param groups"
        )
    for group, saved in zip(zero.optimizer.param_groups, groups):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


@torch.no_grad()
def load_state(zero: ZeroOptimizer, path: str | os.PathLike) -> dict:
    """Load parameters and optimizer state saved by `save_state` (at any data-parallel size) into ``zero``.

    Every rank reads only the flat ranges its chunk shards hold; the compute copies are then rebuilt from the
    loaded masters (an all-gather per chunk at stages 1/2), which have landed when it returns: the model's
    parameters hold the loaded values. Call it on every rank, before or between steps.

    Returns:
        The checkpoint's metadata (including what was passed to `save_state`).

    Raises:
        CheckpointError: a parameter or state is missing or mismatched, or the optimizer differs.
    """
    zero.wait_params()
    directory = os.fspath(path)
    index = read_index(directory)
    saved = index.metadata.get(OPTIMIZER_KEY)
    if saved is None:
        raise CheckpointError(f"{directory}: no optimizer metadata ({OPTIMIZER_KEY!r}); it holds no training state")
    if saved["type"] != type(zero.optimizer).__name__:
        raise CheckpointError(
            f"{directory}: saved with a {saved['type']} optimizer, loading into {type(zero.optimizer).__name__}"
        )
    zero_state = index.metadata.get(METADATA_KEY) or {}
    _check_same_parameters(zero, index.tensors, directory)
    targets: dict[str, FlatShard] = {}
    for chunk in zero.chunks:
        value = _value_shard(zero, chunk)
        if chunk.trainable:
            master = chunk.buffer("master")
            state = zero.optimizer.state.setdefault(master, {})
            names = {name for slot in chunk.slots for name in checkpoint_names_of(zero, slot)}
            keys = sorted(
                {
                    name.rsplit("/", 1)[1]
                    for name in index.tensors
                    if _parameter_of(name) in names and name != _parameter_of(name)
                }
            )
            for key in keys:
                if not (isinstance(state.get(key), torch.Tensor) and state[key].shape == master.shape):
                    state[key] = torch.zeros_like(master)
        for slot in chunk.slots:
            for name, start, end, fields in _named_pieces(zero, chunk, slot):
                targets[name] = FlatShard(value[start:end], **fields)
                if not chunk.trainable:
                    continue
                for key, state_tensor in zero.optimizer.state[chunk.buffer("master")].items():
                    if isinstance(state_tensor, torch.Tensor) and state_tensor.shape == value.shape:
                        targets[f"{OPTIM_PREFIX}{name}/{key}"] = FlatShard(state_tensor[start:end], **fields)
    metadata, _ = load_checkpoint(directory, targets, strict=False)
    for chunk in zero.chunks:
        _restore_scalars(zero, chunk, saved["scalars"])
    _restore_param_groups(zero, saved["param_groups"], directory)
    if zero.loss_scaler is not None and zero_state.get("loss_scaler") is not None:
        for key, value in zero_state["loss_scaler"].items():
            setattr(zero.loss_scaler, key, value)
    zero._register_optimizer_state()
    _rebuild_compute_copies(zero)
    zero.wait_params()  # the compute copies' all-gather (overlapped after a step) must land before load returns
    return metadata


def _check_same_parameters(zero: ZeroOptimizer, names, where: str) -> None:
    """The checkpoint must hold exactly the model's parameters (optimizer states may be absent: before step 1)."""
    model_names = {name for chunk in zero.chunks for slot in chunk.slots for name in checkpoint_names_of(zero, slot)}
    saved = {_parameter_of(name) for name in names}
    unexpected, missing = sorted(saved - model_names), sorted(model_names - saved)
    if unexpected or missing:
        raise CheckpointError(
            f"{where}: the checkpoint does not match the model: unexpected {unexpected[:3]} ({len(unexpected)}), "
            f"missing {missing[:3]} ({len(missing)}); load it into the model it was saved from"
        )


def _parameter_of(name: str) -> str:
    """The parameter a checkpoint tensor belongs to (``optim/<name>/<state>`` -> ``<name>``)."""
    return name.removeprefix(OPTIM_PREFIX).rsplit("/", 1)[0] if name.startswith(OPTIM_PREFIX) else name


def _rebuild_compute_copies(zero: ZeroOptimizer) -> None:
    """Refresh the compute copies from the loaded shards (frozen chunks at stages 1/2 are gathered too)."""
    zero._refresh_params()
    if zero.config.stage == 3:
        return
    for chunk in zero.chunks:
        if not chunk.trainable:
            param = chunk.buffer("param")
            param.copy_(all_gather(chunk.shard_of(param).clone(), group=zero.group))
