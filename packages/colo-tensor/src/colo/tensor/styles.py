"""Parallel styles: what `parallelize` does to each module a plan names.

A style either replaces a module by its tensor-parallel version, built from the module's full weights
(`Colwise`, `Rowwise`, `VocabParallel`, `FusedQKV`), or wraps it with hooks (`PrepareInput`, `PrepareOutput`
convert activations between layouts with the autograd communication steps; `ShardedRNG` runs the module with
the rank's own random stream). Every style checks the module first, so a plan with a mistake fails before
anything is changed and before any collective runs.

Activation layouts and the steps converting them are in `colo.tensor.activations`. The sequence-parallel styles
(`SequenceParallel`, `UlyssesAttention`, `RingAttention`) are in `colo.tensor.sequence_styles`; Megatron
sequence parallelism is ``Colwise`` / ``FusedQKV`` with ``input_layout=Shard(1)`` and ``Rowwise`` with
``output_layout=Shard(1)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from colo.comm import Group, Mesh

from .activations import check_conversion, convert_activation
from .layers import ColumnParallelLinear, RowParallelLinear, check_divides
from .placement import Partial, Placement, Replicate, Shard
from .qkv import QKVParallelLinear, check_heads, fused_head_dim
from .random import MODEL_PARALLEL_STREAM, RNGTracker
from .sequence_parallel import SequenceParallelColumnLinear, SequenceParallelQKVLinear, SequenceParallelRowLinear
from .vocab_parallel import VocabParallelEmbedding


@dataclass(frozen=True)
class StyleTarget:
    """A module a plan pattern matched, as a style sees it.

    Attributes:
        pattern: the plan pattern that matched.
        name: the module's qualified name (``""`` for the root).
        module: the module.
        parent: the module holding it (``None`` for the root).
        mesh: the mesh.
        axis: the tensor-parallel axis this style uses.
    """

    pattern: str
    name: str
    module: nn.Module
    parent: nn.Module | None
    mesh: Mesh
    axis: str

    def describe(self) -> str:
        """``'layers.0.wq' (a Linear, matched by 'layers.*.wq')`` for error messages."""
        return f"{self.name or '<root>'!r} (a {type(self.module).__name__}, matched by {self.pattern!r})"


class ParallelStyle:
    """What `parallelize` does to one module. Subclasses implement `check` and `apply`.

    Attributes:
        replaces: whether `apply` returns a new module (at most one such style per module).
        axis: the mesh axis to shard over; ``None``: the one given to `parallelize`.
    """

    replaces: bool = False
    axis: str | None = None

    def check(self, target: StyleTarget) -> None:
        """Raise a `TypeError` / `ValueError` if the style cannot apply to ``target``; change nothing."""

    def apply(self, target: StyleTarget) -> nn.Module:
        """Apply the style; return the module that takes ``target.module``'s place (possibly itself)."""
        raise NotImplementedError


def _require(target: StyleTarget, style: ParallelStyle, cls: type, hint: str) -> None:
    """A plain ``cls`` (or a subclass that keeps its forward: a replacement would drop any other behaviour)."""
    if not isinstance(target.module, cls):
        raise TypeError(f"{style!r} cannot handle {target.describe()}: it applies to torch.nn.{cls.__name__}; {hint}")
    if type(target.module).forward is not cls.forward:
        raise TypeError(
            f"{style!r} cannot handle {target.describe()}: it overrides torch.nn.{cls.__name__}.forward, which the "
            "parallel layer would drop; shard the plain layers inside it instead"
        )


def _check_sequence_layout(style: ParallelStyle, field: str, layout: object) -> None:
    """``Replicate()`` (tensor parallelism) or ``Shard(d)`` on a sequence dimension (Megatron-SP)."""
    if not isinstance(layout, (Replicate, Shard)):
        raise ValueError(
            f"{type(style).__name__}: {field}={layout!r} must be Replicate() (tensor parallelism) or Shard(1) "
            "(Megatron sequence parallelism: activations split along the sequence dimension 1)"
        )
    if isinstance(layout, Shard) and layout.dim == -1:
        raise ValueError(f"{type(style).__name__}: {field}=Shard(-1) names the features; the sequence is Shard(1)")


def _repr_without_default_layouts(style: ParallelStyle) -> str:
    """The dataclass repr, leaving out ``*_layout`` fields at their default ``Replicate()``."""
    shown = [
        f"{field.name}={getattr(style, field.name)!r}"
        for field in dataclasses.fields(style)
        if not (field.name.endswith("_layout") and getattr(style, field.name) == Replicate())
    ]
    return f"{type(style).__name__}({', '.join(shown)})"


