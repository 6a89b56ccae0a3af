"""Expert parallelism over an ``ep`` mesh axis: checks, `shard_experts`, and the gradient groups.

The ``ep`` axis is a sub-axis of data parallelism (DeepSpeed-MoE, Megatron-Core): the data ranks are
``dp x ep``, each with its own tokens; the dense parameters are replicated over all of them, the experts are
split over ``ep`` and replicated over ``dp``. So:

- dense gradients are averaged over every data rank: ``mesh.group("dp", "ep")`` (`dense_data_axes`);
- expert gradients over the ``dp`` ranks holding the same experts: ``mesh.group("dp")`` (`expert_data_axes`);
  because each expert saw the tokens of its whole ``ep`` group, its weight gradients are scaled by ``1 / ep`` in
  backward (``GroupedExperts.grad_scale``), so that average is the gradient of the mean loss over all data ranks;
- the expert bias counts (aux-loss-free balancing) are summed over ``dp x ep``;
- shared experts (`SharedExperts`) are dense parameters: replicated, their gradients averaged over ``dp x ep``.

With tensor parallelism (``tp``, the innermost mesh axis) the ep groups are the ranks of one tp coordinate: the
tokens reaching an MoE block are replicated over tp, so every tp rank routes and runs them alike through whole
experts (the experts are replicated over tp, counted once in the gradient norm). With a pipeline (``pp``) each stage
splits the experts of its own blocks over the ep group inside the stage, so the all-to-alls never cross a stage.

With sequence parallelism (Ulysses, an ``sp`` axis of size > 1) every rank of an sp group holds a piece of the same
sequences, routed on that rank: the sp ranks count as data ranks for the gradients (dense over ``dp x ep x sp``,
experts over ``dp x sp``: the ep groups are the ranks of one sp coordinate, so each expert's ``1 / ep`` scale still
holds), the expert bias counts are summed over them too, and the load-balancing loss counts its assignments over the
whole sequences (`route_sequence_pieces`).

Group-limited routing (`MoEConfig.num_groups`) splits the experts into contiguous groups as ``shard_experts`` splits
them over ranks, so with ``num_groups == ep`` group ``g`` is exactly rank ``g``'s experts and ``top_k_groups`` bounds
the ranks each token's rows are sent to (DeepSeek-V3's node-limited routing, with ep ranks for nodes).
"""

from __future__ import annotations

import torch
from torch import nn

from colo.comm import Mesh

from ..layout import Layout, layout_of, set_layout
from ..placement import Shard
from .layer import MoEBlock, moe_blocks

EXPERT_PARAM_NAMES = ("w1", "w2", "w3")


def check_expert_parallel(
    *, num_experts: int, ep: int, data_parallel_size: int, tp: int = 1, pp: int = 1, sp: int = 1
) -> None:
    """Raise a `ValueError` naming the field and the fix for an expert-parallel layout colo cannot run; call it
    before any collective.

    Args:
        num_experts (int): experts per MoE block.
        ep (int): the expert-parallel size.
        data_parallel_size (int): all data ranks (``dp * ep``).
        tp, pp, sp (int): tensor, pipeline and sequence-parallel sizes. Expert parallelism composes with ``tp``
            (the experts whole on every tp rank, which see the same tokens), ``pp`` (each stage splits its own
            blocks' experts over its own ep group) and ``sp`` (module docstring; the caller averages gradients over
            `dense_data_axes` / `expert_data_axes` and calls `route_sequence_pieces`).
    """
    if ep < 1:
        raise ValueError(f"ep={ep} must be a positive integer (1: experts replicated)")
    if num_experts % ep:
        choices = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"ep={ep} does not divide num_experts={num_experts}: each ep rank holds num_experts / ep experts; "
            f"choose ep in {choices}"
        )
    if data_parallel_size % ep:
        raise ValueError(
            f"ep={ep} does not divide the {data_parallel_size} data-parallel ranks: experts are split over a "
            f"sub-axis of data parallelism; choose ep dividing {data_parallel_size}"
        )


def _sequence_axes(mesh: Mesh) -> tuple[str, ...]:
    return ("sp",) if "sp" in mesh.axis_names and mesh.size("sp") > 1 else ()


def dense_data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data axes dense gradients are averaged over: ``("dp", "ep")``, those of the two the mesh has, and
    ``"sp"`` when the mesh splits sequences over it (size > 1)."""
    return tuple(axis for axis in ("dp", "ep") if axis in mesh.axis_names) + _sequence_axes(mesh)


def expert_data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data axes expert gradients are averaged over: ``("dp",)`` (the ranks holding the same experts), and
    ``"sp"`` when the mesh splits sequences over it (size > 1)."""
    return tuple(axis for axis in ("dp",) if axis in mesh.axis_names) + _sequence_axes(mesh)


