"""Autograd communication steps: one small ``torch.autograd.Function`` per pair of forward / backward collectives.

These are the communication steps tensor- and sequence-parallel layers are built from (Megatron-LM's ``f``
and ``g`` are `copy_all_reduce` and `all_reduce_copy`). Each takes its `colo.comm.Group` explicitly
(``mesh.group("tp")``), so the `CommTracker` accounts the traffic to that axis, and each names its forward
and its backward collective in its docstring; the backward is the adjoint of the forward.

Splits follow ``torch.chunk`` semantics (trailing ranks may hold less); collectives that reduce or exchange
equal parts (reduce-scatter, all-to-all) need the dimension to divide by the group size.
"""

from __future__ import annotations

import math

import torch

from colo.comm import Group, all_gather, all_reduce, all_to_all, reduce_scatter

from .placement import chunk_range, chunk_sizes


def _check_group(group: object, where: str) -> Group:
    if not isinstance(group, Group):
        raise TypeError(f"{where}: group must be a colo.comm.Group, e.g. mesh.group('tp'), not {type(group).__name__}")
    return group


def _check_divisible(x: torch.Tensor, dim: int, group: Group, where: str) -> None:
    if x.shape[dim] % group.size:
        raise ValueError(
            f"{where}: dim {dim} of shape {tuple(x.shape)} has extent {x.shape[dim]}, which does not divide by the "
            f"{group.name!r} group size {group.size}; pad that dimension to a multiple of {group.size}"
        )


def _all_reduced(x: torch.Tensor, group: Group) -> torch.Tensor:
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group=group)


