"""`Layout`: where a tensor's pieces live on a mesh (one placement per axis), and `distribute` to create one.

A distributed tensor in colo is a plain ``torch.Tensor`` holding this rank's local piece, with its `Layout`
attached (`layout_of`). The global tensor is recovered by concatenating the pieces along sharded dimensions
and reducing them over partial axes.

Shards of one tensor dimension over several axes nest, outer axis first (as DTensor's ``Shard`` does): with
``placements=(Shard(0), Shard(0))`` on ``Mesh(dp=2, tp=2)``, dimension 0 is chunked over ``dp`` and each dp
chunk is chunked again over ``tp``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from colo.comm import Mesh

from .placement import Partial, Placement, Replicate, Shard, check_placement, chunk_range, chunk_sizes

# Layouts live beside their tensors, keyed by identity (tensors compare elementwise, so a plain
# WeakKeyDictionary cannot hold them): pickling, deep-copying or saving a tensor never touches its mesh's
# process groups, and an entry goes when its tensor does.
_layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()

PlacementsLike = Sequence[Placement] | Mapping[str, Placement]
"""Placements as a sequence (one per mesh axis, outermost first) or a mapping ``axis -> placement`` (others
`Replicate`)."""


class Layout:
    """A tensor's layout on a mesh: one placement per axis and the global shape.

    Args:
        mesh: the `colo.comm.Mesh` the tensor lives on.
        placements: one placement per mesh axis, outermost first, or a mapping from axis name to placement in
            which missing axes are `Replicate`.
        global_shape: the shape of the whole (unsharded, reduced) tensor.

    Example::

        layout = Layout(mesh, {"tp": Shard(0)}, (10, 4))   # Mesh(dp=2, tp=4)
        layout.local_shape()                               # (3, 4) on tp ranks 0-2, (1, 4) on tp rank 3
    """

    __slots__ = ("_mesh", "_placements", "_global_shape")

    def __init__(self, mesh: Mesh, placements: PlacementsLike, global_shape: Sequence[int]):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Layout(mesh=...) must be a colo.comm.Mesh, not {type(mesh).__name__}")
        self._mesh = mesh
        self._global_shape = torch.Size(int(extent) for extent in global_shape)
        self._placements = self._normalize(placements)

    def _normalize(self, placements: PlacementsLike) -> tuple[Placement, ...]:
        names = self._mesh.axis_names
        if isinstance(placements, Mapping):
            unknown = [axis for axis in placements if axis not in names]
            if unknown:
                raise ValueError(f"placements name axis {unknown[0]!r}, which is not an axis of the mesh {names}")
            placements = [placements.get(axis, Replicate()) for axis in names]
        elif isinstance(placements, (Shard, Replicate, Partial)):
            raise TypeError(f"placements must be a sequence or mapping of placements, e.g. [{placements!r}]")
        placements = list(placements)
        if len(placements) != len(names):
            raise ValueError(
                f"placements {placements} give {len(placements)} placements for a mesh with {len(names)} axes "
                f"{names}; give one per axis, or a mapping such as {{{names[-1]!r}: Shard(0)}}"
            )
        ndim = len(self._global_shape)
        normalized: list[Placement] = []
        for axis, placement in zip(names, placements):
            check_placement(placement, f"the placement of axis {axis!r}")
            if isinstance(placement, Shard):
                if not -ndim <= placement.dim < ndim:
                    raise ValueError(
                        f"axis {axis!r} has {placement!r} but the tensor has {ndim} dimensions "
                        f"(shape {tuple(self._global_shape)}); shard a dimension in [0, {ndim})"
                    )
                placement = Shard(placement.dim % ndim)
            normalized.append(placement)
        return tuple(normalized)

    # --- properties ------------------------------------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The mesh."""
        return self._mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis, outermost first."""
        return self._placements

    @property
    def global_shape(self) -> torch.Size:
        """The shape of the whole tensor."""
        return self._global_shape

    def placement(self, axis: str) -> Placement:
        """The placement on mesh axis ``axis``."""
        if axis not in self._mesh.axis_names:
            raise ValueError(f"unknown mesh axis {axis!r}; the mesh has axes {self._mesh.axis_names}")
        return self._placements[self._mesh.axis_names.index(axis)]

    @property
    def partial_axes(self) -> tuple[str, ...]:
        """The axes over which the local values are partial."""
        return tuple(a for a, p in zip(self._mesh.axis_names, self._placements) if isinstance(p, Partial))

    @property
    def is_replicated(self) -> bool:
        """Whether every rank holds the whole tensor."""
        return all(isinstance(p, Replicate) for p in self._placements)

    def with_placements(self, placements: PlacementsLike) -> Layout:
        """The same mesh and global shape with other placements."""
        return Layout(self._mesh, placements, self._global_shape)

    # --- geometry --------------------------------------------------------------------------------------------

    def _coord(self, coord: Mapping[str, int] | None) -> Mapping[str, int]:
        return self._mesh.coord if coord is None else coord

    def shard_ranges(self, coord: Mapping[str, int] | None = None) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` of the local piece along every tensor dimension, at ``coord`` (default: this rank)."""
        coord = self._coord(coord)
        ranges = [(0, extent) for extent in self._global_shape]
        for axis, placement in zip(self._mesh.axis_names, self._placements):
            if isinstance(placement, Shard):
                offset, size = ranges[placement.dim]
                inner_offset, inner_size = chunk_range(size, self._mesh.size(axis), coord[axis])
                ranges[placement.dim] = (offset + inner_offset, inner_size)
        return tuple(ranges)

    def local_shape(self, coord: Mapping[str, int] | None = None) -> torch.Size:
        """The shape of the local piece at ``coord`` (default: this rank)."""
        return torch.Size(size for _, size in self.shard_ranges(coord))

    def local_offsets(self, coord: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """Where the local piece at ``coord`` (default: this rank) starts in the global tensor, per dimension."""
        return tuple(offset for offset, _ in self.shard_ranges(coord))

    def local_numel(self, coord: Mapping[str, int] | None = None) -> int:
        """Number of elements of the local piece at ``coord`` (default: this rank)."""
        return math.prod(self.local_shape(coord))

    def split_sizes(self, axis: str, coord: Mapping[str, int] | None = None) -> list[int]:
        """Extents along the dimension sharded by ``axis`` of the pieces of this rank's ``axis`` group.

        These are the chunks of what the outer axes left of that dimension; shards by inner axes on the same
        dimension are not applied (a redistribution gathers those first).
        """
        placement = self.placement(axis)
        if not isinstance(placement, Shard):
            raise ValueError(f"axis {axis!r} is {placement!r}, not a Shard; it splits no dimension")
        return chunk_sizes(self.parent_extent(axis, coord), self._mesh.size(axis))

    def parent_extent(self, axis: str, coord: Mapping[str, int] | None = None) -> int:
        """The extent of the dimension ``axis`` shards, after the chunking by the axes outside ``axis`` only."""
        coord = self._coord(coord)
        placement = self.placement(axis)
        if not isinstance(placement, Shard):
            raise ValueError(f"axis {axis!r} is {placement!r}, not a Shard; it splits no dimension")
        extent = self._global_shape[placement.dim]
        for outer in self._mesh.axis_names[: self._mesh.axis_names.index(axis)]:
            if self.placement(outer) == placement:
                extent = chunk_range(extent, self._mesh.size(outer), coord[outer])[1]
        return extent

    def local_slice(self, full: torch.Tensor, coord: Mapping[str, int] | None = None) -> torch.Tensor:
        """The view of ``full`` (a tensor of the global shape) this layout puts at ``coord`` (partial axes ignored)."""
        if full.shape != self._global_shape:
            raise ValueError(
                f"local_slice: the tensor has shape {tuple(full.shape)} but the layout's global shape is "
                f"{tuple(self._global_shape)}"
            )
        piece = full
        for dim, (offset, size) in enumerate(self.shard_ranges(coord)):
            if (offset, size) != (0, full.shape[dim]):
                piece = piece.narrow(dim, offset, size)
        return piece

    # --- identity --------------------------------------------------------------------------------------------

    def _key(self) -> tuple:
        mesh = self._mesh
        return (mesh.axis_names, tuple(mesh.shape.values()), mesh.ranks, self._placements, self._global_shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        placements = ", ".join(f"{a}={p!r}" for a, p in zip(self._mesh.axis_names, self._placements))
        return f"Layout({placements}; global_shape={tuple(self._global_shape)})"


def layout_of(tensor: torch.Tensor) -> Layout | None:
    """The `Layout` attached to ``tensor`` by `distribute`, `redistribute` or a parallel layer; ``None`` if none.

    The layout belongs to this tensor object: a copy, a detached view or the result of an operation has none.
    """
    return _layouts.get(tensor)


def set_layout(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Attach ``layout`` to ``tensor`` (this rank's local piece) and return ``tensor``.

    Raises:
        ValueError: the tensor's shape is not the layout's local shape on this rank.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"set_layout: layout must be a Layout, not {type(layout).__name__}")
    expected = layout.local_shape()
    if tensor.shape != expected:
        raise ValueError(
            f"set_layout: the local tensor has shape {tuple(tensor.shape)} but {layout} puts a piece of shape "
            f"{tuple(expected)} on this rank ({layout.mesh.coord})"
        )
    _layouts[tensor] = layout
    return tensor


def require_layout(tensor: torch.Tensor, where: str) -> Layout:
    """The layout of ``tensor``, or a `ValueError` telling the caller of ``where`` how to give it one."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, not {type(tensor).__name__}")
    layout = layout_of(tensor)
    if layout is None:
        raise ValueError(
            f"{where}: the tensor (shape {tuple(tensor.shape)}) has no layout; create it with "
            "distribute(tensor, mesh, placements) or attach one with set_layout(tensor, Layout(...))"
        )
    if tensor.shape != layout.local_shape():
        raise ValueError(
            f"{where}: the tensor has shape {tuple(tensor.shape)} but its layout {layout} expects a local piece of "
            f"shape {tuple(layout.local_shape())}; was it modified out of place after the layout was attached?"
        )
    return layout


def partial_identity(layout: Layout, axis: str, like: torch.Tensor) -> torch.Tensor:
    """``like`` turned into this rank's share of a value that ``Partial`` on ``axis`` reduces back to ``like``.

    For ``sum`` the rank at coordinate 0 of ``axis`` keeps the value and the others hold zeros (exact, unlike
    dividing by the axis size); for ``avg`` and ``max`` every rank keeps the value.
    """
    placement = layout.placement(axis)
    assert isinstance(placement, Partial)
    if placement.reduce == "sum" and layout.mesh.coord[axis] != 0:
        return torch.zeros_like(like)
    return like


def distribute(tensor: torch.Tensor, mesh: Mesh, placements: PlacementsLike) -> torch.Tensor:
    """This rank's piece of ``tensor`` under ``placements``, with its layout attached. No communication.

    Every rank passes the same full tensor. A sharded axis keeps this rank's ``torch.chunk`` piece; a
    ``Partial("sum")`` axis keeps the value at coordinate 0 and zeros elsewhere, so the sum over the axis is the
    value exactly; ``Partial("avg")`` and ``Partial("max")`` keep the value on every rank.

    Args:
        tensor: the full tensor, identical on every rank.
        mesh: the mesh to lay it out on.
        placements: one placement per mesh axis (outermost first), or a mapping ``axis -> placement``.

    Returns:
        The local piece (a new contiguous tensor) with `layout_of` giving its layout.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute: tensor must be a torch.Tensor, not {type(tensor).__name__}")
    layout = Layout(mesh, placements, tensor.shape)
    averaged = Partial("avg") in layout.placements
    if averaged and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"distribute: Partial('avg') needs a floating-point tensor, got {tensor.dtype}; use 'sum'")
    local = layout.local_slice(tensor).clone(memory_format=torch.contiguous_format)
    for axis in layout.partial_axes:
        local = partial_identity(layout, axis, local)
    return set_layout(local, layout)
