"""Conversion to and from torch DTensor: same local pieces (uneven and nested shards too), no new process groups."""

from __future__ import annotations

import torch

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import Partial, Replicate, Shard, device_mesh_of, distribute, from_dtensor, layout_of, to_dtensor


def _round_trips():
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor

    mesh = Mesh(dp=2, tp=2)
    x = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    out = {}

    # colo -> DTensor: the DTensor's full tensor is x (for the partial one, DTensor does the reduction)
    for name, placements in {
        "uneven": [Shard(0), Shard(1)],
        "nested": [Shard(0), Shard(0)],
        "partial": [Partial("sum"), Replicate()],
    }.items():
        local = distribute(x, mesh, placements)
        dtensor = to_dtensor(local)
        shares_storage = dtensor.to_local().data_ptr() == local.data_ptr()
        out[f"to_{name}"] = (dtensor.full_tensor(), shares_storage, tuple(dtensor.placements))

    # DTensor -> colo: torch's own split of x gives exactly colo's pieces
    device_mesh = device_mesh_of(mesh)
    for name, placements in {
        "uneven": ([TorchShard(1), TorchShard(0)], [Shard(1), Shard(0)]),
        "nested": ([TorchShard(1), TorchShard(1)], [Shard(1), Shard(1)]),
        "replicate": ([TorchReplicate(), TorchShard(0)], [Replicate(), Shard(0)]),
    }.items():
        torch_placements, colo_placements = placements
        local = from_dtensor(distribute_tensor(x, device_mesh, torch_placements), mesh)
        out[f"from_{name}"] = (
            local,
            distribute(x, mesh, colo_placements),
            layout_of(local).placements,
            colo_placements,
        )

    out["cached"] = device_mesh_of(mesh) is device_mesh
    out["same_groups"] = all(device_mesh.get_group(axis) is mesh.group(axis).process_group for axis in mesh.axis_names)

    errors = {}
    try:
        from_dtensor(to_dtensor(distribute(x, mesh, [Shard(0), Replicate()])), Mesh(tp=4))
    except ValueError as error:
        errors["mesh"] = str(error)
    try:
        from torch.distributed.tensor import DTensor

        min_partial = DTensor.from_local(torch.ones(2), device_mesh, [TorchPartial("min"), TorchReplicate()])
        from_dtensor(min_partial, mesh)
    except ValueError as error:
        errors["partial"] = str(error)
    out["errors"] = errors
    return out


def test_to_and_from_dtensor_keep_the_same_local_pieces():
    x = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    for result in run_distributed(_round_trips, world_size=4):
        for name in ("uneven", "nested", "partial"):
            full, shares_storage, _ = result[f"to_{name}"]
            torch.testing.assert_close(full, x, rtol=0, atol=0)
            assert shares_storage, "to_dtensor wraps the local tensor without a copy"
        for name in ("uneven", "nested", "replicate"):
            from_torch, from_colo, placements, expected_placements = result[f"from_{name}"]
            torch.testing.assert_close(from_torch, from_colo, rtol=0, atol=0)
            assert list(placements) == expected_placements
        assert result["cached"] and result["same_groups"], "the DeviceMesh reuses the colo mesh's groups"
        assert "pass the colo mesh the DTensor was laid out on" in result["errors"]["mesh"]
        assert "colo supports Partial ('sum', 'avg', 'max')" in result["errors"]["partial"]
