"""3D layers (`colo.tensor.tp3d`, 8 ranks, q=2) equal torch forward and backward: outputs and input gradients against
this rank's piece of the reference, weight gradients gathered through their layouts, with an odd batch (3: the batch
is split over tp_col, unevenly); a pre-norm transformer block (LayerNorm, GQA causal attention, GELU MLP) built from
them trains 3 AdamW steps like the single-process block (loss, every parameter); and CommTracker's bytes and calls
per layer equal `tp_cost.linear_3d` / `norm_3d` / `embedding_3d` / `vocab_embedding_3d` / `cross_entropy_3d` exactly.
The vocabulary-parallel embedding runs a batch of 4 (its reduce-scatter needs batch and sequence divisible by q).

Tolerances: float32, rtol=1e-5, atol=1e-5 for layers and gradients; parameters after AdamW atol=1e-4 (AdamW turns
rounding in near-zero gradient entries into steps of up to ~lr * 1e-2; a sharding mistake moves weights by ~lr).
Not bit-identical: the reduce-scatters sum partial products over q blocks of the reduction dimension, the norms sum
partial statistics, and weight gradients are summed over the batch pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import CommTracker, all_reduce
from colo.comm.testing import run_distributed
from colo.tensor import gather, layout_of, set_layout, tp_cost
from colo.tensor.tp3d import (
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    VocabParallelEmbedding3D,
    attention_3d,
    cross_entropy_3d,
    shard_3d,
)
from colo.tensor.tp_grid import grid_mesh

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 3, 4, 8, 4, 2, 2, 16
STEPS, LR = 3, 1e-2


def _data(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _gathered_grad(param):
    return gather(set_layout(param.grad.clone(), layout_of(param)))


def _layer_pairs(mesh):
    piece = lambda t, layout="A": shard_3d(t, mesh, layout, hidden_split=True)  # noqa: E731
    pairs = {}
    torch.manual_seed(0)  # every rank draws the same reference modules
    x, g_b = _data(BATCH, SEQ, HIDDEN, seed=1), _data(BATCH, SEQ, 12, seed=2)
    for name, in_axis, layout_in, layout_out in (("A->B", "tp_dep", "A", "B"), ("B->A", "tp_row", "B", "A")):
        reference = nn.Linear(HIDDEN, 12)
        x_ref = x.clone().requires_grad_(True)
        (reference(x_ref) * g_b).sum().backward()
        layer = Linear3D.from_linear(reference, mesh=mesh, in_axis=in_axis)
        x_local = piece(x, layout_in).requires_grad_(True)
        y = layer(x_local)
        (y * piece(g_b, layout_out)).sum().backward()
        pairs[f"linear {name}/y"] = (y.detach(), piece(reference(x).detach(), layout_out))
        pairs[f"linear {name}/x.grad"] = (x_local.grad, piece(x_ref.grad, layout_in))
        pairs[f"linear {name}/weight.grad"] = (_gathered_grad(layer.weight), reference.weight.grad)
        pairs[f"linear {name}/bias.grad"] = (_gathered_grad(layer.bias), reference.bias.grad)

    g = _data(BATCH, SEQ, HIDDEN, seed=3)
    for rms in (False, True):
        norm = nn.RMSNorm(HIDDEN, eps=1e-5) if rms else nn.LayerNorm(HIDDEN)
        with torch.no_grad():
            norm.weight.add_(0.1 * _data(HIDDEN, seed=4))
        x_ref = x.clone().requires_grad_(True)
        (norm(x_ref) * g).sum().backward()
        layer = LayerNorm3D(HIDDEN, mesh=mesh, rms=rms)
        layer.load_full(norm.weight.detach(), None if rms else norm.bias.detach())
        x_local = piece(x).requires_grad_(True)
        y = layer(x_local)
        (y * piece(g)).sum().backward()
        kind = "rmsnorm" if rms else "layernorm"
        pairs[f"{kind}/y"] = (y.detach(), piece(norm(x).detach()))
        pairs[f"{kind}/x.grad"] = (x_local.grad, piece(x_ref.grad))
        pairs[f"{kind}/weight.grad"] = (_gathered_grad(layer.weight), norm.weight.grad)

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    embedding = nn.Embedding(VOCAB, HIDDEN)
    (embedding(ids) * g).sum().backward()
    layer = Embedding3D(VOCAB, HIDDEN, mesh=mesh)
    layer.load_full(embedding.weight.detach())
    y = layer(ids)
    (y * piece(g)).sum().backward()
    pairs["embedding/y"] = (y.detach(), piece(embedding(ids).detach()))
    pairs["embedding/weight.grad"] = (_gathered_grad(layer.weight), embedding.weight.grad)

    ids_even = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(7))  # batch divisible by q
    g_even = _data(4, SEQ, HIDDEN, seed=8)
    embedding.zero_grad()
    (embedding(ids_even) * g_even).sum().backward()
    layer = VocabParallelEmbedding3D(VOCAB, HIDDEN, mesh=mesh)
    layer.load_full(embedding.weight.detach())
    y = layer(ids_even)
    (y * piece(g_even)).sum().backward()
    pairs["vocab_embedding/y"] = (y.detach(), piece(embedding(ids_even).detach()))
    pairs["vocab_embedding/weight.grad"] = (_gathered_grad(layer.weight), embedding.weight.grad)

    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    target[0, 0] = -100
    x_ref = x.clone().requires_grad_(True)
    loss_ref = F.cross_entropy(head(x_ref).flatten(0, 1), target.flatten())
    loss_ref.backward()
    layer = Linear3D.from_linear(head, mesh=mesh)
    x_local = piece(x).requires_grad_(True)
    loss = cross_entropy_3d(layer(x_local), shard_3d(target, mesh, "B"), mesh=mesh)
    loss.backward()
    pairs["lm_head/loss"] = (loss.detach(), loss_ref.detach())
    pairs["lm_head/x.grad"] = (x_local.grad, piece(x_ref.grad))
    pairs["lm_head/weight.grad"] = (_gathered_grad(layer.weight), head.weight.grad)
    return pairs


class Block(nn.Module):
    """Pre-norm block: LayerNorm, causal GQA attention (separate q, k, v), LayerNorm, GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q_proj(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o_proj(attn)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Block3D(nn.Module):
    """`Block` on the cube: the norms and residual in layout A, q/k/v and the MLP's inner activation in layout B."""

    def __init__(self, block: Block, mesh):
        super().__init__()
        self.mesh = mesh
        self.ln1, self.ln2 = LayerNorm3D(HIDDEN, mesh=mesh), LayerNorm3D(HIDDEN, mesh=mesh)
        self.ln1.load_full(block.ln1.weight.detach(), block.ln1.bias.detach())
        self.ln2.load_full(block.ln2.weight.detach(), block.ln2.bias.detach())
        for name in ("q_proj", "k_proj", "v_proj", "up"):
            setattr(self, name, Linear3D.from_linear(getattr(block, name), mesh=mesh, in_axis="tp_dep"))
        for name in ("o_proj", "down"):
            setattr(self, name, Linear3D.from_linear(getattr(block, name), mesh=mesh, in_axis="tp_row"))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q_proj(h).view(b, s, -1, HEAD_DIM)
        k, v = self.k_proj(h).view(b, s, -1, HEAD_DIM), self.v_proj(h).view(b, s, -1, HEAD_DIM)
        attn = attention_3d(q, k, v, mesh=self.mesh).reshape(b, s, -1)
        x = x + self.o_proj(attn)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _train_block(mesh):
    torch.manual_seed(0)
    reference = Block()
    block = Block3D(reference, mesh)
    names = dict(reference.named_parameters())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (reference, block)]
    mismatches = []
    for step in range(STEPS):
        x, g = _data(BATCH, SEQ, HIDDEN, seed=10 + step), _data(BATCH, SEQ, HIDDEN, seed=20 + step)
        loss_ref = (reference(x) * g).sum()
        loss_ref.backward()
        local = (block(shard_3d(x, mesh, hidden_split=True)) * shard_3d(g, mesh, hidden_split=True)).sum()
        local.backward()
        loss = all_reduce(local.detach().clone(), group=mesh.group("tp_dep", "tp_row", "tp_col"))
        try:
            torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=1e-5)
        except AssertionError as error:
            mismatches.append(f"loss step {step}: {error}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for name, param in block.named_parameters():
            expected = layout_of(param).local_slice(names[name].detach())
            try:
                torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-4)
            except AssertionError as error:
                mismatches.append(f"param {name} step {step}: {error}")
    return mismatches


