"""Gemini checkpoints in colo's common sharded format (`colo.tensor.checkpoint`), interchangeable with colo.zero's.

Every rank saves, for each parameter, the flat range of it that lies in its chunk shards, as a `FlatShard`:
the fp32 master under the parameter's name (frozen parameters: their compute copy), and Adam's moments under
``optim/<name>/exp_avg`` and ``optim/<name>/exp_avg_sq``. Wherever the state lives (device, host, disk) it is
read through the optimizer, so the files do not depend on the placement; loading assembles each rank's ranges
from whatever pieces overlap them, so a checkpoint saved on N ranks with one placement loads on M ranks with
another. The metadata follows `colo.zero.state`: ``"optimizer"`` holds the optimizer's type, its param groups
and per-parameter scalars (Adam's ``step``), so a ZeRO checkpoint loads into Gemini and the other way round;
``"gemini"`` holds the loss scaler.
"""

from __future__ import annotations

import os

import torch

from colo.tensor.checkpoint import CheckpointError, FlatShard, load_checkpoint, read_index, save_checkpoint
from colo.zero.state import flat_pieces, slot_checkpoint_names

from .optimizer import STATE_NAMES

OPTIMIZER_KEY = "optimizer"
"""Metadata key shared with colo.zero: optimizer type, param groups, scalars per parameter name."""
METADATA_KEY = "gemini"
"""Metadata key of Gemini's own state (the loss scaler)."""


def _pieces(gemini, chunk, buffers: dict[str, torch.Tensor]) -> dict[str, FlatShard]:
    """Name -> `FlatShard` of this rank's part of ``chunk``'s weights (``buffers["master"]``) and optimizer states,
    under the checkpoint names (`colo.zero.state.flat_pieces`, as ZeRO names them)."""
    result = {}
    saved_ranges: set[tuple[int, int]] = set()
    for slot in chunk.slots:
        placement = {"global_shape": tuple(slot.shape), "replica": False}
        for name, start, end, fields in flat_pieces(
            chunk, slot, checkpoint_names=gemini.checkpoint_names, placement=placement
        ):
            # a range saved under several names (LoRA's A shared by q, k and v) is copied for the later names: a
            # safetensors file holds no aliases
            copy = (lambda t: t.clone()) if (start, end) in saved_ranges else (lambda t: t)
            saved_ranges.add((start, end))
            result[name] = FlatShard(copy(buffers["master"][start:end]), **fields)
            for state in STATE_NAMES:
                if state in buffers:
                    result[f"optim/{name}/{state}"] = FlatShard(copy(buffers[state][start:end]), **fields)
    return result


def _json_safe(value):
    return list(value) if isinstance(value, tuple) else value


def save_gemini(gemini, path: str | os.PathLike, *, metadata: dict | None = None, expected_names=None) -> None:
    """Save ``gemini``'s masters, moments and frozen weights to the checkpoint directory ``path`` (a collective).

    Args:
        gemini: a `GeminiOptimizer`.
        path: a new directory (committed by a rename once every rank has written).
        metadata: JSON-serialisable user state (step, data position) stored beside Gemini's own.
        expected_names: tensors the checkpoint must hold besides this rank's (`save_checkpoint`'s).
    """
    tensors: dict[str, FlatShard] = {}
    scalars: dict[str, dict] = {}
    for chunk in gemini.chunks:
        if chunk.trainable:
            buffers = {name: t.detach().to("cpu") for name, t in gemini.hybrid.read(chunk).items()}
            step = float(gemini.hybrid.states[chunk.index].step.item())
            for slot in chunk.slots:
                for name in slot_checkpoint_names(slot, gemini.checkpoint_names):
                    scalars[name] = {"step": [step, "float32"]}
        else:
            buffers = {"master": gemini.manager.read_params(chunk)}
        tensors.update(_pieces(gemini, chunk, buffers))
    groups = [
        {key: _json_safe(value) for key, value in group.items() if key != "params"}
        for group in gemini.optimizer.param_groups
    ]
    scaler = gemini.loss_scaler
    own = {
        OPTIMIZER_KEY: {"type": type(gemini.optimizer).__name__, "param_groups": groups, "scalars": scalars},
        METADATA_KEY: {
            "loss_scaler": None
            if scaler is None
            else {"scale": scaler.scale, "clean_steps": scaler.clean_steps, "num_skipped": scaler.num_skipped}
        },
    }
    save_checkpoint(
        path, tensors, metadata={**(metadata or {}), **own}, group=gemini.group, expected_names=expected_names
    )


