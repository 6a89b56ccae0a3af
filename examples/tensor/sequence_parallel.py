"""One transformer block, three sequence-parallel plans on 2 ranks: Megatron-SP over tp, Ulysses and ring over sp."""

import copy

import torch
from torch import nn

from colo.comm import Mesh, launch
from colo.kernels import flash_attention
from colo.tensor import (
    Colwise,
    FusedQKV,
    PrepareInput,
    Replicate,
    RingAttention,
    Rowwise,
    SequenceParallel,
    Shard,
    UlyssesAttention,
    parallelize,
    shard_sequence,
)


class Core(nn.Module):  # the attention core: a module core(q, k, v) on (batch, seq, heads, head_dim), `causal`
    causal = True

    def forward(self, q, k, v):
        return flash_attention(q, k, v, causal=self.causal)


class Attention(nn.Module):  # architecture only: no parallelism in the model
    def __init__(self, dim=32, num_heads=4, num_kv_heads=2):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.wqkv = nn.Linear(dim, (num_heads + 2 * num_kv_heads) * self.head_dim)
        self.core, self.wo = Core(), nn.Linear(dim, dim)

    def forward(self, x):
        heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]  # this rank's counts once sharded
        q, k, v = self.wqkv(x).unflatten(-1, (-1, self.head_dim)).split(heads, dim=2)
        return self.wo(self.core(q, k, v).flatten(2))


class Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm = nn.RMSNorm(dim), Attention(dim), nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.layers, self.norm, self.out = nn.ModuleList([Block(dim), Block(dim)]), nn.RMSNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


# Megatron-SP over tp: activations between the tp regions are split along the sequence (dim 1)
MEGATRON_SP = {
    "layers.0": PrepareInput(Replicate(), Shard(1)),  # the input enters the sequence-parallel region
    "layers.*.attn_norm": SequenceParallel(),
    "layers.*.mlp_norm": SequenceParallel(),
    "layers.*.attn.wqkv": FusedQKV(input_layout=Shard(1)),
    "layers.*.attn.wo": Rowwise(output_layout=Shard(1)),
    "layers.*.mlp.0": Colwise(input_layout=Shard(1)),
    "layers.*.mlp.2": Rowwise(output_layout=Shard(1)),
    "norm": SequenceParallel(),
    "out": Colwise(input_layout=Shard(1), gather_output=True),  # every rank gets the whole output
}
# Ulysses or ring attention over sp: every rank holds its part of the sequence (shard_sequence) from the data on
ULYSSES = {"layers.*.attn.core": UlyssesAttention()}  # contiguous halves
RING = {"layers.*.attn.core": RingAttention(layout="zigzag")}  # rank r holds chunks r and 3 - r of 4


def step():
    torch.manual_seed(0)  # the same weights and data on every rank
    reference, x = Model(), torch.randn(2, 16, 32)
    expected = reference(x)

    model = parallelize(copy.deepcopy(reference), mesh=Mesh(tp=2), plan=MEGATRON_SP)
    torch.testing.assert_close(model(x), expected)  # not bit-identical: row-parallel sums run in another order

    sp_mesh = Mesh(sp=2)
    for plan, layout in [(ULYSSES, "contiguous"), (RING, "zigzag")]:
        model = parallelize(copy.deepcopy(reference), mesh=sp_mesh, plan=plan, axis="sp")
        shard = dict(num_shards=2, rank=sp_mesh.rank("sp"), layout=layout)
        torch.testing.assert_close(model(shard_sequence(x, **shard)), shard_sequence(expected, **shard))
    return "megatron-sp, ulysses, ring"


if __name__ == "__main__":
    modes = launch(step, 2, backend="gloo")  # 2 CPU processes; or torchrun + init_distributed()
    print(f"ok: {modes[0]} on 2 ranks match the single-process model")
