"""Running one `RedistributeStep` on a local piece (the planner in `redistribute` decides which)."""

from __future__ import annotations

import torch

from colo.comm import all_gather, all_reduce, all_to_all, reduce_scatter

from .layout import partial_identity
from .placement import Partial, Shard, chunk_range, chunk_size
from .redistribute_plan import RedistributeStep


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns its memory (a slice must not keep the full tensor alive)."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _empty_result(step: RedistributeStep, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(step.after.local_shape())


def run_step(step: RedistributeStep, local: torch.Tensor) -> torch.Tensor:
    """Apply ``step`` to this rank's piece ``local``; return the piece under ``step.after``."""
    axis = step.axis
    mesh = step.before.mesh
    n, me = mesh.size(axis), mesh.coord[axis]
    if step.kind == "local":
        return local  # an axis of size 1: the piece is the whole, whatever the placement says
    if step.kind == "slice":
        offset, size = chunk_range(local.shape[step.dst.dim], n, me)
        return _own(local.narrow(step.dst.dim, offset, size))
    if step.kind == "to_partial":
        return _to_partial(step, local, n, me)
    if step.collective is None:
        return _empty_result(step, local)  # every piece in the group is empty: nothing to exchange
    group = mesh.group(axis)
    if step.kind == "all_gather":
        sizes = step.before.split_sizes(axis)
        return all_gather(local.contiguous(), group=group, dim=step.src.dim, sizes=sizes)
    if step.kind == "all_reduce":
        return all_reduce(_own(local), step.src.reduce, group=group)
    if step.kind == "all_reduce_slice":
        reduced = all_reduce(_own(local), step.src.reduce, group=group)
        offset, size = chunk_range(local.shape[step.dst.dim], n, me)
        return _own(reduced.narrow(step.dst.dim, offset, size))
    if step.kind == "reduce_scatter":
        return _reduce_scatter(step, local, group, n, me)
    if step.kind == "all_to_all":
        return _all_to_all(step, local, group, n, me)
    raise AssertionError(f"unknown step kind {step.kind!r}")


def _to_partial(step: RedistributeStep, local: torch.Tensor, n: int, me: int) -> torch.Tensor:
    if not isinstance(step.src, Shard):
        return _own(partial_identity(step.after, step.axis, local))
    # Shard(d) -> Partial: the piece in place, the rest filled with the reduction's identity.
    dim = step.src.dim
    assert isinstance(step.dst, Partial) and step.dst.reduce in ("sum", "max")
    shape = step.after.local_shape()
    if step.dst.reduce == "sum":
        full = local.new_zeros(shape)
    elif local.is_floating_point():
        full = local.new_full(shape, float("-inf"))
    else:
        full = local.new_full(shape, torch.iinfo(local.dtype).min)
    offset, size = chunk_range(shape[dim], n, me)
    full.narrow(dim, offset, size).copy_(local)
    return full


def _reduce_scatter(step: RedistributeStep, local: torch.Tensor, group, n: int, me: int) -> torch.Tensor:
    dim = step.dst.dim
    extent = local.shape[dim]
    padded = n * chunk_size(extent, n)
    source = local
    if padded != extent:
        pad_shape = list(local.shape)
        pad_shape[dim] = padded - extent
        source = torch.cat([local, local.new_zeros(pad_shape)], dim=dim)  # padding lands beyond every real chunk
    part = reduce_scatter(source.contiguous(), step.src.reduce, group=group, dim=dim)
    size = chunk_range(extent, n, me)[1]
    return (part if size == part.shape[dim] else part.narrow(dim, 0, size)).contiguous()


def _all_to_all(step: RedistributeStep, local: torch.Tensor, group, n: int, me: int) -> torch.Tensor:
    """Shard(d) -> Shard(e) on one axis: block k of dimension e goes to rank k, which concatenates along d."""
    old_dim, new_dim = step.src.dim, step.dst.dim
    old_sizes = step.before.split_sizes(step.axis)  # every rank's extent along d
    new_sizes = step.after.split_sizes(step.axis)  # the chunks of dimension e
    blocks, offset = [], 0
    for size in new_sizes:
        blocks.append(local.narrow(new_dim, offset, size).reshape(-1))
        offset += size
    send = torch.cat(blocks)
    received_shape = list(local.shape)
    received_shape[new_dim] = new_sizes[me]
    rest = 1
    for i, extent in enumerate(local.shape):
        if i not in (old_dim, new_dim):
            rest *= extent
    output_splits = [old_sizes[k] * new_sizes[me] * rest for k in range(n)]
    received = all_to_all(
        send, group=group, input_split_sizes=[b.numel() for b in blocks], output_split_sizes=output_splits
    )
    pieces = []
    for k, flat in enumerate(received.split(output_splits)):
        received_shape[old_dim] = old_sizes[k]
        pieces.append(flat.view(received_shape))
    return torch.cat(pieces, dim=old_dim)
