"""Collectives of picklable Python objects, for metadata (shapes, dtypes, configs), never for bulk data.

On a group of one rank they return the object itself (in a list where the collective returns one) without a backend
call, as the tensor collectives do (see `colo.comm.collectives`).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from .collectives import _check_group_rank, _member_group, _on_one_rank
from .group import Group
from .handle import translate_errors
from .tracker import record, tracking


def _pickled_size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def broadcast_object(obj: Any, *, src: int, group: Group | dist.ProcessGroup | None = None) -> Any:
    """Return group rank ``src``'s ``obj`` on every rank of the group (other ranks' ``obj`` is ignored)."""
    group = _member_group(group, "broadcast_object")
    _check_group_rank("broadcast_object", "src", src, group)
    if group.size == 1:
        return _on_one_rank("broadcast_object", group, "object", obj)
    box = [obj if group.rank == src else None]
    with translate_errors("broadcast_object", group):
        dist.broadcast_object_list(box, src=group.global_rank(src), group=group.process_group)
    if tracking():  # pickling again only to count bytes: skip it when nobody records them
        size = _pickled_size(box[0])
        record("broadcast_object", group.name, group.size, "object", size, size, "native")
    return box[0]


def all_gather_object(obj: Any, *, group: Group | dist.ProcessGroup | None = None) -> list[Any]:
    """Return every rank's ``obj``, in group-rank order, on every rank of the group."""
    group = _member_group(group, "all_gather_object")
    if group.size == 1:
        return _on_one_rank("all_gather_object", group, "object", [obj])
    gathered: list[Any] = [None] * group.size
    with translate_errors("all_gather_object", group):
        dist.all_gather_object(gathered, obj, group=group.process_group)
    if tracking():
        size = sum(_pickled_size(item) for i, item in enumerate(gathered) if i != group.rank)
        record("all_gather_object", group.name, group.size, "object", size, size, "native")
    return gathered


def gather_object(obj: Any, *, dst: int, group: Group | dist.ProcessGroup | None = None) -> list[Any] | None:
    """Collect every rank's ``obj`` on group rank ``dst`` (a list in group-rank order); other ranks get ``None``."""
    group = _member_group(group, "gather_object")
    _check_group_rank("gather_object", "dst", dst, group)
    if group.size == 1:
        return _on_one_rank("gather_object", group, "object", [obj])
    is_dst = group.rank == dst
    gathered: list[Any] | None = [None] * group.size if is_dst else None
    with translate_errors("gather_object", group):
        dist.gather_object(obj, gathered, dst=group.global_rank(dst), group=group.process_group)
    if tracking():
        size = _pickled_size(obj)
        record("gather_object", group.name, group.size, "object", size, size, "native")
    return gathered
