"""Converting an activation between layouts on one mesh axis, each conversion one autograd communication step.

Activation layouts on the tensor-parallel axis, and the step that converts them (`convert_activation`):

==========================  ==============================  =================================
from -> to                  forward / backward              step
==========================  ==============================  =================================
Replicate -> Shard(d)       split / all-gather              `split_all_gather`
Shard(d) -> Replicate       all-gather / split              `all_gather_split`
Partial -> Replicate        all-reduce / identity           `all_reduce_copy`
Partial -> Shard(d)         reduce-scatter / all-gather     `reduce_scatter_all_gather`
Shard(d) -> Shard(e)        all-to-all / all-to-all         `all_to_all_resplit`
==========================  ==============================  =================================

A replicated activation's gradient is taken to be replicated too. With ``partial_grad=True`` it is partial
instead (the module consumes the replicated input in a sharded way, so each rank holds a part of its
gradient): Replicate -> Replicate is then identity / all-reduce (`copy_all_reduce`) and Shard(d) -> Replicate
is all-gather / reduce-scatter (`all_gather_reduce_scatter`, Megatron sequence parallelism's entry step).
"""

from __future__ import annotations

import torch

from colo.comm import Group

from .comm_ops import (
    all_gather_reduce_scatter,
    all_gather_split,
    all_reduce_copy,
    all_to_all_resplit,
    copy_all_reduce,
    reduce_scatter_all_gather,
    split_all_gather,
)
from .placement import Partial, Placement, Replicate, Shard, check_placement


def check_conversion(src: Placement, dst: Placement, partial_grad: bool, where: str) -> None:
    """Raise a `ValueError` naming ``where`` unless `convert_activation` supports ``src -> dst``."""
    check_placement(src, f"{where}: the input layout")
    check_placement(dst, f"{where}: the desired layout")
    for placement in (src, dst):
        if isinstance(placement, Partial) and placement.reduce != "sum":
            raise ValueError(f"{where}: activations may be Partial('sum') only, not {placement!r}")
    if isinstance(dst, Partial):
        raise ValueError(f"{where}: cannot convert {src!r} to {dst!r}; a module's inputs are Replicate() or Shard(d)")
    if partial_grad and not (isinstance(dst, Replicate) and isinstance(src, (Replicate, Shard))):
        raise ValueError(
            f"{where}: partial_grad=True applies to Replicate() or Shard(d) -> Replicate() only, not {src!r} -> {dst!r}"
        )


def convert_activation(
    x: torch.Tensor, src: Placement, dst: Placement, *, group: Group, partial_grad: bool = False
) -> torch.Tensor:
    """Convert an activation between layouts on one axis with the matching autograd step (module table).

    Shards are even (``torch.chunk`` pieces of equal size), as activations split by heads, features or
    sequence are.

    Args:
        x: this rank's piece under ``src``.
        src: its layout: ``Replicate()``, ``Shard(d)`` or ``Partial()``.
        dst: the wanted layout: ``Replicate()`` or ``Shard(d)``.
        group: the axis group, e.g. ``mesh.group("tp")``.
        partial_grad: the gradient arriving at a replicated result is partial (see the module docstring).

    Returns:
        This rank's piece under ``dst``.
    """
    check_conversion(src, dst, partial_grad, "convert_activation")
    if isinstance(src, Shard):
        src = Shard(src.dim % x.dim())
    if isinstance(dst, Shard):
        dst = Shard(dst.dim % x.dim())
    if isinstance(src, Replicate):
        if isinstance(dst, Shard):
            return split_all_gather(x, group=group, dim=dst.dim)
        return copy_all_reduce(x, group=group) if partial_grad else x
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return reduce_scatter_all_gather(x, group=group, dim=dst.dim)
        return all_reduce_copy(x, group=group)
    if isinstance(dst, Replicate):
        if partial_grad:
            return all_gather_reduce_scatter(x, group=group, dim=src.dim)
        return all_gather_split(x, group=group, dim=src.dim)
    if dst.dim == src.dim:
        return x
    return all_to_all_resplit(x, group=group, scatter_dim=dst.dim, gather_dim=src.dim)
