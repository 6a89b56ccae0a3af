"""`parallelize(model, mesh, plan)`: patterns select modules atom by atom, styles replace or wrap them, a sharded
model equals the unsharded one (forward and backward), a Megatron MLP block communicates exactly one all-reduce
of b*s*h in forward and one in backward, activations convert between layouts with the named steps, and every
mistake in a plan is an error naming the pattern and the module, raised before the model changes.

Tolerances: float32, rtol=1e-5, atol=1e-6: row-parallel outputs and column-parallel input gradients are sums
of per-rank partial products (another reduction order than the unsharded matmul); weights compare exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.tensor import (
    ColumnParallelLinear,
    Colwise,
    FusedQKV,
    Partial,
    PrepareInput,
    PrepareOutput,
    Replicate,
    RowParallelLinear,
    Rowwise,
    Shard,
    ShardedRNG,
    VocabParallel,
    VocabParallelEmbedding,
    convert_activation,
    layout_of,
    match_modules,
    parallelize,
    seed_tensor_parallel,
)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
DIM, VOCAB, PADDED_VOCAB = 8, 11, 12  # the embedding's rows are padded by VocabParallel, the head's by the model


class MLP(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 4 * DIM, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down, self.dropout = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.dropout(F.gelu(self.up(self.norm(x)))))


class TinyLM(nn.Module):
    def __init__(self, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MLP() for _ in range(num_layers))
        self.head = nn.Linear(DIM, PADDED_VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


LM_PLAN = {
    "embed": VocabParallel(),
    "layers.*.up": Colwise(),
    "layers.*.down": Rowwise(),
    "head": Colwise(gather_output=True),
}


def test_patterns_match_one_atom_at_a_time():
    model = TinyLM()
    assert match_modules(model, "layers.*.up") == ["layers.0.up", "layers.1.up"]
    assert match_modules(model, "layers.1.*") == ["layers.1.norm", "layers.1.up", "layers.1.down", "layers.1.dropout"]
    assert match_modules(model, "*.up") == []  # '*' never crosses a dot
    assert match_modules(model, "**.up") == ["layers.0.up", "layers.1.up"]
    assert match_modules(model, "layers.[0].d*") == ["layers.0.down", "layers.0.dropout"]
    assert match_modules(model, "") == [""]
    assert match_modules(model, "**") == [name for name, _ in model.named_modules()]


def _lm(tp):
    mesh = Mesh(tp=tp)
    torch.manual_seed(0)
    reference = TinyLM()
    torch.manual_seed(0)
    model = parallelize(TinyLM(), mesh, LM_PLAN)  # positional mesh and plan work too
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 5, PADDED_VOCAB, generator=torch.Generator().manual_seed(2))
    (reference(ids) * grad).sum().backward()
    logits = model(ids)
    (logits * grad).sum().backward()
    pairs = {"logits": (logits.detach(), reference(ids).detach())}
    exact = {}
    for name, param in model.named_parameters():
        full = reference.get_parameter(name)
        if name == "embed.weight":  # the vocabulary is padded to a multiple of tp; padding rows are zero
            padded = torch.zeros(layout_of(param).global_shape)
            padded[:VOCAB] = full.detach()
            padded_grad = torch.zeros(layout_of(param).global_shape)
            padded_grad[:VOCAB] = full.grad
            full, full_grad = padded, padded_grad
        else:
            full, full_grad = full.detach(), full.grad
        exact[name] = (param.detach(), layout_of(param).local_slice(full))
        pairs[f"{name}.grad"] = (param.grad, layout_of(param).local_slice(full_grad))
    kinds = {name: type(module).__name__ for name, module in model.named_modules() if name}
    return {"pairs": pairs, "exact": exact, "kinds": kinds}


@pytest.mark.parametrize("tp", [2, 4])
def test_parallelized_model_equals_the_unsharded_one(tp):
    for result in run_distributed(_lm, tp, world_size=tp):
        for name, (got, expected) in result["pairs"].items():
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=name)
        for name, (got, expected) in result["exact"].items():
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
        kinds = result["kinds"]
        assert kinds["embed"] == VocabParallelEmbedding.__name__
        assert kinds["layers.0.up"] == kinds["layers.1.up"] == kinds["head"] == ColumnParallelLinear.__name__
        assert kinds["layers.0.down"] == RowParallelLinear.__name__
        assert kinds["layers.0.norm"] == "LayerNorm"


def _mlp_block_communication(batch, seq):
    mesh = Mesh(tp=2)
    tracker = seed_tensor_parallel(0, mesh=mesh)
    model = parallelize(
        MLP(dropout=0.1), mesh=mesh, plan={"up": Colwise(), "down": Rowwise(), "dropout": ShardedRNG(tracker)}
    )
    x = torch.randn(batch, seq, DIM, requires_grad=True)
    with CommTracker() as forward:
        y = model(x)
    with CommTracker() as backward:
        y.sum().backward()
    records = lambda t: [(r.op, r.axis, r.bytes) for r in t.records]  # noqa: E731
    return records(forward), records(backward)


def test_mlp_block_communicates_one_all_reduce_of_bsh_each_way():
    batch, seq, tp = 2, 3, 2
    # Megatron: the row-parallel output is all-reduced in forward and the column-parallel input gradient in
    # backward, each a (b, s, h) float32 tensor: ring volume 2 (n - 1) / n * b*s*h*4 bytes. Norm, residual and
    # the sharded-region dropout add nothing.
    one_all_reduce = [("all_reduce", "tp", 2 * (tp - 1) / tp * batch * seq * DIM * 4)]
    for forward, backward in run_distributed(_mlp_block_communication, batch, seq, world_size=2):
        assert forward == one_all_reduce
        assert backward == one_all_reduce


def _sequence_sharded_mlp():
    """The MLP between sequence-sharded activations: gather the sequence in, split it out."""
    mesh = Mesh(tp=2)
    rank = mesh.rank("tp")
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    plan = {"": PrepareInput(Shard(1), Replicate()), "up": Colwise(), "down": Rowwise()}
    parallelize(model, mesh=mesh, plan=plan)
    # a second pass adds another style to the root (a plan holds one style per pattern)
    parallelize(model, mesh=mesh, plan={"": PrepareOutput(Replicate(), Shard(1))})
    x = torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(2))
    x_ref = x.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    (y_ref * grad).sum().backward()
    x_local = x.chunk(2, 1)[rank].clone().requires_grad_(True)
    with CommTracker() as forward:
        y = model(x_local)
    with CommTracker() as backward:
        (y * grad.chunk(2, 1)[rank]).sum().backward()
    ops = lambda t: [(r.op, r.axis) for r in t.records]  # noqa: E731
    return {
        "y": (y.detach(), y_ref.detach().chunk(2, 1)[rank]),
        "x.grad": (x_local.grad, x_ref.grad.chunk(2, 1)[rank]),
        "up.weight.grad": (model.up.weight.grad, reference.up.weight.grad.chunk(2)[rank]),
        "norm.weight.grad": (model.norm.weight.grad, reference.norm.weight.grad),
        "ops": (ops(forward), ops(backward)),
    }


def test_prepare_input_and_output_convert_activations():
    for result in run_distributed(_sequence_sharded_mlp, world_size=2):
        ops = result.pop("ops")
        for name, (got, expected) in result.items():
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=name)
        # forward: gather the sequence, all-reduce the row-parallel output, split (local);
        # backward: gather the output gradient, all-reduce the column-parallel input gradient, split (local)
        assert ops == ([("all_gather", "tp"), ("all_reduce", "tp")], [("all_gather", "tp"), ("all_reduce", "tp")])


def _conversions():
    group = Mesh(tp=2).group("tp")
    cases = {
        "R->S": (Replicate(), Shard(1), False),
        "S->R": (Shard(1), Replicate(), False),
        "P->R": (Partial(), Replicate(), False),
        "P->S": (Partial(), Shard(0), False),
        "S->S": (Shard(0), Shard(1), False),
        "R->R partial grad": (Replicate(), Replicate(), True),
        "S->R partial grad": (Shard(1), Replicate(), True),
    }
    out = {}
    for name, (src, dst, partial_grad) in cases.items():
        x = torch.ones(4, 4, requires_grad=True)
        with CommTracker() as forward:
            y = convert_activation(x, src, dst, group=group, partial_grad=partial_grad)
        with CommTracker() as backward:
            y.sum().backward()
        out[name] = ([r.op for r in forward.records], [r.op for r in backward.records])
    return out


def test_activation_conversions_use_the_named_steps():
    result = run_distributed(_conversions, world_size=2)[0]
    assert result == {
        "R->S": ([], ["all_gather"]),
        "S->R": (["all_gather"], []),
        "P->R": (["all_reduce"], []),
        "P->S": (["reduce_scatter"], ["all_gather"]),
        "S->S": (["all_to_all"], ["all_to_all"]),
        "R->R partial grad": ([], ["all_reduce"]),
        "S->R partial grad": (["all_gather"], ["reduce_scatter"]),
    }


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))


class _ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class _Attention(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_heads
        self.wqkv = nn.Linear(DIM, 3 * num_heads * 2)


def _tied():
    model = TinyLM()
    model.head = nn.Linear(DIM, VOCAB, bias=False)
    model.head.weight = model.embed.weight
    return model


def _plan_errors():
    mesh = Mesh(tp=2)
    model = TinyLM()
    errors = {}
    cases = {
        "nothing": {"layers.*.attn.wq": Colwise()},
        "type": {"layers.*.norm": Colwise()},
        "embedding": {"embed": Rowwise()},
        "twice": {"layers.0.up": Colwise(), "layers.0.u*": Rowwise()},
        "axis": {"layers.0.up": Colwise(axis="mp")},
        "style": {"layers.0.up": "colwise"},
        "root": {"": Colwise()},
        "unknown rng stream": {"layers.0.dropout": ShardedRNG(seed_tensor_parallel(0, mesh=mesh), stream="other")},
    }
    for name, plan in cases.items():
        try:
            parallelize(model, mesh=mesh, plan=plan)
        except (TypeError, ValueError) as error:
            errors[name] = str(error)
    uneven = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, 11))
    for name, (module, plan, kwargs) in {
        "divides": (uneven, {"0": Colwise(), "1": Colwise()}, {}),
        "subclass": (nn.Sequential(_ScaledLinear(DIM, DIM)), {"0": Colwise()}, {}),
        "no head attrs": (_Attention(2), {"wqkv": FusedQKV(head_attrs=None)}, {}),
        "tied": (_tied(), {"embed": VocabParallel(), "head": Colwise()}, {}),
        "heads": (_Attention(3), {"wqkv": FusedQKV()}, {}),
        "head attrs": (_Attention(2), {"wqkv": FusedQKV(head_attrs=("heads", "kv_heads"))}, {}),
        "meta": (_Custom().to("meta"), {}, {"materialize": "cpu"}),
    }.items():
        try:
            parallelize(module, mesh=mesh, plan=plan, **kwargs)
        except (TypeError, ValueError) as error:
            errors[name] = str(error)
    return errors, type(uneven[0]) is nn.Linear  # the "divides" plan failed on '1': '0' is unchanged


def test_plan_errors_name_the_pattern_the_module_and_the_fix():
    errors, unchanged = run_distributed(_plan_errors, world_size=2)[0]
    assert unchanged
    assert (
        "plan pattern 'layers.*.attn.wq' matches no module of TinyLM; module names look like 'embed'"
        in (errors["nothing"])
    )
    assert (
        "Colwise(gather_output=False, axis=None) cannot handle 'layers.0.norm' (a LayerNorm, matched by "
        in (errors["type"])
    )
    assert "it applies to torch.nn.Linear" in errors["type"]
    assert "cannot handle 'embed' (a Embedding, matched by 'embed')" in errors["embedding"]
    assert "tp=2 does not divide out_features=11; choose tp in [1, 11]" in errors["divides"]
    assert "'1' (a Linear, matched by '1')" in errors["divides"]
    assert "module 'layers.0.up' is matched by 2 styles that replace it" in errors["twice"]
    assert "plan['layers.0.up'] uses mesh axis 'mp', but the mesh has axes ('tp',)" in errors["axis"]
    assert "plan['layers.0.up'] is 'colwise', not a style" in errors["style"]
    assert "cannot replace the root module" in errors["root"]
    assert "'0' (a _ScaledLinear, matched by '0'): it overrides torch.nn.Linear.forward" in errors["subclass"]
    assert "with head_attrs=None pass num_heads= explicitly" in errors["no head attrs"]
    assert (
        "module 'embed' is replaced, but its parameter is shared as ['embed.weight', 'head.weight']" in (errors["tied"])
    )
    assert "the tracker has no stream 'other'" in errors["unknown rng stream"]
    assert "tp=2 does not divide num_heads=3; choose tp in [1, 3]" in errors["heads"]
    assert "the parent module has no attribute 'heads' holding the head count" in errors["head attrs"]
    assert (
        "module '<root>' (_Custom) has parameters or buffers on the meta device and no reset_parameters()"
        in (errors["meta"])
    )
    assert "pass init_fn=" in errors["meta"]
