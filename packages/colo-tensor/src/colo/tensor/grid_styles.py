"""Parallel styles for 2D / 2.5D / 3D tensor parallelism: `parallelize` plans that replace modules by
`colo.tensor.tp2d` / `colo.tensor.tp3d` layers, built from the modules' full weights.

Every style checks the module and the grid sizes first (`parallelize` runs every check before changing the model,
and none communicates). The styles use the mesh axis ``tp_col`` (any grid axis would do: the layers take the
whole grid from the mesh). Example: a pre-norm MLP block on a 2D mesh::

    mesh = grid_mesh("2d", 4)
    parallelize(block, mesh, {"norm": Norm2D(), "up": Linear2DStyle(), "down": Linear2DStyle()}, axis="tp_col")

Activations between the replaced modules are in the 2D layout (`colo.tensor.tp2d`): the model's input is sliced
with `shard_batch(x, mesh, hidden_split=True)`, or comes from an `Embedding2DStyle` embedding of the full ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .styles import ParallelStyle, StyleTarget
from .tp2d import Embedding2D, LayerNorm2D, Linear2D, QKVLinear2D, RMSNorm2D, VocabParallelEmbedding2D
from .tp3d import AttentionCore3D, Embedding3D, LayerNorm3D, Linear3D, QKVLinear3D, _cube
from .tp_grid import Grid, check_grid_divides

GRID_AXIS = "tp_col"


def _grid(target: StyleTarget, style: ParallelStyle) -> Grid:
    return Grid.of(target.mesh, f"{style!r} on {target.describe()}")


def _require(target: StyleTarget, style: ParallelStyle, cls: type | tuple) -> None:
    if not isinstance(target.module, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(f"{style!r} cannot handle {target.describe()}: it replaces a {names}")


@dataclass(frozen=True)
class Linear2DStyle(ParallelStyle):
    """Replace an ``nn.Linear`` by a `Linear2D` (SUMMA on the grid)."""

    axis: str | None = GRID_AXIS
    replaces = True

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Linear)
        grid = _grid(target, self)
        for field in ("in_features", "out_features"):
            check_grid_divides(getattr(target.module, field), grid.q, field, "2D", target.describe())

    def apply(self, target: StyleTarget) -> nn.Module:
        return Linear2D.from_linear(target.module, mesh=target.mesh)


@dataclass(frozen=True)
class QKV2DStyle(ParallelStyle):
    """Replace a fused, bias-free q/k/v ``nn.Linear`` by a `QKVLinear2D` and set the parent's head-count attributes
    (``head_attrs``) to this rank's counts.

    Args:
        head_attrs: the parent's attributes holding the query and kv head counts. Default
            ``("num_heads", "num_kv_heads")``.
    """

    head_attrs: tuple[str, str] = ("num_heads", "num_kv_heads")
    axis: str | None = GRID_AXIS
    replaces = True

    def _counts(self, target: StyleTarget) -> tuple[int, int]:
        missing = [a for a in self.head_attrs if target.parent is None or not hasattr(target.parent, a)]
        if missing:
            raise ValueError(f"{self!r} on {target.describe()}: the parent has no attribute {missing[0]!r}")
        return tuple(int(getattr(target.parent, a)) for a in self.head_attrs)

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Linear)
        grid = _grid(target, self)
        num_heads, num_kv_heads = self._counts(target)
        where = target.describe()
        check_grid_divides(target.module.in_features, grid.q, "hidden_size", "2D", where)
        check_grid_divides(num_heads, grid.q, "num_heads", "2D", where)
        check_grid_divides(num_kv_heads, grid.q, "num_kv_heads", "2D", where)

    def apply(self, target: StyleTarget) -> nn.Module:
        num_heads, num_kv_heads = self._counts(target)
        layer = QKVLinear2D.from_linear(target.module, num_heads=num_heads, num_kv_heads=num_kv_heads, mesh=target.mesh)
        setattr(target.parent, self.head_attrs[0], layer.local_num_heads)
        setattr(target.parent, self.head_attrs[1], layer.local_num_kv_heads)
        return layer


@dataclass(frozen=True)
class Norm2D(ParallelStyle):
    """Replace an ``nn.LayerNorm`` by a `LayerNorm2D`, or an RMS norm (a module with a 1-dim ``weight`` and
    ``eps``, e.g. colo's Llama ``RMSNorm``) by an `RMSNorm2D`."""

    axis: str | None = GRID_AXIS
    replaces = True

    def check(self, target: StyleTarget) -> None:
        module = target.module
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.LayerNorm) and (weight is None or weight.dim() != 1 or not hasattr(module, "eps")):
            raise TypeError(f"{self!r} cannot handle {target.describe()}: it replaces a LayerNorm or an RMS norm")
        check_grid_divides(weight.shape[0], _grid(target, self).q, "hidden_size", "2D", target.describe())

    def apply(self, target: StyleTarget) -> nn.Module:
        if isinstance(target.module, nn.LayerNorm):
            return LayerNorm2D.from_layer_norm(target.module, mesh=target.mesh)
        return RMSNorm2D.from_norm(target.module, mesh=target.mesh)