def _traffic(mesh):
    x = shard_3d(_data(4, SEQ, HIDDEN, seed=1), mesh, hidden_split=True).requires_grad_(True)
    measured = {}
    for name, layer in {
        "linear": Linear3D(HIDDEN, 12, mesh=mesh),
        "linear_nobias": Linear3D(HIDDEN, 12, mesh=mesh, bias=False),
        "layernorm": LayerNorm3D(HIDDEN, mesh=mesh),
        "rmsnorm": LayerNorm3D(HIDDEN, mesh=mesh, rms=True),
    }.items():
        with CommTracker() as tracker:
            layer(x).pow(2).sum().backward()
        measured[name] = (tracker.bytes(), tracker.calls())
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    with CommTracker() as tracker:
        Embedding3D(VOCAB, HIDDEN, mesh=mesh)(ids).sum().backward()
    measured["embedding"] = (tracker.bytes(), tracker.calls())
    with CommTracker() as tracker:
        VocabParallelEmbedding3D(VOCAB, HIDDEN, mesh=mesh)(ids).sum().backward()
    measured["vocab_embedding"] = (tracker.bytes(), tracker.calls())
    logits = shard_3d(_data(4, SEQ, VOCAB, seed=2), mesh, "B", hidden_split=True).requires_grad_(True)
    with CommTracker() as tracker:
        cross_entropy_3d(logits, shard_3d(ids, mesh, "B"), mesh=mesh).backward()
    measured["cross_entropy"] = (tracker.bytes(), tracker.calls())
    return measured


def cube_cases():
    mesh = grid_mesh("3d", 8)
    return {"layers": _layer_pairs(mesh), "block": _train_block(mesh), "traffic": _traffic(mesh)}


def test_3d_layers_block_and_cost_model_on_8_ranks():
    tokens = 4 * SEQ
    expected = {
        "linear": tp_cost.linear_3d(tokens, HIDDEN, 12, 2),
        "linear_nobias": tp_cost.linear_3d(tokens, HIDDEN, 12, 2, bias=False),
        "layernorm": tp_cost.norm_3d(tokens, HIDDEN, 2, kind="layernorm"),
        "rmsnorm": tp_cost.norm_3d(tokens, HIDDEN, 2, kind="rmsnorm"),
        "embedding": tp_cost.embedding_3d(VOCAB, HIDDEN, 2),
        "vocab_embedding": tp_cost.vocab_embedding_3d(tokens, HIDDEN, 2),
        "cross_entropy": tp_cost.cross_entropy_3d(tokens, 2),
    }
    for result in run_distributed(cube_cases, world_size=8):
        for name, (got, want) in result["layers"].items():
            torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
        assert not result["block"], "\n".join(result["block"][:3])
        assert result["traffic"] == {name: (cost.bytes, cost.messages) for name, cost in expected.items()}