def route_sequence_pieces(model: nn.Module, *, mesh: Mesh, axis: str = "sp") -> nn.Module:
    """Sequence parallelism: every `MoEBlock` of ``model`` counts its load-balancing loss's assignments over the
    mesh axis ``axis`` (its ranks hold equal pieces of the same sequences; `load_balancing_loss`), in place.

    Returns:
        ``model``.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"route_sequence_pieces: axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    group = mesh.group(axis)
    for _, block in moe_blocks(model):
        block.sp_group = group
    return model


def is_expert_param(name: str) -> bool:
    """Whether parameter ``name`` is an expert weight of an `MoEBlock` (``...experts.w1`` / ``w2`` / ``w3``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in EXPERT_PARAM_NAMES


@torch.no_grad()
def shard_experts(model: nn.Module, *, mesh: Mesh, axis: str = "ep") -> nn.Module:
    """Split the experts of every `MoEBlock` of ``model`` over the mesh axis ``axis``, in place.

    Rank ``r`` of the axis keeps experts ``r * E / ep .. (r + 1) * E / ep - 1`` (a `Shard(0)` layout on its expert
    tensors, so checkpoints hold the global ``(E, ...)`` tensors), tokens reach them by all-to-all
    (`colo.tensor.moe.dispatch`), and their weight gradients are scaled by ``1 / ep`` (module docstring). Build
    the model identically on every rank first (same seed).

    Returns:
        ``model``.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"shard_experts: axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    ep, rank = mesh.size(axis), mesh.rank(axis)
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("shard_experts: the model has no MoEBlock to shard")
    others = {a: mesh.size(a) for a in mesh.axis_names if a not in ("dp", axis)}
    check_expert_parallel(
        num_experts=blocks[0][1].config.num_experts,
        ep=ep,
        data_parallel_size=ep * mesh.size("dp") if "dp" in mesh.axis_names else ep,
        tp=others.get("tp", 1),
        pp=others.get("pp", 1),
        sp=others.get("sp", 1),
    )
    group = mesh.group(axis)
    for _, block in blocks:
        _shard_block(block, mesh=mesh, axis=axis, ep=ep, rank=rank)
        block.ep_group = group
    return model


def _shard_block(block: MoEBlock, *, mesh: Mesh, axis: str, ep: int, rank: int) -> None:
    experts = block.experts
    if block.ep_group is not None:
        raise ValueError("shard_experts: the experts are already sharded")
    total = experts.num_experts
    local = total // ep
    for name in EXPERT_PARAM_NAMES:
        full = getattr(experts, name)
        piece = nn.Parameter(full[rank * local : (rank + 1) * local].clone(), requires_grad=full.requires_grad)
        set_layout(piece, Layout(mesh, {axis: Shard(0)}, full.shape))
        setattr(experts, name, piece)
    experts.num_experts = local
    experts.grad_scale = 1.0 / ep


@torch.no_grad()
def split_expert_ffns(model: nn.Module, *, mesh: Mesh, axis: str = "tp") -> nn.Module:
    """Expert tensor parallelism: split every expert's SwiGLU FFN of every `MoEBlock` over the mesh axis ``axis``,
    in place, as Megatron splits an MLP (Megatron-Core's expert tensor parallelism).

    Rank ``r`` of the axis keeps rows ``r * I / n ..`` of each expert's gate and up projections (``w1``, ``w3``:
    column-parallel) and the matching columns of its down projection (``w2``: row-parallel), on top of any split over
    ``ep`` (`shard_experts`); its layout says `Shard` over ``axis`` too, so checkpoints hold the global tensors. The
    rows reaching the experts must be the same on every rank of the axis (a block's input replicated over tp): the
    experts then take them through `colo.tensor.comm_ops.CopyAllReduce` and return the partial outputs summed by
    `colo.tensor.comm_ops.AllReduceCopy`. Call it on the model built identically on every rank.

    Returns:
        ``model``.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"split_expert_ffns: axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    size, rank = mesh.size(axis), mesh.rank(axis)
    blocks = moe_blocks(model)
    for name, block in blocks:
        experts = block.experts
        if experts.tp_group is not None:
            raise ValueError(f"split_expert_ffns: the experts of {name!r} are already split over {axis!r}")
        intermediate = experts.w1.shape[1]
        if intermediate % size:
            raise ValueError(
                f"{axis}={size} does not divide the experts' intermediate size {intermediate} (block {name!r}); "
                f"choose {axis} dividing it"
            )
        width = intermediate // size
        for param_name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            full = getattr(experts, param_name)
            layout = layout_of(full)
            global_shape = layout.global_shape if layout is not None else tuple(full.shape)
            placements = {} if layout is None else dict(zip(layout.mesh.axis_names, layout.placements))
            piece = nn.Parameter(full.narrow(dim, rank * width, width).clone(), requires_grad=full.requires_grad)
            set_layout(piece, Layout(mesh, {**placements, axis: Shard(dim)}, global_shape))
            setattr(experts, param_name, piece)
        experts.tp_group = mesh.group(axis)
    return model
