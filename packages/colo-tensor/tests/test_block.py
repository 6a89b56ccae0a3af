"""A transformer block (RMSNorm, grouped-query attention with a fused QKV projection, LayerNorm, MLP, dropout in
sharded and replicated regions) parallelized with tp=2 by a plan matches the single-process block over 3 AdamW
steps: loss, every gradient (the sharded ones against the matching slice of the reference gradient) and every
parameter after each step.

Dropout: the residual dropouts sit in replicated regions and draw from the default generator, seeded with the
same base seed in the reference and on every rank. The attention-probability and MLP dropouts sit in sharded
regions and run under `ShardedRNG`, so rank r draws its mask from its own stream; the reference applies, to
each rank's slice of its heads / features, the mask drawn from a stream seeded exactly like rank r's
(`model_parallel_seed(seed, r)`) and advanced in the same order. So the masks agree element for element and
the comparison is tight.

Tolerances: float32, rtol=1e-5, atol=1e-6 (loss, gradients, parameters). Not bit-identical: the row-parallel
projections sum partial products over each rank's heads / features and then all-reduce, and the input gradients
of the column-parallel projections are summed over ranks, so reductions run in another order; AdamW's update
m / (sqrt(v) + eps) carries those roundings into the parameters at the level of lr * 1e-7 (except for the key
bias, whose gradient is pure rounding noise: see K_BIAS_NOTE).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import (
    Colwise,
    FusedQKV,
    RNGTracker,
    Rowwise,
    ShardedRNG,
    layout_of,
    model_parallel_seed,
    parallelize,
    seed_tensor_parallel,
)

DIM, NUM_HEADS, HIDDEN, P = 16, 4, 32, 0.25
BATCH, SEQ, STEPS, SEED = 2, 5, 3, 1234
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
LR = 1e-2
K_BIAS_NOTE = """The key bias's gradient is zero in exact arithmetic: it adds q . b_k to every score of a query, which
softmax ignores. Both runs' gradients are rounding noise (~1e-9, checked against 1e-6 like every gradient), and
AdamW divides by sqrt(v) + eps, scaling noise of either sign into steps of up to about lr: the key bias is only
checked to stay within 2 * lr * steps of the reference (each run moves it by at most about lr per step)."""
K_BIAS_ATOL = 2 * LR * STEPS


class Attention(nn.Module):
    """Causal grouped-query attention; architecture only (head counts are attributes a plan may rewrite)."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.wqkv = nn.Linear(dim, (num_heads + 2 * num_kv_heads) * self.head_dim)
        self.wo = nn.Linear(num_heads * self.head_dim, dim)
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        q, k, v = self.wqkv(x).split([self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], -1)
        q = q.reshape(b, s, self.num_heads, hd).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        k, v = (t.reshape(b, s, self.num_kv_heads, hd).transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = self.attn_dropout(scores.masked_fill(causal, float("-inf")).softmax(-1))
        return self.wo((probs @ v).transpose(1, 2).reshape(b, s, self.num_heads * hd))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.dropout(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, num_kv_heads: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.attn = Attention(DIM, NUM_HEADS, num_kv_heads, P)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.mlp = MLP(DIM, HIDDEN, P)
        self.resid_dropout = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.attn_norm(x)))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class ShardwiseDropout(nn.Module):
    """The reference's dropout for a sharded region: shard r of ``dim`` dropped with rank r's stream."""

    def __init__(self, p: float, dim: int, tracker: RNGTracker, num_shards: int):
        super().__init__()
        self.p, self.dim, self.tracker, self.num_shards = p, dim, tracker, num_shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = []
        for rank, piece in enumerate(x.chunk(self.num_shards, self.dim)):
            with self.tracker.fork(f"rank{rank}"):
                pieces.append(F.dropout(piece.contiguous(), self.p, self.training))
        return torch.cat(pieces, self.dim)