def _own_chunk(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    offset, size = chunk_range(x.shape[dim], group.size, group.rank)
    return x.narrow(dim, offset, size).contiguous()


def _gather_chunks(x: torch.Tensor, dim: int, group: Group, sizes: list[int]) -> torch.Tensor:
    inner = math.prod(x.shape[:dim]) * math.prod(x.shape[dim + 1 :])  # no generator: dynamo traces this backward
    if sum(sizes) * inner == 0:  # nothing to exchange (every rank knows it): skip the collective
        return x.new_zeros(x.shape[:dim] + (sum(sizes),) + x.shape[dim + 1 :])
    return all_gather(x.contiguous(), group=group, dim=dim, sizes=sizes)


class CopyAllReduce(torch.autograd.Function):
    """Forward: identity (each rank keeps its copy). Backward: all-reduce (sum) of the gradient over the group.

    Used where a replicated activation enters a sharded region (before a column-parallel linear).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduced(grad, ctx.group), None


class AllReduceCopy(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group. Backward: identity (each rank keeps its gradient).

    Used where partial sums leave a sharded region (after a row-parallel linear).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class SplitAllGather(torch.autograd.Function):
    """Forward: split (keep this rank's ``torch.chunk`` piece along ``dim``; no communication).
    Backward: all-gather of the gradient pieces along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes = group, dim, chunk_sizes(x.shape[dim], group.size)
        return _own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_chunks(grad, ctx.dim, ctx.group, ctx.sizes), None, None


class AllGatherSplit(torch.autograd.Function):
    """Forward: all-gather of the pieces along ``dim``. Backward: split (keep this rank's piece of the gradient;
    no communication)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _gather_chunks(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        offset = sum(ctx.sizes[: ctx.group.rank])
        return grad.narrow(ctx.dim, offset, ctx.sizes[ctx.group.rank]).contiguous(), None, None, None


class AllGatherReduceScatter(torch.autograd.Function):
    """Forward: all-gather of equal pieces along ``dim``. Backward: reduce-scatter (sum) of the gradient along
    ``dim``.

    Used where a sequence-sharded activation enters a tensor-parallel region (Megatron sequence parallelism).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather(x.contiguous(), group=group, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter(grad.contiguous(), group=ctx.group, dim=ctx.dim).contiguous(), None, None


class ReduceScatterAllGather(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along ``dim``. Backward: all-gather of the gradient pieces along ``dim``.

    Used where partial sums leave a tensor-parallel region into a sequence-sharded one.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x.contiguous(), group=group, dim=dim).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad.contiguous(), group=ctx.group, dim=ctx.dim), None, None


def _all_to_all_dims(x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Part ``k`` of ``scatter_dim`` goes to rank ``k``; the parts received are concatenated along ``gather_dim``."""
    n = group.size
    parts = torch.stack(x.chunk(n, dim=scatter_dim))  # (n, ...): row k is sent to rank k
    received = all_to_all(parts.contiguous(), group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAllResplit(torch.autograd.Function):
    """Forward: all-to-all that moves the split from ``gather_dim`` to ``scatter_dim``. Backward: the inverse
    all-to-all (``scatter_dim`` and ``gather_dim`` swapped).

    Used by Ulysses sequence parallelism to trade a sequence split for a head split and back.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all_dims(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all_dims(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


# --- functional entry points -----------------------------------------------------------------------------------


def _dim(x: torch.Tensor, dim: int, where: str) -> int:
    if not -x.dim() <= dim < x.dim() or x.dim() == 0:
        raise ValueError(f"{where}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def copy_all_reduce(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient in backward (`CopyAllReduce`)."""
    return CopyAllReduce.apply(x, _check_group(group, "copy_all_reduce"))


def all_reduce_copy(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (`AllReduceCopy`)."""
    return AllReduceCopy.apply(x, _check_group(group, "all_reduce_copy"))


def split_all_gather(x: torch.Tensor, *, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's ``torch.chunk`` piece of ``x`` along ``dim``; all-gather in backward (`SplitAllGather`)."""
    group = _check_group(group, "split_all_gather")
    return SplitAllGather.apply(x, group, _dim(x, dim, "split_all_gather"))


def all_gather_split(x: torch.Tensor, *, group: Group, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather the pieces along ``dim``; keep this rank's piece of the gradient in backward (`AllGatherSplit`).

    Args:
        x: this rank's piece.
        group: the group to gather over.
        dim: the dimension to concatenate along.
        sizes: every rank's extent along ``dim`` when they differ; ``None``: all equal to this rank's.
    """
    group = _check_group(group, "all_gather_split")
    dim = _dim(x, dim, "all_gather_split")
    sizes = [x.shape[dim]] * group.size if sizes is None else [int(s) for s in sizes]
    if len(sizes) != group.size or sizes[group.rank] != x.shape[dim]:
        raise ValueError(
            f"all_gather_split: sizes={sizes} must give {group.size} extents with this rank's ({x.shape[dim]}) at "
            f"position {group.rank}"
        )
    return AllGatherSplit.apply(x, group, dim, sizes)


def all_gather_reduce_scatter(x: torch.Tensor, *, group: Group, dim: int = 0) -> torch.Tensor:
    """All-gather equal pieces along ``dim``; reduce-scatter the gradient in backward (`AllGatherReduceScatter`)."""
    group = _check_group(group, "all_gather_reduce_scatter")
    return AllGatherReduceScatter.apply(x, group, _dim(x, dim, "all_gather_reduce_scatter"))


def reduce_scatter_all_gather(x: torch.Tensor, *, group: Group, dim: int = 0) -> torch.Tensor:
    """Reduce-scatter (sum) along ``dim``; all-gather the gradient in backward (`ReduceScatterAllGather`).

    Raises:
        ValueError: the extent of ``dim`` does not divide by the group size.
    """
    group = _check_group(group, "reduce_scatter_all_gather")
    dim = _dim(x, dim, "reduce_scatter_all_gather")
    _check_divisible(x, dim, group, "reduce_scatter_all_gather")
    return ReduceScatterAllGather.apply(x, group, dim)


def all_to_all_resplit(x: torch.Tensor, *, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim``, send part ``k`` to rank ``k`` and concatenate what arrives along
    ``gather_dim``; the backward is the inverse all-to-all (`AllToAllResplit`).

    Raises:
        ValueError: the extent of ``scatter_dim`` does not divide by the group size, or the dims are equal.
    """
    group = _check_group(group, "all_to_all_resplit")
    scatter_dim = _dim(x, scatter_dim, "all_to_all_resplit")
    gather_dim = _dim(x, gather_dim, "all_to_all_resplit")
    if scatter_dim == gather_dim:
        raise ValueError(f"all_to_all_resplit: scatter_dim and gather_dim are both {scatter_dim}; they must differ")
    _check_divisible(x, scatter_dim, group, "all_to_all_resplit")
    return AllToAllResplit.apply(x, group, scatter_dim, gather_dim)