@dataclass(frozen=True)
class Embedding2DStyle(ParallelStyle):
    """Replace an ``nn.Embedding`` by an `Embedding2D` (hidden over ``tp_col``; any batch) or, with
    ``vocab_parallel``, a `VocabParallelEmbedding2D` (vocabulary over the batch axes; batch divisible by them)."""

    vocab_parallel: bool = False
    axis: str | None = GRID_AXIS
    replaces = True

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Embedding)
        grid = _grid(target, self)
        check_grid_divides(target.module.embedding_dim, grid.q, "embedding_dim", "2D", target.describe())
        if self.vocab_parallel:
            size = grid.batch_group.size
            check_grid_divides(target.module.num_embeddings, size, "num_embeddings", "2D", target.describe())

    def apply(self, target: StyleTarget) -> nn.Module:
        module = target.module
        cls = VocabParallelEmbedding2D if self.vocab_parallel else Embedding2D
        layer = cls(
            module.num_embeddings, module.embedding_dim, mesh=target.mesh, device="meta", dtype=module.weight.dtype
        )
        layer.load_full(module.weight.detach())
        return layer


# --- 3D (colo.tensor.tp3d) -------------------------------------------------------------------------------------


def _cube_side(target: StyleTarget, style: ParallelStyle) -> int:
    return _cube(target.mesh, f"{style!r} on {target.describe()}")


@dataclass(frozen=True)
class Linear3DStyle(ParallelStyle):
    """Replace an ``nn.Linear`` by a `Linear3D`: ``in_axis="tp_dep"`` maps layout A to B (q/k/v, gate/up,
    lm_head), ``"tp_row"`` B to A (o_proj, down_proj)."""

    in_axis: str = "tp_dep"
    axis: str | None = GRID_AXIS
    replaces = True

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Linear)
        q = _cube_side(target, self)
        check_grid_divides(target.module.in_features, q, "in_features", "3D", target.describe())
        check_grid_divides(target.module.out_features, q * q, "out_features", "3D", target.describe())

    def apply(self, target: StyleTarget) -> nn.Module:
        return Linear3D.from_linear(target.module, mesh=target.mesh, in_axis=self.in_axis)