@dataclass(frozen=True)
class Colwise(ParallelStyle):
    """Replace an ``nn.Linear`` by a `ColumnParallelLinear` (output features split over the axis).

    With ``input_layout=Shard(d)`` (Megatron sequence parallelism) the input arrives split along sequence
    dimension ``d`` and the layer is a `SequenceParallelColumnLinear` (all-gather of the sequence first).

    Args:
        gather_output: all-gather the output so every rank holds all features. Default ``False``.
        axis: mesh axis; default: `parallelize`'s.
        input_layout: ``Replicate()`` or ``Shard(sequence_dim)``. Default ``Replicate()``.
    """

    gather_output: bool = False
    axis: str | None = None
    input_layout: Placement = Replicate()
    replaces = True

    def __post_init__(self) -> None:
        _check_sequence_layout(self, "input_layout", self.input_layout)

    __repr__ = _repr_without_default_layouts

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Linear, "for an nn.Embedding use VocabParallel()")
        check_divides(target.mesh.size(target.axis), target.module.out_features, "out_features", target.describe())

    def apply(self, target: StyleTarget) -> nn.Module:
        kwargs = {"mesh": target.mesh, "axis": target.axis, "gather_output": self.gather_output}
        if isinstance(self.input_layout, Shard):
            return SequenceParallelColumnLinear.from_linear(target.module, sequence_dim=self.input_layout.dim, **kwargs)
        return ColumnParallelLinear.from_linear(target.module, **kwargs)


@dataclass(frozen=True)
class Rowwise(ParallelStyle):
    """Replace an ``nn.Linear`` by a `RowParallelLinear` (input features split, output all-reduced).

    With ``output_layout=Shard(d)`` (Megatron sequence parallelism) the output leaves split along sequence
    dimension ``d`` and the layer is a `SequenceParallelRowLinear` (reduce-scatter instead of all-reduce).

    Args:
        input_is_parallel: the input arrives split over the axis (from a `Colwise` layer). Default ``True``.
        axis: mesh axis; default: `parallelize`'s.
        output_layout: ``Replicate()`` or ``Shard(sequence_dim)``. Default ``Replicate()``.
    """

    input_is_parallel: bool = True
    axis: str | None = None
    output_layout: Placement = Replicate()
    replaces = True

    def __post_init__(self) -> None:
        _check_sequence_layout(self, "output_layout", self.output_layout)

    __repr__ = _repr_without_default_layouts

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Linear, "point the pattern at a linear layer")
        check_divides(target.mesh.size(target.axis), target.module.in_features, "in_features", target.describe())

    def apply(self, target: StyleTarget) -> nn.Module:
        kwargs = {"mesh": target.mesh, "axis": target.axis, "input_is_parallel": self.input_is_parallel}
        if isinstance(self.output_layout, Shard):
            return SequenceParallelRowLinear.from_linear(target.module, sequence_dim=self.output_layout.dim, **kwargs)
        return RowParallelLinear.from_linear(target.module, **kwargs)


@dataclass(frozen=True)
class VocabParallel(ParallelStyle):
    """Replace an ``nn.Embedding`` by a `VocabParallelEmbedding` (vocabulary rows split, padded if uneven).

    Args:
        axis: mesh axis; default: `parallelize`'s.
    """

    axis: str | None = None
    replaces = True

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Embedding, "for an output projection use Colwise()")
        module = target.module
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(f"{self!r} cannot handle {target.describe()}: max_norm, sparse and scale_grad_by_freq")

    def apply(self, target: StyleTarget) -> nn.Module:
        return VocabParallelEmbedding.from_embedding(target.module, mesh=target.mesh, axis=target.axis)