@torch.no_grad()
def load_gemini(gemini, path: str | os.PathLike) -> dict:
    """Fill ``gemini``'s masters, moments, step counts and frozen weights from ``path``; refresh the compute copies.

    Accepts checkpoints of `GeminiOptimizer` and of colo.zero's `ZeroOptimizer` (any data-parallel size, any
    placement). A checkpoint written before the first optimizer step, without moments, loads them as zeros.

    Returns:
        The metadata saved with the checkpoint.

    Raises:
        CheckpointError: a parameter is missing or mismatched, or the optimizer type differs.
    """
    directory = os.fspath(path)
    index = read_index(directory)
    saved = index.metadata.get(OPTIMIZER_KEY)
    if saved is None:
        raise CheckpointError(f"{directory}: no optimizer metadata ({OPTIMIZER_KEY!r}); it holds no training state")
    if saved["type"] != type(gemini.optimizer).__name__:
        raise CheckpointError(
            f"{directory}: saved with a {saved['type']} optimizer, loading into {type(gemini.optimizer).__name__}"
        )
    if len(saved["param_groups"]) != len(gemini.optimizer.param_groups):
        raise CheckpointError(
            f"{directory}: the checkpoint has {len(saved['param_groups'])} optimizer param groups, this optimizer "
            f"{len(gemini.optimizer.param_groups)}; build the optimizer with the same param groups"
        )
    model_names = {
        name
        for chunk in gemini.chunks
        for slot in chunk.slots
        for name in slot_checkpoint_names(slot, gemini.checkpoint_names)
    }
    stored = {name for name in index.tensors if not name.startswith("optim/")}
    if stored != model_names:
        raise CheckpointError(
            f"{directory}: the checkpoint does not match the model: unexpected {sorted(stored - model_names)[:3]}, "
            f"missing {sorted(model_names - stored)[:3]}; load it into the model it was saved from"
        )
    targets: dict[str, FlatShard] = {}
    staged = {}
    for chunk in gemini.chunks:
        if chunk.trainable:
            buffers = {name: torch.zeros(chunk.shard_numel, dtype=torch.float32) for name in ("master", *STATE_NAMES)}
        else:
            buffers = {"master": torch.zeros(chunk.shard_numel, dtype=gemini.manager.dtype_of(chunk))}
        staged[chunk.index] = buffers
        pieces = _pieces(gemini, chunk, buffers)
        targets.update({name: piece for name, piece in pieces.items() if name in index.tensors})
    metadata, _ = load_checkpoint(directory, targets, strict=False)
    for group, saved_group in zip(gemini.optimizer.param_groups, saved["param_groups"]):
        for key, value in saved_group.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    gemini.manager.release_all()
    for chunk in gemini.chunks:
        buffers = staged[chunk.index]
        if chunk.trainable:
            first = slot_checkpoint_names(chunk.slots[0], gemini.checkpoint_names)[0]
            step = saved["scalars"].get(first, {}).get("step", [0.0, None])[0]
            gemini.hybrid.load(chunk, buffers, step=int(step))
        gemini.manager.write_params(chunk, buffers["master"].to(gemini.manager.dtype_of(chunk)), "host")
    scaler = (metadata.get(METADATA_KEY) or {}).get("loss_scaler") or (metadata.get("zero") or {}).get("loss_scaler")
    if gemini.loss_scaler is not None and scaler is not None:
        for key, value in scaler.items():
            setattr(gemini.loss_scaler, key, value)
    return metadata
