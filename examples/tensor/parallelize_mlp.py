"""Tensor-parallel MLP on 2 ranks: a plan applied from outside the model, built from the meta device."""

import torch
from torch import nn

from colo.comm import CommTracker, Mesh, launch
from colo.tensor import Colwise, Rowwise, ShardedRNG, layout_of, parallelize, seed_tensor_parallel


class MLP(nn.Module):  # architecture only: no parallelism in the model file
    def __init__(self, dim=64):
        super().__init__()
        self.up, self.dropout, self.down = nn.Linear(dim, 4 * dim), nn.Dropout(0.1), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(self.dropout(torch.relu(self.up(x))))


def step():
    mesh = Mesh(tp=2)
    rng = seed_tensor_parallel(1234, mesh=mesh)  # dropout: same masks where replicated, own where sharded
    torch.manual_seed(0)
    reference = MLP()  # the unsharded model, to check against
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MLP()  # no memory; materialized one module at a time below, with the eager path's draws
    plan = {"up": Colwise(), "down": Rowwise(), "dropout": ShardedRNG(rng)}
    parallelize(model, mesh=mesh, plan=plan, materialize="cpu")
    assert torch.equal(model.up.weight, reference.up.weight.chunk(2)[mesh.rank("tp")])  # this rank's rows

    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)  # same on every rank
    with CommTracker() as comm:  # one all-reduce of b*s*h in forward, one in backward
        model(x).sum().backward()
    model.eval()  # without dropout the sharded model computes the unsharded one
    reference.eval()
    torch.testing.assert_close(model(x), reference(x))  # not bit-identical: the row-parallel sum is reordered
    return repr(layout_of(model.up.weight)), comm.calls("all_reduce"), comm.bytes()


if __name__ == "__main__":
    results = launch(step, 2, backend="gloo")  # 2 CPU processes; or torchrun + init_distributed()
    layout, calls, volume = results[0]
    assert results[1] == results[0] and calls == 2 and volume == 2 * 2 * 8 * 64 * 4, results
    print(f"ok: {layout}, {calls} all-reduces, {volume:.0f} bytes per rank, matches the unsharded MLP")