@dataclass(frozen=True)
class QKV3DStyle(QKV2DStyle):
    """Replace a fused, bias-free q/k/v ``nn.Linear`` by a `QKVLinear3D` (layout A -> B, by heads) and set the
    parent's head counts to this rank's."""

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Linear)
        q = _cube_side(target, self)
        num_heads, num_kv_heads = self._counts(target)
        head_dim = target.module.out_features // (num_heads + 2 * num_kv_heads)
        where = target.describe()
        check_grid_divides(target.module.in_features, q, "hidden_size", "3D", where)
        check_grid_divides(num_kv_heads, q, "num_kv_heads", "3D", where)
        check_grid_divides(num_heads, q, "num_heads", "3D", where)
        check_grid_divides(num_kv_heads * head_dim, q * q, "num_kv_heads * head_dim", "3D", where)

    def apply(self, target: StyleTarget) -> nn.Module:
        num_heads, num_kv_heads = self._counts(target)
        layer = QKVLinear3D.from_linear(target.module, num_heads=num_heads, num_kv_heads=num_kv_heads, mesh=target.mesh)
        setattr(target.parent, self.head_attrs[0], layer.local_num_heads)
        setattr(target.parent, self.head_attrs[1], layer.local_num_kv_heads)
        return layer


@dataclass(frozen=True)
class Norm3D(ParallelStyle):
    """Replace an ``nn.LayerNorm`` or an RMS norm (1-dim ``weight`` and ``eps``) by a `LayerNorm3D` (layout A)."""

    axis: str | None = GRID_AXIS
    replaces = True

    def check(self, target: StyleTarget) -> None:
        weight = getattr(target.module, "weight", None)
        if weight is None or weight.dim() != 1 or not hasattr(target.module, "eps"):
            raise TypeError(f"{self!r} cannot handle {target.describe()}: it replaces a LayerNorm or an RMS norm")
        check_grid_divides(weight.shape[0], _cube_side(target, self), "hidden_size", "3D", target.describe())

    def apply(self, target: StyleTarget) -> nn.Module:
        return LayerNorm3D.from_norm(target.module, mesh=target.mesh)


@dataclass(frozen=True)
class Embedding3DStyle(ParallelStyle):
    """Replace an ``nn.Embedding`` by an `Embedding3D` (full ids in, layout A out)."""

    axis: str | None = GRID_AXIS
    replaces = True

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Embedding)
        check_grid_divides(
            target.module.embedding_dim, _cube_side(target, self), "embedding_dim", "3D", target.describe()
        )

    def apply(self, target: StyleTarget) -> nn.Module:
        layer = Embedding3D(target.module.num_embeddings, target.module.embedding_dim, mesh=target.mesh)
        layer.load_full(target.module.weight.detach())
        return layer


@dataclass(frozen=True)
class AttentionCore3DStyle(ParallelStyle):
    """Replace a parameter-free attention core (``causal`` and ``scale`` attributes) by an `AttentionCore3D`."""

    axis: str | None = GRID_AXIS
    replaces = True

    def check(self, target: StyleTarget) -> None:
        _cube_side(target, self)
        if not hasattr(target.module, "causal") or next(target.module.parameters(), None) is not None:
            raise TypeError(f"{self!r} cannot handle {target.describe()}: it replaces a parameter-free attention core")

    def apply(self, target: StyleTarget) -> nn.Module:
        return AttentionCore3D(
            mesh=target.mesh, causal=target.module.causal, scale=getattr(target.module, "scale", None)
        )


@dataclass(frozen=True)
class RotaryRows3D(ParallelStyle):
    """Hook an attention module called as ``module(x, cos, sin, ...)`` so it gets the rows of the rotary tables of
    its layout-B queries: this rank's ``tp_dep`` chunk of the sequence (tables with one row per position)."""

    axis: str | None = GRID_AXIS

    def check(self, target: StyleTarget) -> None:
        _cube_side(target, self)

    def apply(self, target: StyleTarget) -> nn.Module:
        group = target.mesh.group("tp_dep")

        def slice_tables(module, args):
            x, cos, sin, *rest = args
            if cos.dim() != 2:
                raise ValueError("RotaryRows3D: per-sequence position tables are not supported under 3D")
            rows = x.shape[1]  # the layout-A input's sequence piece: the queries' piece has the same length
            start = group.rank * rows  # tables start at position 0 (they may hold more rows than the sequence)
            return (x, cos[start : start + rows], sin[start : start + rows], *rest)

        target.module.register_forward_pre_hook(slice_tables)
        return target.module
