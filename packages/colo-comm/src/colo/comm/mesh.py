"""`Mesh`: the world's ranks arranged on named axes, with a process group per axis and per fused axes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch.distributed as dist

from .group import Group, _require_initialized, new_group


def _group_name(axes: tuple[str, ...]) -> str:
    return "+".join(axes)


class Mesh:
    """A named-axis device mesh over the world: ``Mesh(pp=2, dp=2, tp=2)``.

    Axes are listed outermost to innermost; the innermost varies fastest across ranks, so ``tp`` groups are
    neighbouring ranks (on one node). Every rank must construct the same mesh at the same point: the constructor
    creates the process group of every single axis (and of each declared fused axis tuple) on every rank,
    because a group first asked for on one pipeline stage would otherwise hang. Fused groups not declared are
    created on first use by their members only (``use_local_synchronization``).

    Args:
        **axis_sizes: axis name to size, outer to inner; the sizes multiply to the world size.
        fused: axis tuples whose fused group to create up front, e.g. ``(("dp", "sp"),)`` for ZeRO over both.
        timeout: seconds before an operation on the mesh's groups fails; default: `init_distributed`'s.

    Example::

        mesh = Mesh(dp=2, tp=2)
        all_reduce(grad, group=mesh.group("dp"))
        mesh.rank("tp"), mesh.size("dp", "tp"), mesh.coord  # {'dp': 1, 'tp': 0}
    """

    def __init__(self, *, fused: Iterable[Iterable[str]] = (), timeout: float | None = None, **axis_sizes: int):
        _require_initialized()
        self._check_sizes(axis_sizes)
        self._names = tuple(axis_sizes)
        self._sizes = tuple(axis_sizes.values())
        self._timeout = timeout
        self._all_ranks = tuple(range(dist.get_world_size()))
        self._groups: dict[tuple[str, ...], Group] = {}
        self._rank_in_world = dist.get_rank()
        for axis in self._names:
            self._create_for_all((axis,))
        for axes in fused:
            self._create_for_all(self._normalize(tuple(axes)))

    @staticmethod
    def _check_sizes(axis_sizes: dict[str, int]) -> None:
        world = dist.get_world_size()
        if not axis_sizes:
            raise ValueError(f"Mesh() needs at least one axis, e.g. Mesh(dp={world})")
        for name, size in axis_sizes.items():
            if not name.isidentifier():
                raise ValueError(f"mesh axis name {name!r} must be an identifier such as 'dp' or 'tp'")
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"mesh axis {name}={size!r} must be an int")
            if size < 1:
                raise ValueError(f"mesh axis {name}={size} must be at least 1")
        total = math.prod(axis_sizes.values())
        if total != world:
            shown = ", ".join(f"{k}={v}" for k, v in axis_sizes.items())
            hint = ""
            if world % total == 0:
                first = next(iter(axis_sizes))
                fixed = dict(axis_sizes, **{first: axis_sizes[first] * world // total})
                hint = f", e.g. Mesh({', '.join(f'{k}={v}' for k, v in fixed.items())})"
            raise ValueError(
                f"Mesh({shown}) has {total} ranks but the world has {world}; "
                f"choose sizes that multiply to {world}{hint}"
            )

    # --- geometry -------------------------------------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, outermost first."""
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        """Axis name to size, outermost first."""
        return dict(zip(self._names, self._sizes))

    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh."""
        return len(self._all_ranks)

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self._rank_in_world

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks of the mesh, in mesh order (row-major over the axes)."""
        return self._all_ranks

    def _index_of(self, global_rank: int) -> int:
        if global_rank not in self._all_ranks:
            raise ValueError(f"rank {global_rank} is not in this mesh, whose ranks are {list(self._all_ranks)}")
        return self._all_ranks.index(global_rank)

    def coord_of(self, global_rank: int) -> dict[str, int]:
        """The coordinates of ``global_rank`` on every axis."""
        index = self._index_of(global_rank)
        coord = {}
        for name, size in zip(reversed(self._names), reversed(self._sizes)):
            coord[name] = index % size
            index //= size
        return {name: coord[name] for name in self._names}

    @property
    def coord(self) -> dict[str, int]:
        """This rank's coordinate on every axis, e.g. ``{"pp": 1, "dp": 0, "tp": 1}``."""
        return self.coord_of(self._rank_in_world)

    def rank_of(self, coord: dict[str, int]) -> int:
        """The global rank at ``coord`` (every axis given)."""
        missing = set(self._names) - set(coord)
        extra = set(coord) - set(self._names)
        if missing or extra:
            raise ValueError(f"rank_of needs a coordinate on exactly the axes {self._names}; got {sorted(coord)}")
        index = 0
        for name, size in zip(self._names, self._sizes):
            if not 0 <= coord[name] < size:
                raise ValueError(f"coordinate {name}={coord[name]} is outside [0, {size})")
            index = index * size + coord[name]
        return self._all_ranks[index]

    def _normalize(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        if not axes:
            raise ValueError(f"name at least one axis; this mesh has axes {self._names}")
        unknown = [a for a in axes if a not in self._names]
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown[0]!r}; this mesh has axes {self._names}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes {axes} name an axis twice")
        return tuple(a for a in self._names if a in axes)

    def _members(self, axes: tuple[str, ...], coord: dict[str, int]) -> tuple[int, ...]:
        """Global ranks sharing ``coord`` off ``axes``, ordered row-major over ``axes``."""
        ranges = [range(self.shape[a]) for a in axes]
        members = []
        for values in itertools.product(*ranges):
            point = dict(coord, **dict(zip(axes, values)))
            members.append(self.rank_of(point))
        return tuple(members)

    def ranks_along(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group along ``axes`` (fused when several), in group-rank order."""
        return list(self._members(self._normalize(axes), self.coord))

    def size(self, *axes: str) -> int:
        """Size of one axis, or the product over several (the fused group's size); all axes when none given."""
        if not axes:
            return self.world_size
        return math.prod([self.shape[a] for a in self._normalize(axes)])  # a list: dynamo traces it

    def rank(self, *axes: str) -> int:
        """This rank's index within its group along ``axes`` (row-major over them when several)."""
        axes = self._normalize(axes)
        coord = self.coord
        index = 0
        for axis in axes:
            index = index * self.shape[axis] + coord[axis]
        return index

    # --- groups ---------------------------------------------------------------------------------------------

    def _create_for_all(self, axes: tuple[str, ...]) -> None:
        """Every rank creates every group along ``axes`` (torch requires all ranks to enter each new_group)."""
        if axes in self._groups:
            return
        others = [a for a in self._names if a not in axes]
        mine = None
        for values in itertools.product(*(range(self.shape[a]) for a in others)):
            base = dict(zip(others, values), **{a: 0 for a in axes})
            members = self._members(axes, base)
            group = new_group(members, name=_group_name(axes), timeout=self._timeout)
            if self._rank_in_world in members:
                mine = group
        assert mine is not None
        self._groups[axes] = mine

    def group(self, *axes: str) -> Group:
        """The process group of this rank along ``axes``: one axis (``"tp"``) or fused axes (``"dp", "sp"``).

        Single-axis groups and declared fused groups exist on every rank. Another fused group is created on its
        first request by the members of each group (all members must ask, in the same order relative to their
        other group requests). Axes are taken in mesh order whatever order they are named in.
        """
        axes = self._normalize(axes)
        if axes not in self._groups:
            members = self._members(axes, self.coord)
            self._groups[axes] = new_group(
                members, name=_group_name(axes), timeout=self._timeout, local_synchronization=True
            )
        return self._groups[axes]

    def submesh(self, *axes: str) -> Mesh:
        """The mesh over ``axes`` that contains this rank (other axes fixed at this rank's coordinates).

        It reuses this mesh's groups; no collective runs.
        """
        axes = self._normalize(axes)
        sub = object.__new__(Mesh)
        sub._names = axes
        sub._sizes = tuple(self.shape[a] for a in axes)
        sub._timeout = self._timeout
        sub._all_ranks = self._members(axes, self.coord)
        sub._rank_in_world = self._rank_in_world
        sub._groups = {key: group for key, group in self._groups.items() if set(key) <= set(axes)}
        return sub

    def __repr__(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        coord = ", ".join(f"{k}={v}" for k, v in self.coord.items())
        return f"Mesh({shape}) at rank {self._rank_in_world} ({coord})"
