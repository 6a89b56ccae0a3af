"""Average a gradient over the data-parallel axis of a 2-rank mesh and count the bytes it moved."""

import torch

from colo.comm import CommTracker, Mesh, all_reduce, launch


def step():
    mesh = Mesh(dp=2)  # axes outermost to innermost: Mesh(dp=2, tp=2) on 4 ranks puts each tp group on neighbours
    grad = torch.full((1024,), float(mesh.rank("dp")))  # rank 0 holds zeros, rank 1 ones
    with CommTracker() as tracker:
        all_reduce(grad, op="avg", group=mesh.group("dp"))
    assert torch.equal(grad, torch.full((1024,), 0.5))
    return tracker.bytes("all_reduce", axis="dp")  # ring all-reduce: 2 (n-1)/n * 4096 bytes = 4096


if __name__ == "__main__":  # launch spawns the ranks, which import this file again: keep the launch under the guard
    # 2 local processes over gloo, on any machine (the tensors are on the CPU; one GPU cannot hold 2 NCCL ranks);
    # under torchrun, call colo.comm.init_distributed() and step() instead
    volumes = launch(step, 2, backend="gloo")
    assert volumes == [4096, 4096], volumes
    print(f"ok: all_reduce avg over dp=2, {volumes[0]:.0f} bytes per rank")
