"""The process grids of 2D, 2.5D and 3D tensor parallelism: mesh axes, valid sizes and the groups each scheme uses.

Every scheme lives on ordinary `colo.comm.Mesh` axes, innermost last, after any outer axes (``dp``):

===========  ===================================  =========================================================
scheme       axes (sizes)                         tp
===========  ===================================  =========================================================
``"2d"``     ``tp_row`` (q), ``tp_col`` (q)        q^2 (SUMMA, Optimus: Xu et al., 2021)
``"2.5d"``   ``tp_dep`` (d), ``tp_row``, ``tp_col``  d q^2 (Tesseract: Wang et al., 2021); d = 1 is 2D
``"3d"``     ``tp_dep``, ``tp_row``, ``tp_col`` (q)  q^3 (Bian et al., 2021)
===========  ===================================  =========================================================

A rank's coordinate ``i`` on ``tp_row`` is its row in the q x q grid, ``j`` on ``tp_col`` its column. So
``mesh.group("tp_col")`` holds the ranks of one grid *row* (same ``i``, every ``j``): `Grid.row_group`; and
``mesh.group("tp_row")`` the ranks of one grid *column*: `Grid.col_group`. Sizes are checked (`check_tp_size`)
before any mesh or group exists, with the valid sizes in the message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from colo.comm import Group, Mesh

TP_MODES = ("1d", "2d", "2.5d", "3d")
"""The tensor-parallel schemes."""

GRID_AXES = {"2d": ("tp_row", "tp_col"), "2.5d": ("tp_dep", "tp_row", "tp_col"), "3d": ("tp_dep", "tp_row", "tp_col")}
"""Mesh axes of each multi-dimensional scheme, outermost first."""


def _integer_root(value: int, power: int) -> int | None:
    root = round(value ** (1 / power))
    for candidate in (root - 1, root, root + 1):
        if candidate >= 1 and candidate**power == value:
            return candidate
    return None


def valid_grid_sizes(mode: str, *, depth: int = 1, limit: int = 512) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that ``mode`` accepts (``depth``: 2.5D's d)."""
    if mode == "1d":
        return list(range(1, limit + 1))
    if mode == "2d":
        return [q * q for q in range(1, math.isqrt(limit) + 1)]
    if mode == "2.5d":
        return [depth * q * q for q in range(1, limit + 1) if depth * q * q <= limit]
    if mode == "3d":
        return [q**3 for q in range(1, limit + 1) if q**3 <= limit]
    raise ValueError(f"tp_mode={mode!r} is not a tensor-parallel scheme; use one of {TP_MODES}")


