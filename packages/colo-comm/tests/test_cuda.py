"""The NCCL path on a CUDA device: init picks NCCL, collectives and the tracker work on device tensors.

The lent GPU machines have one GPU, so this runs single-rank; multi-rank behaviour is covered by the same code
on gloo in the other tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from colo.comm import CommTracker, Mesh, all_gather, all_reduce, all_to_all, broadcast, init_distributed, reduce_scatter
from colo.comm.testing import requires_cuda, run_distributed


def _nccl_collectives():
    info = init_distributed()
    assert info.backend == "nccl" and info.device.type == "cuda"
    mesh = Mesh(dp=1)
    group = mesh.group("dp")
    x = torch.arange(8, dtype=torch.bfloat16, device="cuda")
    with CommTracker() as tracker:
        torch.testing.assert_close(all_reduce(x.clone(), "avg", group=group), x)
        torch.testing.assert_close(all_gather(x, group=group, sizes=[8]), x)
        torch.testing.assert_close(reduce_scatter(x, group=group), x)
        torch.testing.assert_close(all_to_all(x, group=group), x)
        torch.testing.assert_close(broadcast(x.clone(), src=0, group=group), x)
    return dist.get_backend(), tracker.calls()


@requires_cuda
def test_collectives_on_nccl_single_rank():
    assert run_distributed(_nccl_collectives, world_size=1, backend="nccl") == [("nccl", 5)]