@dataclass(frozen=True)
class FusedQKV(ParallelStyle):
    """Replace a fused q/k/v ``nn.Linear`` (rows: q heads, k heads, v heads) by a `QKVParallelLinear`.

    Head counts default to the parent module's attributes named by ``head_attrs``; after sharding those
    attributes are set to this rank's counts, so an attention module that splits its projection with
    ``self.num_heads`` / ``self.num_kv_heads`` runs unchanged on its local heads.

    Args:
        num_heads: query heads; default: the parent's ``head_attrs[0]``.
        num_kv_heads: key/value heads; default: the parent's ``head_attrs[1]``.
        head_attrs: the parent's attributes holding the head counts, rewritten to the local counts; ``None``:
            leave the parent alone (then give both counts). Default ``("num_heads", "num_kv_heads")``.
        axis: mesh axis; default: `parallelize`'s.
        input_layout: ``Replicate()``, or ``Shard(sequence_dim)`` for Megatron sequence parallelism (the layer
            is then a `SequenceParallelQKVLinear`, all-gathering the sequence first). Default ``Replicate()``.
    """

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_attrs: tuple[str, str] | None = ("num_heads", "num_kv_heads")
    axis: str | None = None
    input_layout: Placement = Replicate()
    replaces = True

    def __post_init__(self) -> None:
        _check_sequence_layout(self, "input_layout", self.input_layout)

    __repr__ = _repr_without_default_layouts

    def _counts(self, target: StyleTarget) -> tuple[int, int]:
        counts = [self.num_heads, self.num_kv_heads]
        for i, count in enumerate(counts):
            if count is not None:
                continue
            which = ("num_heads", "num_kv_heads")[i]
            if self.head_attrs is None:
                raise ValueError(f"{self!r} on {target.describe()}: with head_attrs=None pass {which}= explicitly")
            attr = self.head_attrs[i]
            if target.parent is None or not hasattr(target.parent, attr):
                raise ValueError(
                    f"{self!r} on {target.describe()}: the parent module has no attribute {attr!r} holding the head "
                    f"count; pass {which}=, and head_attrs= naming the parent's attributes (or None)"
                )
            counts[i] = int(getattr(target.parent, attr))
        return counts[0], counts[1]

    def check(self, target: StyleTarget) -> None:
        _require(target, self, nn.Linear, "point the pattern at the fused q/k/v projection")
        num_heads, num_kv_heads = self._counts(target)
        check_heads(target.mesh.size(target.axis), num_heads, num_kv_heads, target.describe())
        fused_head_dim(target.module.out_features, num_heads, num_kv_heads, target.describe())
        if self.head_attrs is not None:
            missing = [a for a in self.head_attrs if target.parent is None or not hasattr(target.parent, a)]
            if missing:
                raise ValueError(
                    f"{self!r} on {target.describe()}: the parent has no attribute {missing[0]!r} to set to the "
                    "local head count; pass head_attrs= naming its attributes, or head_attrs=None"
                )

    def apply(self, target: StyleTarget) -> nn.Module:
        num_heads, num_kv_heads = self._counts(target)
        kwargs = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "mesh": target.mesh, "axis": target.axis}
        if isinstance(self.input_layout, Shard):
            layer = SequenceParallelQKVLinear.from_linear(target.module, sequence_dim=self.input_layout.dim, **kwargs)
        else:
            layer = QKVParallelLinear.from_linear(target.module, **kwargs)
        if self.head_attrs is not None:
            setattr(target.parent, self.head_attrs[0], layer.local_num_heads)
            setattr(target.parent, self.head_attrs[1], layer.local_num_kv_heads)
        return layer


# --- input and output preparation ---------------------------------------------------------------------------


def _as_layouts(layouts, name: str) -> tuple[Placement | None, ...]:
    if isinstance(layouts, (Shard, Replicate, Partial)):
        return (layouts,)
    if not isinstance(layouts, Sequence):
        raise TypeError(f"{name} must be a placement or a sequence of placements (None: leave one), not {layouts!r}")
    return tuple(layouts)


class _Prepare(ParallelStyle):
    """Shared by `PrepareInput` and `PrepareOutput`: pairs of layouts, one per tensor (``None``: leave it)."""

    def __init__(self, layouts, desired_layouts, *, partial_grad: bool, axis: str | None, what: str):
        self.layouts = _as_layouts(layouts, f"{type(self).__name__}: {what}_layouts")
        self.desired_layouts = _as_layouts(desired_layouts, f"{type(self).__name__}: desired_layouts")
        self.partial_grad, self.axis = partial_grad, axis
        if len(self.layouts) != len(self.desired_layouts):
            raise ValueError(
                f"{type(self).__name__}: {len(self.layouts)} {what} layouts but {len(self.desired_layouts)} desired "
                "layouts; give one pair per tensor (None in both to leave one alone)"
            )
        for i, (src, dst) in enumerate(zip(self.layouts, self.desired_layouts)):
            if (src is None) != (dst is None):
                raise ValueError(f"{type(self).__name__}: {what} {i} has one layout None and not the other")
            if src is not None:
                check_conversion(src, dst, partial_grad, f"{type(self).__name__} ({what} {i})")

    def _convert(self, values: tuple, group: Group, where: str) -> tuple:
        if len(values) < len(self.layouts):
            raise ValueError(f"{where}: {len(self.layouts)} layouts given but only {len(values)} values arrived")
        converted = list(values)
        for i, (src, dst) in enumerate(zip(self.layouts, self.desired_layouts)):
            if src is None:
                continue
            if not isinstance(values[i], torch.Tensor):
                raise TypeError(f"{where}: value {i} is a {type(values[i]).__name__}, not a tensor; use None for it")
            converted[i] = convert_activation(values[i], src, dst, group=group, partial_grad=self.partial_grad)
        return tuple(converted)

    def __repr__(self) -> str:
        grad = ", partial_grad=True" if self.partial_grad else ""
        return f"{type(self).__name__}({self.layouts} -> {self.desired_layouts}{grad})"