def _full_of(name: str, reference: nn.Module, *, grad: bool = False) -> torch.Tensor:
    """The unsharded value (or gradient) a parameter of the parallel block is a piece of.

    ``attn.wqkv.{q,k,v}_{weight,bias}`` are the q, k or v rows of the reference's fused ``attn.wqkv.{weight,bias}``.
    """
    module_name, _, attr = name.rpartition(".")
    part = None
    if module_name.endswith("wqkv"):
        part, attr = attr.split("_")
    param = reference.get_parameter(f"{module_name}.{attr}")
    full = param.grad if grad else param.detach()
    if part is None:
        return full
    attn = reference.attn
    return full.split([n * attn.head_dim for n in (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)])[
        "qkv".index(part)
    ]


def _train(num_kv_heads):
    mesh = Mesh(tp=2)
    tp = mesh.size("tp")
    torch.manual_seed(0)
    reference = Block(num_kv_heads)
    model = copy.deepcopy(reference)

    reference_streams = RNGTracker()
    for rank in range(tp):
        reference_streams.add(f"rank{rank}", model_parallel_seed(SEED, rank))
    reference.attn.attn_dropout = ShardwiseDropout(P, 1, reference_streams, tp)  # (b, heads, s, s): heads
    reference.mlp.dropout = ShardwiseDropout(P, -1, reference_streams, tp)  # (b, s, hidden): features

    tracker = seed_tensor_parallel(SEED, mesh=mesh)
    plan = {
        "attn.wqkv": FusedQKV(),
        "attn.wo": Rowwise(),
        "attn.attn_dropout": ShardedRNG(tracker),
        "mlp.up": Colwise(),
        "mlp.down": Rowwise(),
        "mlp.dropout": ShardedRNG(tracker),
    }
    parallelize(model, mesh=mesh, plan=plan)
    torch.manual_seed(SEED)  # the reference's replicated stream; the ranks' was seeded by seed_tensor_parallel
    reference_rng = torch.get_rng_state()

    generator = torch.Generator().manual_seed(7)
    data = [(torch.randn(BATCH, SEQ, DIM, generator=generator), torch.randn(BATCH, SEQ, DIM, generator=generator))]
    data *= STEPS
    mismatches, largest = [], {}

    def compare(what, got, expected):
        try:
            torch.testing.assert_close(got, expected, **TOLERANCE)
        except AssertionError as error:
            mismatches.append(f"{what}: {error}")
        difference = (got - expected).abs().max().item() if got.numel() else 0.0
        largest[what.split(" ")[0]] = max(largest.get(what.split(" ")[0], 0.0), difference)

    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (reference, model)]
    tp_rng = torch.get_rng_state()
    for step, (x, target) in enumerate(data):
        losses = []
        for module, rng in ((reference, reference_rng), (model, tp_rng)):
            torch.set_rng_state(rng)  # each model continues its own replicated stream
            loss = F.mse_loss(module(x), target)
            loss.backward()
            if module is reference:
                reference_rng = torch.get_rng_state()
            else:
                tp_rng = torch.get_rng_state()
            losses.append(loss.detach())
        compare(f"loss step {step}", losses[1], losses[0])
        for name, param in model.named_parameters():
            expected = layout_of(param).local_slice(_full_of(name, reference, grad=True))
            compare(f"grad {name} step {step}", param.grad, expected)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for name, param in model.named_parameters():
            expected = layout_of(param).local_slice(_full_of(name, reference))
            if name == "attn.wqkv.k_bias":  # see K_BIAS_NOTE
                close = (param.detach() - expected).abs().max().item() <= K_BIAS_ATOL
                zero = param.grad is None or param.grad.abs().max().item() <= 1e-6
                if not (close and zero):
                    mismatches.append(f"k_bias step {step}: close={close}, gradient ~0 {zero}")
                continue
            compare(f"param {name} step {step}", param.detach(), expected)
    return {"mismatches": mismatches, "largest": largest, "layers": sorted(type(m).__name__ for m in model.modules())}


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-heads-sharded", "kv-heads-replicated"])
def test_block_matches_single_process_over_three_adamw_steps(num_kv_heads):
    for result in run_distributed(_train, num_kv_heads, world_size=2):
        assert result["mismatches"] == [], "\n".join(result["mismatches"][:5])
        assert {"QKVParallelLinear", "ColumnParallelLinear", "RowParallelLinear"} <= set(result["layers"])
