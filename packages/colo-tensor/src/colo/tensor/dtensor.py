"""Conversion to and from ``torch.distributed.tensor.DTensor``, for interoperating with torch's own parallelism.

A colo `Mesh` maps to a torch ``DeviceMesh`` with the same axis names, built from the mesh's existing process
groups (``DeviceMesh.from_group``), so the conversion creates no process group and runs no collective. The
placements map one to one (``Shard(d)``, ``Replicate()``, ``Partial(reduce)``), and both split uneven
dimensions with ``torch.chunk`` semantics and nest shards of one dimension outer axis first, so the local
pieces are the same tensors on both sides.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from colo.comm import Mesh

from .layout import Layout, require_layout, set_layout
from .placement import PARTIAL_REDUCTIONS, Partial, Placement, Replicate, Shard

if TYPE_CHECKING:  # torch.distributed.tensor takes over half a second to import: only on use
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

_device_meshes: weakref.WeakKeyDictionary[Mesh, dict[str, DeviceMesh]] = weakref.WeakKeyDictionary()


def device_mesh_of(mesh: Mesh, *, device_type: str = "cpu") -> DeviceMesh:
    """The torch ``DeviceMesh`` of ``mesh`` (same axis names and ranks, sharing its process groups); cached.

    Args:
        mesh: the colo mesh.
        device_type: ``"cpu"`` or ``"cuda"``: where the DTensors' local tensors live.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"device_mesh_of: mesh must be a colo.comm.Mesh, not {type(mesh).__name__}")
    from torch.distributed.device_mesh import DeviceMesh

    per_device = _device_meshes.setdefault(mesh, {})
    if device_type not in per_device:
        ranks = torch.tensor(mesh.ranks, dtype=torch.int64).view(*mesh.shape.values())
        groups = [mesh.group(axis).process_group for axis in mesh.axis_names]
        per_device[device_type] = DeviceMesh.from_group(
            groups if len(groups) > 1 else groups[0], device_type, mesh=ranks, mesh_dim_names=mesh.axis_names
        )
    return per_device[device_type]


def _to_torch_placement(placement: Placement):
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    if isinstance(placement, Shard):
        return TorchShard(placement.dim)
    if isinstance(placement, Replicate):
        return TorchReplicate()
    return TorchPartial(placement.reduce)


def _from_torch_placement(placement, axis: str) -> Placement:
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    if type(placement) is TorchShard:
        return Shard(placement.dim)
    if isinstance(placement, TorchShard):
        raise ValueError(
            f"from_dtensor: axis {axis!r} has {placement!r}, a strided shard colo layouts do not express; "
            "redistribute the DTensor to plain Shard/Replicate placements first"
        )
    if isinstance(placement, TorchReplicate):
        return Replicate()
    if isinstance(placement, TorchPartial):
        if placement.reduce_op not in PARTIAL_REDUCTIONS:
            raise ValueError(
                f"from_dtensor: axis {axis!r} is Partial({placement.reduce_op!r}); colo supports Partial "
                f"{PARTIAL_REDUCTIONS}; redistribute it to Replicate first"
            )
        return Partial(placement.reduce_op)
    raise ValueError(f"from_dtensor: axis {axis!r} has placement {placement!r}, which colo does not know")


def to_dtensor(tensor: torch.Tensor) -> DTensor:
    """A ``DTensor`` over the same ranks whose local tensor is ``tensor`` (no copy, no communication).

    Args:
        tensor: a local piece with a colo layout (from `distribute`, `redistribute` or a parallel layer).

    Returns:
        The DTensor, on the ``DeviceMesh`` given by `device_mesh_of` for the layout's mesh.
    """
    from torch.distributed.tensor import DTensor

    layout = require_layout(tensor, "to_dtensor")
    device_mesh = device_mesh_of(layout.mesh, device_type=tensor.device.type)
    shape = layout.global_shape
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        tensor,
        device_mesh,
        [_to_torch_placement(p) for p in layout.placements],
        run_check=False,
        shape=shape,
        stride=stride,
    )


def from_dtensor(dtensor: DTensor, mesh: Mesh) -> torch.Tensor:
    """The local tensor of ``dtensor`` with the equivalent colo layout on ``mesh`` attached (no copy).

    Args:
        dtensor: a DTensor whose device mesh has ``mesh``'s shape (and axis names, if it has names) and ranks.
        mesh: the colo mesh to express its layout on.

    Raises:
        ValueError: the meshes differ, or a placement has no colo equivalent (strided shards, ``Partial("min")``).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(dtensor, DTensor):
        raise TypeError(f"from_dtensor: expected a torch DTensor, not {type(dtensor).__name__}")
    device_mesh = dtensor.device_mesh
    names = device_mesh.mesh_dim_names
    if tuple(device_mesh.shape) != tuple(mesh.shape.values()) or (names is not None and names != mesh.axis_names):
        raise ValueError(
            f"from_dtensor: the DTensor's device mesh has shape {tuple(device_mesh.shape)} and axes {names}, but the "
            f"colo mesh is {mesh.shape}; pass the colo mesh the DTensor was laid out on"
        )
    if tuple(device_mesh.mesh.flatten().tolist()) != tuple(mesh.ranks):
        raise ValueError(
            f"from_dtensor: the DTensor's device mesh holds ranks {device_mesh.mesh.flatten().tolist()} but the colo "
            f"mesh holds {list(mesh.ranks)}; pass the colo mesh over the same ranks"
        )
    placements = [_from_torch_placement(p, axis) for p, axis in zip(dtensor.placements, mesh.axis_names)]
    return set_layout(dtensor.to_local(), Layout(mesh, placements, dtensor.shape))
