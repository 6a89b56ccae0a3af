"""`parallelize_dit`: tensor parallelism for colo's `DiffusionTransformer`, applied from outside (Megatron-LM,
Shoeybi et al., 2019), as a `colo.tensor.parallelize` plan over one mesh axis:

- every block's self- and cross-attention: ``to_q`` / ``to_k`` / ``to_v`` column-parallel (whole heads per rank;
  the cross-attention's keys and values read the replicated caption), ``to_out.0`` row-parallel (one all-reduce
  forward, one for the input gradient backward);
- every block's MLP: ``ff.net.0.proj`` column-parallel, ``ff.net.2`` row-parallel.

Replicated: the patch embedding, adaLN-single (one MLP for the whole model), the caption projection, the blocks'
scale-shift tables, the output norm's table and ``proj_out``: their inputs and output gradients are the same on
every rank, so their gradients are too. Parameter names do not change (each rank holds its slice of the
``PixArtTransformer2DModel``-named tensors), so the common checkpoint format saves and re-shards them.
"""

from __future__ import annotations

from torch import nn

from colo.comm import Mesh
from colo.tensor import Colwise, ParallelStyle, Rowwise, parallelize

from .config import DiTConfig


def dit_tp_plan() -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of `DiffusionTransformer` (see the module docstring): pattern -> style."""
    plan: dict[str, ParallelStyle] = {}
    for attention in ("attn1", "attn2"):
        for projection in ("to_q", "to_k", "to_v"):
            plan[f"transformer_blocks.*.{attention}.{projection}"] = Colwise()
        plan[f"transformer_blocks.*.{attention}.to_out.0"] = Rowwise()
    plan["transformer_blocks.*.ff.net.0.proj"] = Colwise()
    plan["transformer_blocks.*.ff.net.2"] = Rowwise()
    return plan


def check_dit_tp_size(config: DiTConfig, tp: int) -> None:
    """Raise a `ValueError` naming the config field when ``tp`` ranks cannot split the heads."""
    heads = config.num_attention_heads
    if heads % tp:
        valid = [size for size in range(1, heads + 1) if heads % size == 0]
        raise ValueError(
            f"tp={tp} does not divide DiTConfig.num_attention_heads={heads} (each rank computes whole heads); choose "
            f"tp in {valid}"
        )


def parallelize_dit(model: nn.Module, *, mesh: Mesh, tp_axis: str = "tp") -> nn.Module:
    """Shard a `DiffusionTransformer` over ``tp_axis`` with `dit_tp_plan`, in place.

    Args:
        model (nn.Module): the unsharded model, the same on every rank.
        mesh (Mesh): the mesh; must have ``tp_axis``.
        tp_axis (str): the tensor-parallel mesh axis. Default: ``"tp"``.

    Returns:
        nn.Module: ``model``.

    Raises:
        TypeError: ``model`` has no `DiTConfig`.
        ValueError: ``tp_axis`` is not on the mesh or its size does not divide the heads.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, DiTConfig):
        raise TypeError(f"parallelize_dit: model must be a DiffusionTransformer, not {type(model).__name__}")
    if tp_axis not in mesh.axis_names:
        raise ValueError(
            f"parallelize_dit: the mesh has axes {mesh.axis_names} and no {tp_axis!r}; build it with "
            f"Mesh(..., {tp_axis}=N) or pass tp_axis="
        )
    check_dit_tp_size(config, mesh.size(tp_axis))
    return parallelize(model, mesh, dit_tp_plan(), axis=tp_axis)
