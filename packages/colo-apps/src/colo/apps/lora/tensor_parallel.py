"""LoRA adapters under tensor parallelism: sharded to match the layer they adapt (as Megatron-LM's LoRA does).

A model plan (`colo.apps.booster.ModelPlan`) knows the model's own modules, not ``peft``'s wrappers. So the
Booster hides the wrappers while the plan runs (`detach_lora_layers`: each ``lora.Linear`` is replaced by its
``base_layer``), lets the plan shard the base layers, and then puts each wrapper back around whatever the plan
made of its base (`attach_lora_layers`), sharding the adapters to match:

- column-parallel base (``ColumnParallelLinear``, the fused ``QKVParallelLinear``): ``A`` replicated, ``B`` split
  by output rows exactly like the base (for q/k/v: the same heads). ``B``'s layer all-reduces the gradient of its
  ``r``-wide input in backward, so ``A``'s gradient and the input gradient are complete on every rank: one
  all-reduce of ``tokens x r`` per adapted layer.
- row-parallel base (``RowParallelLinear``): ``A`` split by input columns like the base, its ``r``-wide output
  all-reduced in forward (``tokens x r``), ``B`` replicated.
- Megatron sequence parallelism: the sequence-parallel versions of those layers (the adapter gathers or
  reduce-scatters its ``r``-wide activations along the sequence like its base), and the replicated adapter matrix
  (``A`` of a column base, ``B`` of a row base) sums its gradient over the axis, as a norm's weight does.
- a base the plan left as a plain ``nn.Linear`` keeps replicated adapters.

Each adapted layer then computes this rank's block of the same ``x W^T + scaling * x A^T B^T`` the unsharded
model computes, and `colo.apps.lora.merge_lora` adds this rank's block of ``scaling * B A`` to the base shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from colo.comm import Mesh
from colo.tensor import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SequenceParallelColumnLinear,
    SequenceParallelQKVLinear,
    SequenceParallelRowLinear,
    sum_gradients_over,
)

from .adapters import LORA_SEEDS_ATTR, check_plain_lora, init_lora_adapter, lora_layers


@dataclass
class DetachedLora:
    """A LoRA wrapper taken out of its parent while a plan runs.

    Attributes:
        name: the wrapper's qualified name (for messages).
        parent: the module holding it.
        attr: its attribute name in ``parent``.
        layer: the ``peft`` LoRA layer.
        base: the base layer the plan saw in its place.
    """

    name: str
    parent: nn.Module
    attr: str
    layer: nn.Module
    base: nn.Module


def detach_lora_layers(model: nn.Module) -> list[DetachedLora]:
    """Replace every ``peft`` LoRA layer of ``model`` by its base layer, in place; returns what to reattach."""
    detached = []
    for name, layer in list(lora_layers(model)):
        check_plain_lora(name, layer)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else None
        if parent is None:
            raise ValueError("the model itself is a LoRA layer; adapt the linears inside a model instead")
        base = layer.get_base_layer()
        setattr(parent, attr, base)
        detached.append(DetachedLora(name, parent, attr, layer, base))
    return detached


@torch.no_grad()
def materialize_lora_adapters(detached: list[DetachedLora], *, device: torch.device, seed: int) -> None:
    """Give adapters still on the meta device (``add_lora`` on a meta-device model) real, unsharded values on
    ``device``, the same on every rank: those `colo.apps.lora.add_lora` gives an eager model
    (`colo.apps.lora.init_lora_adapter`), from the seed ``add_lora`` was given (``seed`` for adapters it did not
    add). Adapters are small (``r * (in + out)`` per layer), so each rank holds them whole until
    `attach_lora_layers` shards them; the base layers stay on the meta device for the plan to materialize shard by
    shard."""
    for item in detached:
        seeds = getattr(item.layer, LORA_SEEDS_ATTR, None) or {}
        for adapter in item.layer.lora_A.keys():
            lora_a, lora_b = item.layer.lora_A[adapter], item.layer.lora_B[adapter]
            if not (lora_a.weight.is_meta or lora_b.weight.is_meta):
                continue
            lora_a.to_empty(device=device)
            lora_b.to_empty(device=device)
            init_lora_adapter(item.layer, item.name, adapter, seed=seeds.get(adapter, seed))


def restore_lora_layers(detached: list[DetachedLora]) -> None:
    """Put the wrappers back around their original base layers (after a plan failed before sharding them)."""
    for item in detached:
        if getattr(item.parent, item.attr) is item.base:
            setattr(item.parent, item.attr, item.layer)


def attach_lora_layers(detached: list[DetachedLora], *, mesh: Mesh | None, axis: str = "tp") -> None:
    """Put each wrapper back around what the plan made of its base, sharding its adapters to match.

    Args:
        detached: from `detach_lora_layers`.
        mesh: the mesh the plan sharded over (``None``: nothing was sharded).
        axis: the tensor-parallel axis. Default: ``"tp"``.

    Raises:
        ValueError: the plan turned a base layer into a module whose adapters colo cannot shard (e.g. a
            vocabulary-parallel embedding).
    """
    for item in detached:
        sharded = getattr(item.parent, item.attr)
        if sharded is not item.base:
            for adapter in list(item.layer.lora_A.keys()):
                _shard_adapter(item, sharded, adapter, mesh=mesh, axis=axis)
        item.layer.base_layer = sharded
        setattr(item.parent, item.attr, item.layer)


def _shard_adapter(item: DetachedLora, base: nn.Module, adapter: str, *, mesh: Mesh | None, axis: str) -> None:
    lora_a, lora_b = item.layer.lora_A[adapter], item.layer.lora_B[adapter]
    if mesh is None:
        raise ValueError(f"{item.name!r}: the plan replaced the base layer but no mesh was given to shard adapters")
    group = mesh.group(axis)
    if isinstance(base, QKVParallelLinear):
        kwargs = {"num_heads": base.num_heads, "num_kv_heads": base.num_kv_heads, "mesh": mesh, "axis": axis}
        if isinstance(base, SequenceParallelQKVLinear):
            new_b = SequenceParallelQKVLinear.from_linear(lora_b, sequence_dim=base.sequence_dim, **kwargs)
            sum_gradients_over(lora_a, group)
        else:
            new_b = QKVParallelLinear.from_linear(lora_b, **kwargs)
        item.layer.lora_B[adapter] = new_b
    elif isinstance(base, ColumnParallelLinear):
        kwargs = {"mesh": mesh, "axis": axis, "gather_output": base.gather_output}
        if isinstance(base, SequenceParallelColumnLinear):
            new_b = SequenceParallelColumnLinear.from_linear(lora_b, sequence_dim=base.sequence_dim, **kwargs)
            sum_gradients_over(lora_a, group)
        else:
            new_b = ColumnParallelLinear.from_linear(lora_b, **kwargs)
        item.layer.lora_B[adapter] = new_b
    elif isinstance(base, RowParallelLinear):
        kwargs = {"mesh": mesh, "axis": axis, "input_is_parallel": base.input_is_parallel}
        if isinstance(base, SequenceParallelRowLinear):
            new_a = SequenceParallelRowLinear.from_linear(lora_a, sequence_dim=base.sequence_dim, **kwargs)
            sum_gradients_over(lora_b, group)
        else:
            new_a = RowParallelLinear.from_linear(lora_a, **kwargs)
        item.layer.lora_A[adapter] = new_a
    else:
        raise ValueError(
            f"{item.name!r}: the plan made its base layer a {type(base).__name__}; colo shards LoRA adapters of "
            "column-, row- and q/k/v-parallel linears only: leave this module out of the LoRA target_modules"
        )
    for module in (item.layer.lora_A[adapter], item.layer.lora_B[adapter]):
        for param in module.parameters():
            param.requires_grad_(True)
