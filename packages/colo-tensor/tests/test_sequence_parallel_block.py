"""One small transformer, three sequence-parallel plans, each matching the single-process model over 3 AdamW steps.

The model (an attention block with RMSNorm, fused grouped-query QKV, a causal attention core module and residual
dropout; an MLP block with LayerNorm and dropout; a final norm and projection) holds no parallelism. Only the
plan passed to `parallelize` changes:

- ``megatron-sp`` (tp=2): tensor parallelism with the activations between the tensor-parallel regions split
  along the sequence: ``FusedQKV`` / ``Colwise`` with ``input_layout=Shard(1)``, ``Rowwise`` with
  ``output_layout=Shard(1)``, `SequenceParallel` on the norms, the input split by ``PrepareInput`` and the output
  all-gathered by the last ``Colwise``; every rank computes the same loss on the full output.
- ``ulysses`` (sp=2): `UlyssesAttention` on the attention core; each rank holds a contiguous half of the sequence.
- ``ring`` (sp=2): `RingAttention` (zigzag) on the attention core; each rank holds its zigzag half.

For Ulysses and ring attention every rank computes the loss over its own tokens and the gradients are averaged
over sp afterwards (the data-parallel sync of weights replicated over ("dp", "sp")); the mean of equal-sized
local means is the global mean.

Dropout on sequence shards runs under `ShardedRNG`, so rank r draws its masks from its own stream; the reference
applies, to the positions rank r holds, a mask drawn from a stream seeded like rank r's, in the same order. The
comparison (loss, every gradient against the matching slice of the reference gradient, every parameter after
each step) is then tight.

Tolerances: float32; loss and gradients rtol=1e-5, atol=1e-6 (measured: at most 1.2e-7 and 6e-8); parameters
rtol=1e-5, atol=5e-6 (measured: at most 2.6e-6). Not bit-identical: sums run in another order (row-parallel
partial products reduced across ranks, sequence-shard gradients of replicated weights summed across ranks, ring
attention's per-block softmax merged by log-sum-exp, attention on fewer heads at a time). AdamW's step
lr * m / (sqrt(v) + eps) carries those roundings into the parameters, mostly at the level of lr * 1e-7, but it
amplifies them where a gradient is small: one element of attn.wo.weight has a gradient of 3e-7, where a 3e-9
rounding difference moves the first step by 2.6e-6 (the parameters' atol). The key bias is the extreme case,
noted in test_block: its gradient is rounding noise (zero in exact arithmetic), which AdamW scales up to about
lr per step, so it is only checked to stay within 2 * lr * steps of the reference.

Communication of the first step's forward and backward is asserted against each mode's formula (CommTracker).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colo.comm import CommTracker, Mesh, all_reduce
from colo.comm.testing import run_distributed
from colo.kernels import flash_attention
from colo.tensor import (
    Colwise,
    FusedQKV,
    PrepareInput,
    Replicate,
    RingAttention,
    RNGTracker,
    Rowwise,
    SequenceParallel,
    Shard,
    ShardedRNG,
    UlyssesAttention,
    layout_of,
    model_parallel_seed,
    parallelize,
    seed_tensor_parallel,
    shard_positions,
    shard_sequence,
)

DIM, NUM_HEADS, NUM_KV_HEADS, HIDDEN, P = 16, 4, 2, 32, 0.25
HEAD_DIM = DIM // NUM_HEADS
BATCH, SEQ, STEPS, SEED, LR = 2, 8, 3, 1234, 1e-2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOLERANCE = {"rtol": 1e-5, "atol": 5e-6}
K_BIAS_ATOL = 2 * LR * STEPS
FLOAT_BYTES = 4


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v on (batch, seq, heads, head_dim); the module the SP styles act on."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention(q, k, v, causal=self.causal)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
        self.wqkv = nn.Linear(DIM, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
        self.core = CoreAttention(causal=True)
        self.wo = nn.Linear(NUM_HEADS * HEAD_DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)
        b, s, _ = qkv.shape  # the whole sequence under Megatron-SP (wqkv gathers it), a shard under Ulysses / ring
        sizes = [n * self.head_dim for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.split(sizes, -1))
        return self.wo(self.core(q, k, v).reshape(b, s, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM), nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.dropout(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(DIM), Attention()
        self.mlp_norm, self.mlp = nn.LayerNorm(DIM), MLP()
        self.resid_dropout = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.attn_norm(x)))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block()])
        self.norm, self.out = nn.RMSNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


MODES = {  # mode -> (mesh axis, sequence layout)
    "megatron-sp": ("tp", "contiguous"),
    "ulysses": ("sp", "contiguous"),
    "ring": ("sp", "zigzag"),
}


def _plan(mode: str, tracker: RNGTracker) -> dict:
    """The only thing that differs between the modes."""
    rng = {"layers.*.resid_dropout": ShardedRNG(tracker), "layers.*.mlp.dropout": ShardedRNG(tracker)}
    if mode == "ulysses":
        return {"layers.*.attn.core": UlyssesAttention(), **rng}
    if mode == "ring":
        return {"layers.*.attn.core": RingAttention(layout="zigzag"), **rng}
    return {
        "layers.0": PrepareInput(Replicate(), Shard(1)),  # the embedding's output enters the sequence-parallel region
        "layers.*.attn_norm": SequenceParallel(),
        "layers.*.attn.wqkv": FusedQKV(input_layout=Shard(1)),
        "layers.*.attn.wo": Rowwise(output_layout=Shard(1)),
        "layers.*.mlp_norm": SequenceParallel(),
        "layers.*.mlp.up": Colwise(input_layout=Shard(1)),
        "layers.*.mlp.down": Rowwise(output_layout=Shard(1)),
        "norm": SequenceParallel(),
        "out": Colwise(input_layout=Shard(1), gather_output=True),  # all-gathers the sequence, then the features
        **rng,
    }


class ShardwiseDropout(nn.Module):
    """The reference's dropout for a sharded region: the positions rank r holds along ``dim``, with rank r's stream."""

    def __init__(self, dim: int, tracker: RNGTracker, positions: list[torch.Tensor]):
        super().__init__()
        self.dim, self.tracker, self.positions = dim, tracker, positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = []
        for rank, positions in enumerate(self.positions):
            with self.tracker.fork(f"rank{rank}"):
                pieces.append(F.dropout(x.index_select(self.dim, positions), P, self.training))
        return torch.cat(pieces, self.dim).index_select(self.dim, torch.argsort(torch.cat(self.positions)))


def _reference_dropouts(reference: Model, mode: str, n: int, layout: str) -> None:
    streams = RNGTracker()
    for rank in range(n):
        streams.add(f"rank{rank}", model_parallel_seed(SEED, rank))
    tokens = [shard_positions(SEQ, n, rank, layout) for rank in range(n)]
    features = [torch.arange(rank * HIDDEN // n, (rank + 1) * HIDDEN // n) for rank in range(n)]
    for block in reference.layers:
        block.resid_dropout = ShardwiseDropout(1, streams, tokens)  # on sequence shards in every mode
        if mode == "megatron-sp":  # (b, s, hidden / tp): split by features
            block.mlp.dropout = ShardwiseDropout(-1, streams, features)
        else:  # (b, s / sp, hidden): split by tokens
            block.mlp.dropout = ShardwiseDropout(1, streams, tokens)


def _full_of(name: str, reference: Model, *, grad: bool = False) -> torch.Tensor:
    """The unsharded value (or gradient) a parameter is a piece of (``wqkv.{q,k,v}_*``: rows of ``wqkv.*``)."""
    module_name, _, attr = name.rpartition(".")
    part = None
    if module_name.endswith("wqkv") and attr.startswith(("q_", "k_", "v_")):
        part, attr = attr.split("_")
    param = reference.get_parameter(f"{module_name}.{attr}")
    full = param.grad if grad else param.detach()
    if part is None:
        return full
    sizes = [n * HEAD_DIM for n in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)]
    return full.split(sizes)["qkv".index(part)]


def _formula(mode: str, n: int, model: nn.Module) -> dict[tuple[str, str], tuple[int, float]]:
    """(op, axis) -> (calls, bytes per rank) of one forward and backward, and of the gradient sync after it."""
    part = (n - 1) / n
    if mode == "megatron-sp":
        activation = BATCH * SEQ * DIM * FLOAT_BYTES  # a full (b, s, dim) activation
        # all-gather forward: qkv, up, out (sequence) + out's gather_output (features); backward: the re-gather of
        # the saved shard in qkv, up, out + the adjoints of the two reduce-scatters (wo, down)
        # reduce-scatter forward: wo, down; backward: the input gradients of qkv, up, out
        # all-reduce backward: row-parallel biases (wo, down) and norm weights (rms: dim, layer norm: 2 dim, final
        # rms: dim), each summed over tp: 6 tensors of dim elements
        return {
            ("all_gather", "tp"): (9, 9 * part * activation),
            ("reduce_scatter", "tp"): (5, 5 * part * activation),
            ("all_reduce", "tp"): (6, 6 * 2 * part * DIM * FLOAT_BYTES),
        }
    local = BATCH * SEQ // n * HEAD_DIM * FLOAT_BYTES  # one head of this rank's tokens
    sync = {("all_reduce", "sp"): (len(list(model.parameters())), 2 * part * _numel(model) * FLOAT_BYTES)}
    if mode == "ulysses":
        # q, k, v and the output, each (sp - 1) / sp of it, forward and again backward
        moved = (2 * NUM_HEADS + 2 * NUM_KV_HEADS) * local
        return {("all_to_all", "sp"): (8, 2 * part * moved), **sync}
    kv = 2 * NUM_KV_HEADS * local  # this rank's k and v
    # forward: n - 1 shifts of k, v; backward: n - 1 of k, v and n of the fp32 dK/dV accumulators
    shifts = (n - 1) + (n - 1) + n
    return {("send", "sp"): (shifts, shifts * kv), ("recv", "sp"): (shifts, shifts * kv), **sync}


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _measured(*trackers: CommTracker) -> dict[tuple[str, str], tuple[int, float]]:
    ops = {(r.op, r.axis) for tracker in trackers for r in tracker.records}
    return {
        key: (
            sum(t.calls(*key[:1], axis=key[1]) for t in trackers),
            sum(t.bytes(key[0], axis=key[1]) for t in trackers),
        )
        for key in ops
    }


def _train(mode: str):
    axis, layout = MODES[mode]
    mesh = Mesh(**{axis: dist.get_world_size()})
    n, rank, group = mesh.size(axis), mesh.rank(axis), mesh.group(axis)
    torch.manual_seed(0)
    reference = Model()
    model = copy.deepcopy(reference)
    _reference_dropouts(reference, mode, n, layout)
    tracker = seed_tensor_parallel(SEED, mesh=mesh, axis=axis)
    parallelize(model, mesh=mesh, plan=_plan(mode, tracker), axis=axis)
    torch.manual_seed(SEED)  # the reference's default stream, as seed_tensor_parallel left the ranks'
    rngs = {"reference": torch.get_rng_state(), "parallel": torch.get_rng_state()}

    generator = torch.Generator().manual_seed(7)
    x, target = (torch.randn(BATCH, SEQ, DIM, generator=generator) for _ in range(2))
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (reference, model)}
    mismatches, largest, communication = [], {}, {}

    def compare(what, got, expected):
        try:
            torch.testing.assert_close(got, expected, **(PARAM_TOLERANCE if what.startswith("param") else TOLERANCE))
        except AssertionError as error:
            mismatches.append(f"{what}: {error}")
        largest[what.split(" ")[0]] = max(largest.get(what.split(" ")[0], 0.0), (got - expected).abs().max().item())

    for step in range(STEPS):
        torch.set_rng_state(rngs["reference"])
        reference_loss = F.mse_loss(reference(x), target)
        reference_loss.backward()
        rngs["reference"] = torch.get_rng_state()

        torch.set_rng_state(rngs["parallel"])
        with CommTracker() as forward_backward:
            if mode == "megatron-sp":  # every tp rank holds the whole output (the last Colwise gathers it)
                loss = F.mse_loss(model(x), target)
            else:  # this rank's tokens only: the loss over them, averaged over sp below
                local_x, local_target = (shard_sequence(t, num_shards=n, rank=rank, layout=layout) for t in (x, target))
                loss = F.mse_loss(model(local_x), local_target)
            loss.backward()
        rngs["parallel"] = torch.get_rng_state()
        with CommTracker() as sync:
            if mode != "megatron-sp":  # the data-parallel sync over ("dp", "sp") of the replicated weights
                for param in model.parameters():
                    all_reduce(param.grad, op="avg", group=group)
        if mode != "megatron-sp":
            loss = all_reduce(loss.detach().clone(), op="avg", group=group)  # only to compare it
        if step == 0:
            communication = {"measured": _measured(forward_backward, sync), "formula": _formula(mode, n, model)}

        compare(f"loss step {step}", loss.detach(), reference_loss.detach())
        for name, param in model.named_parameters():
            compare(
                f"grad {name} step {step}",
                param.grad,
                layout_of(param).local_slice(_full_of(name, reference, grad=True)),
            )
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        for name, param in model.named_parameters():
            expected = layout_of(param).local_slice(_full_of(name, reference))
            if name.endswith(("wqkv.k_bias", "wqkv.bias")):  # the key bias: see the module docstring
                key_rows = (
                    slice(None)
                    if name.endswith("k_bias")
                    else slice(NUM_HEADS * HEAD_DIM, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM)
                )
                gap = (param.detach()[key_rows] - expected[key_rows]).abs().max().item()
                if gap > K_BIAS_ATOL:
                    mismatches.append(f"key bias step {step}: {gap} from the reference")
                if name.endswith("wqkv.bias"):  # the q and v rows are compared like every parameter
                    for rows in (slice(0, NUM_HEADS * HEAD_DIM), slice((NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM, None)):
                        compare(f"param {name} rows {rows} step {step}", param.detach()[rows], expected[rows])
                continue
            compare(f"param {name} step {step}", param.detach(), expected)
    layers = sorted({type(m).__name__ for m in model.modules()})
    return {"mismatches": mismatches, "largest": largest, "communication": communication, "layers": layers}


EXPECTED_LAYERS = {
    "megatron-sp": {"SequenceParallelQKVLinear", "SequenceParallelColumnLinear", "SequenceParallelRowLinear"},
    "ulysses": {"CoreAttention"},
    "ring": {"RingAttentionCore"},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_sequence_parallel_block_matches_single_process_over_three_adamw_steps(mode):
    for rank, result in enumerate(run_distributed(_train, mode, world_size=2)):
        assert result["mismatches"] == [], f"rank {rank}:\n" + "\n".join(result["mismatches"][:5])
        assert EXPECTED_LAYERS[mode] <= set(result["layers"])
        communication = result["communication"]
        assert communication["measured"] == communication["formula"], communication


def _wrong_plans():
    mesh = Mesh(sp=2)
    errors = []
    for plan in (
        {"layers.*.attn.wo": RingAttention()},  # has parameters ring attention would drop
        {"layers.*.resid_dropout": RingAttention()},  # no 'causal' attribute to read
        {"layers.*.resid_dropout": SequenceParallel()},  # nothing to sum: a dropout needs ShardedRNG
    ):
        model = Model()
        before = copy.deepcopy(model.state_dict())
        try:
            parallelize(model, mesh=mesh, plan=plan, axis="sp")
        except ValueError as error:
            errors.append(str(error))
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        errors.append(unchanged and type(model.layers[0].attn.core).__name__ == "CoreAttention")
    return errors


def test_sequence_parallel_styles_reject_modules_they_cannot_handle():
    errors = run_distributed(_wrong_plans, world_size=2)[0]
    assert "holds ['weight', 'bias'], which ring attention would drop" in errors[0] and errors[1] is True
    assert "has no bool attribute 'causal'; pass RingAttention(causal=True or False)" in errors[2] and errors[3]
    assert "a dropout on a sequence shard needs ShardedRNG(tracker)" in errors[4] and errors[5]
    with pytest.raises(ValueError, match="Megatron sequence parallelism"):
        Colwise(input_layout="Shard(1)")
    with pytest.raises(ValueError, match=r"input_layout=Shard\(-1\) names the features; the sequence is Shard\(1\)"):
        FusedQKV(input_layout=Shard(-1))
    with pytest.raises(ValueError, match="output_layout"):
        Rowwise(output_layout=Shard(-1))