def check_tp_size(mode: str, tp: int, depth: int = 1) -> dict[str, int]:
    """The grid axis sizes of ``mode`` for ``tp`` ranks (``{"tp": tp}`` for 1D), or a `ValueError` listing valid tp.

    Args:
        mode: ``"1d"``, ``"2d"``, ``"2.5d"`` or ``"3d"``.
        tp: the number of tensor-parallel ranks.
        depth: 2.5D's number of stacked grids d (``tp = d q^2``); must be 1 for the other schemes.
    """
    if mode not in TP_MODES:
        raise ValueError(f"tp_mode={mode!r} is not a tensor-parallel scheme; use one of {TP_MODES}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive int")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"tp_depth={depth!r} must be a positive int")
    if depth != 1 and mode != "2.5d":
        raise ValueError(f"tp_depth={depth} applies to tp_mode='2.5d' only; drop it or use tp_mode='2.5d'")
    shown = ", ".join(str(s) for s in valid_grid_sizes(mode, depth=depth, limit=64))
    if mode == "1d":
        return {"tp": tp}
    if mode == "2d":
        q = _integer_root(tp, 2)
        if q is None:
            raise ValueError(f"tp_mode='2d' needs tp = q^2 (a q x q grid) but tp={tp}; choose tp in {{{shown}, ...}}")
        return {"tp_row": q, "tp_col": q}
    if mode == "2.5d":
        q = _integer_root(tp // depth, 2) if tp % depth == 0 else None
        if q is None:
            raise ValueError(
                f"tp_mode='2.5d' needs tp = tp_depth * q^2 but tp={tp}, tp_depth={depth}; with tp_depth={depth} "
                f"choose tp in {{{shown}, ...}}, or a tp_depth d with tp / d a square"
            )
        return {"tp_dep": depth, "tp_row": q, "tp_col": q}
    q = _integer_root(tp, 3)
    if q is None:
        raise ValueError(f"tp_mode='3d' needs tp = q^3 (a q x q x q cube) but tp={tp}; choose tp in {{{shown}, ...}}")
    return {"tp_dep": q, "tp_row": q, "tp_col": q}


def check_grid_divides(extent: int, parts: int, name: str, mode: str, where: str) -> None:
    """Raise a `ValueError` naming ``name`` when ``parts`` (a grid side) does not divide ``extent``."""
    if extent % parts:
        choices = [d for d in range(1, extent + 1) if extent % d == 0]
        raise ValueError(
            f"{where}: {name}={extent} does not divide by {parts} (the {mode} grid side); choose {name} as a "
            f"multiple of {parts}, or a grid side in {choices}"
        )


def grid_mesh(mode: str, tp: int, *, depth: int = 1, **outer_axes: int) -> Mesh:
    """The mesh of ``outer_axes`` (e.g. ``dp=2``) followed by ``mode``'s grid axes for ``tp`` ranks.

    The size is checked first, so a bad ``tp`` fails on every rank before any group is created.
    """
    axes = check_tp_size(mode, tp, depth)
    fused = [("tp_dep", "tp_row")] if "tp_dep" in axes else []
    return Mesh(**outer_axes, **axes, fused=fused)


@dataclass(frozen=True)
class Grid:
    """This rank's place in a 2D / 2.5D grid on ``mesh`` and the groups the layers communicate in.

    Attributes:
        mesh: the mesh holding ``tp_row`` and ``tp_col`` (and ``tp_dep`` for 2.5D).
        depth_axis: ``"tp_dep"`` for 2.5D, ``None`` for 2D.
    """

    mesh: Mesh
    depth_axis: str | None

    @classmethod
    def of(cls, mesh: Mesh, where: str) -> Grid:
        """The grid of ``mesh``: 2.5D when it has a ``tp_dep`` axis, else 2D; a clear error if axes are missing."""
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{where}: mesh must be a colo.comm.Mesh, not {type(mesh).__name__}")
        missing = [axis for axis in ("tp_row", "tp_col") if axis not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"{where}: the mesh has axes {mesh.axis_names} but 2D / 2.5D layers need 'tp_row' and 'tp_col'; "
                "build it with colo.tensor.grid_mesh('2d', tp) or grid_mesh('2.5d', tp, depth=d)"
            )
        if mesh.size("tp_row") != mesh.size("tp_col"):
            raise ValueError(f"{where}: tp_row={mesh.size('tp_row')} and tp_col={mesh.size('tp_col')} must be equal")
        return cls(mesh, "tp_dep" if "tp_dep" in mesh.axis_names else None)

    @property
    def q(self) -> int:
        """The grid side."""
        return self.mesh.size("tp_col")

    @property
    def depth(self) -> int:
        """Number of stacked grids (1 for 2D)."""
        return self.mesh.size(self.depth_axis) if self.depth_axis else 1

    @property
    def row(self) -> int:
        """This rank's grid row ``i`` (its ``tp_row`` coordinate)."""
        return self.mesh.rank("tp_row")

    @property
    def col(self) -> int:
        """This rank's grid column ``j`` (its ``tp_col`` coordinate)."""
        return self.mesh.rank("tp_col")

    @property
    def row_group(self) -> Group:
        """The ranks of this rank's grid row (``tp_col`` varies): hidden features are split over it."""
        return self.mesh.group("tp_col")

    @property
    def col_group(self) -> Group:
        """The ranks of this rank's grid column (``tp_row`` varies)."""
        return self.mesh.group("tp_row")

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over, outermost first: ``tp_row``, after ``tp_dep`` for 2.5D."""
        return (self.depth_axis, "tp_row") if self.depth_axis else ("tp_row",)

    @property
    def batch_group(self) -> Group:
        """The ranks holding other batch rows of this rank's features (weight gradients are summed over it)."""
        return self.mesh.group(*self.batch_axes)

    @property
    def depth_group(self) -> Group | None:
        """The ranks at this rank's grid position in the other stacked grids (2.5D), ``None`` for 2D."""
        return self.mesh.group(self.depth_axis) if self.depth_axis else None