class PrepareInput(_Prepare):
    """Convert a module's positional inputs from one layout to another before its forward.

    Args:
        input_layouts: the layout each positional input arrives in (a placement for the first input, or a
            sequence; ``None`` leaves that input alone).
        desired_layouts: the layout the module needs, one per entry of ``input_layouts``.
        partial_grad: the module consumes replicated inputs in a sharded way (their gradients are partial).
        axis: mesh axis; default: `parallelize`'s.
    """

    def __init__(self, input_layouts, desired_layouts, *, partial_grad: bool = False, axis: str | None = None):
        super().__init__(input_layouts, desired_layouts, partial_grad=partial_grad, axis=axis, what="input")

    def apply(self, target: StyleTarget) -> nn.Module:
        group, where = target.mesh.group(target.axis), f"PrepareInput on {target.name or '<root>'!r}"
        target.module.register_forward_pre_hook(lambda module, args: self._convert(args, group, where))
        return target.module


class PrepareOutput(_Prepare):
    """Convert a module's output (a tensor, or a tuple of them) from one layout to another after its forward.

    Args:
        output_layouts: the layout each output leaves the module in (a placement, or one per tuple element;
            ``None`` leaves that element alone).
        desired_layouts: the layout the rest of the model needs.
        axis: mesh axis; default: `parallelize`'s.
    """

    def __init__(self, output_layouts, desired_layouts, *, axis: str | None = None):
        super().__init__(output_layouts, desired_layouts, partial_grad=False, axis=axis, what="output")

    def apply(self, target: StyleTarget) -> nn.Module:
        group, where = target.mesh.group(target.axis), f"PrepareOutput on {target.name or '<root>'!r}"

        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                return self._convert((output,), group, where)[0]
            return type(output)(self._convert(tuple(output), group, where))

        target.module.register_forward_hook(hook)
        return target.module


class ShardedRNG(ParallelStyle):
    """Run a module's forward with this rank's own random stream (``tracker.fork(stream)``).

    For dropout in a sharded region (on a rank's attention heads or MLP features): each rank then draws a
    different mask, reproducibly from the base seed (see `colo.tensor.random`). Dropout in replicated regions
    needs no style: it uses the default generator, seeded the same on every rank.

    Args:
        tracker: the `RNGTracker` holding the stream (from `seed_tensor_parallel`).
        stream: the stream's name. Default ``"model_parallel"``.
    """

    def __init__(self, tracker: RNGTracker, *, stream: str = MODEL_PARALLEL_STREAM):
        if not isinstance(tracker, RNGTracker):
            raise TypeError(f"ShardedRNG: tracker must be a colo.tensor.RNGTracker, not {type(tracker).__name__}")
        self.tracker, self.stream = tracker, stream

    def check(self, target: StyleTarget) -> None:
        if self.stream not in self.tracker.streams:
            raise ValueError(
                f"ShardedRNG on {target.describe()}: the tracker has no stream {self.stream!r} (it has "
                f"{list(self.tracker.streams)}); seed it with seed_tensor_parallel(seed, mesh=mesh) first"
            )

    def apply(self, target: StyleTarget) -> nn.Module:
        active = []

        def enter(module, args):
            context = self.tracker.fork(self.stream)
            context.__enter__()
            active.append(context)

        def leave(module, args, output):
            if active:  # empty only when entering failed
                active.pop().__exit__(None, None, None)

        target.module.register_forward_pre_hook(enter)
        target.module.register_forward_hook(leave, always_call=True)
        return target.module

    def __repr__(self) -> str:
        return f"ShardedRNG(stream={self.stream!r})"
