"""Replicated model and optimizer state (DDP, ZeRO stage 0 outside colo.zero) through the common checkpoint format.

Parameters are saved under their model names, the optimizer's per-element states as ``optim/<name>/<state>``
(the same names colo.zero uses, so a DDP checkpoint loads under ZeRO and back), scalars (AdamW's ``step``) and
param-group hyperparameters in the JSON metadata. Tensors with a colo layout are saved as their shards.
"""

from __future__ import annotations

import torch

from colo.tensor import layout_of, set_layout
from colo.tensor.checkpoint import CheckpointError, load_checkpoint, read_index

OPTIM_PREFIX = "optim/"
METADATA_KEY = "optimizer"


def _json_safe(value):
    return list(value) if isinstance(value, tuple) else value


def _with_layout_of(param: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``state`` carrying ``param``'s colo layout (a tensor-parallel shard's state is a shard of the same tensor)."""
    layout = layout_of(param)
    if layout is not None and layout_of(state) is None:
        set_layout(state, layout)
    return state


def _parts(name: str, param: torch.Tensor, checkpoint_names) -> list[tuple[str, slice | None]]:
    """``(checkpoint name, rows of the parameter or None for all)`` under which ``param`` is saved."""
    parts = checkpoint_names(name, param) if checkpoint_names is not None else None
    if not parts:
        return [(name, None)]
    if layout_of(param) is not None and len(parts) > 1:
        raise ValueError(f"checkpoint_names splits {name!r} by rows, but it is a tensor-parallel shard")
    return [(part, slice(first, first + rows) if len(parts) > 1 else None) for part, first, rows in parts]


def replicated_state(
    named_params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, *, checkpoint_names=None
) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, metadata)`` for `save_checkpoint` from unsharded parameters and their torch optimizer.

    ``checkpoint_names`` (as `colo.zero.ZeroOptimizer` takes it) saves a parameter under other names, split by rows.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for name, param in named_params.items():
        saved_rows: set[tuple[int, int]] = set()
        for part, rows in _parts(name, param, checkpoint_names):
            # rows saved under several names (LoRA's A shared by q, k and v) are copied for the later names: a
            # safetensors file holds no aliases
            row_range = (rows.start, rows.stop) if rows is not None else None
            copy = (lambda t: t.clone()) if row_range in saved_rows else (lambda t: t)
            saved_rows.add(row_range)
            tensors[part] = param if rows is None else copy(param.detach()[rows])
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                    tensors[f"{OPTIM_PREFIX}{part}/{key}"] = (
                        _with_layout_of(param, value) if rows is None else copy(value[rows])
                    )
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    scalars.setdefault(part, {})[key] = [value.item(), str(value.dtype).removeprefix("torch.")]
                elif isinstance(value, (int, float, bool)):
                    scalars.setdefault(part, {})[key] = [value, None]
                else:
                    raise TypeError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}; not savable")
    groups = [{k: _json_safe(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    metadata = {METADATA_KEY: {"type": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}}
    return tensors, metadata


@torch.no_grad()
def load_replicated_state(
    path: str, named_params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, *, checkpoint_names=None
) -> dict:
    """Fill parameters and optimizer state from a checkpoint (any layout it was saved with); returns metadata."""
    index = read_index(path)
    saved = index.metadata.get(METADATA_KEY)
    if saved is None or saved["type"] != type(optimizer).__name__:
        found = None if saved is None else saved["type"]
        raise CheckpointError(
            f"{path}: holds optimizer state of {found}, not of {type(optimizer).__name__}; load it with the plugin "
            "and optimizer it was saved with"
        )
    targets = {}
    for name, param in named_params.items():
        state = optimizer.state[param]
        for part, rows in _parts(name, param, checkpoint_names):
            targets[part] = param if rows is None else param.data[rows]
            prefix = f"{OPTIM_PREFIX}{part}/"
            for key in [n[len(prefix) :] for n in index.tensors if n.startswith(prefix)]:
                if not (isinstance(state.get(key), torch.Tensor) and state[key].shape == param.shape):
                    state[key] = torch.zeros_like(param)
                targets[prefix + key] = _with_layout_of(param, state[key]) if rows is None else state[key][rows]
            for key, (value, dtype) in saved["scalars"].get(part, {}).items():
                state[key] = value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))
    metadata, _ = load_checkpoint(path, targets, strict=True)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path}: {len(saved['param_groups'])} optimizer param groups saved, {len(optimizer.param_groups)} now; "
            "build the optimizer with the same groups"
        )
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for key, value in saved_group.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    return metadata
