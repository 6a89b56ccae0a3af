"""Pipeline parallelism composed with tensor and data parallelism matches the single-process model.

The model is a tiny pre-norm transformer: token embedding, two blocks (multi-head causal attention with
separate q/k/v/o projections, a GELU MLP), a final LayerNorm and an untied head. `build_stages` cuts it into
two stages, the embedding and block 0 on the first, block 1 and the head on the second, each cut from the same
seeded model as the reference. Every rank trains 3 steps of SGD with momentum and returns its losses and its
gradients and parameters (gathered to full size where sharded) by the reference's parameter names.

- pp=2 x tp=2 (``Mesh(pp=2, tp=2)``): each stage is tensor-parallelized from outside with `parallelize`
  (q/k/v and the MLP's up projection column-parallel, o and down row-parallel, over the mesh's ``tp`` axis)
  and run by `PipelineExecutor` over ``pp``, under 1F1B and ZB-H1. With ZB-H1 the first stage's ``W`` runs
  the whole backward (its input, token ids, needs no gradient), tp all-reduces included, and both tp ranks of
  a stage run the same actions, so their collectives pair up.
- pp=2 x dp=2 (``Mesh(pp=2, dp=2)``): each dp rank gets its own half of the global batch; the executor's
  ``on_backward_end`` callback averages every gradient over ``mesh.group("dp")``, which is what DDP does. It
  has to be the callback: ZB-H1's ``W`` computes weight gradients with ``torch.autograd.grad``, which fires no
  gradient-accumulation hooks, so a hook-driven all-reduce would never run (or run on partial gradients).
- pp=2 x dp=2 with each stage wrapped in ``torch.nn.parallel.DistributedDataParallel`` over the dp group. DDP's
  reducer is hook-driven and cannot sync a pipeline step by itself: (1) ``W`` fires no hooks, so under ZB-H1
  the reducer would never see most gradients become ready, and the next forward fails with "Expected to have
  finished reduction in the prior iteration"; (2) even with fused backwards (1F1B), a forward run with sync
  enabled arms the reducer for the *next* backward on that stage, which under 1F1B belongs to an earlier
  microbatch, so it would all-reduce gradients that still miss later microbatches. (torch.distributed.pipelining
  works around this by calling ``reducer.prepare_for_backward`` by hand before the last backward, a private
  API.) So the step runs under ``ddp.no_sync()`` and the sync goes through the callback; what DDP contributes
  is its construction: the dp rank-0 weights broadcast to the other replica, which the test proves by
  perturbing rank 1's weights before wrapping.
- pp=2 x dp=2 with ZeRO-1 (`colo.zero.ZeroOptimizer(stage=1)`) over dp: the callback is
  ``zero.reduce_gradients``, which reduce-scatters each chunk's accumulated gradients inside the pipeline step
  (asserted with a `CommTracker`); the optimizer steps only this rank's shard of the masters.

Tolerances: float32 throughout, rtol=1e-5, atol=1e-6 on loss, gradients and parameters (observed differences
are ~1e-7). Not bit-identical: microbatching sums per-microbatch mean gradients scaled by 1/m instead of one
full-batch reduction; tensor parallelism sums partial products of the row-parallel projections and the
column-parallel input gradients across ranks; the dp average sums two half-batch means. Each changes the
order of float32 additions; 3 momentum-SGD steps carry those roundings into the parameters, no more.
The dp replicas must agree with each other exactly (one all-reduce gives both the same bits).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from colo.comm import CommTracker, Mesh, all_reduce
from colo.comm.testing import run_distributed
from colo.pipeline import PipelineExecutor, build_stages, make_schedule, partition_uniform
from colo.tensor import Colwise, Rowwise, gather, layout_of, parallelize, set_layout
from colo.zero import ZeroOptimizer

VOCAB, DIM, NUM_HEADS, HIDDEN, SEQ, NUM_BLOCKS = 16, 8, 2, 16, 4, 2
BATCH, NUM_MICROBATCHES, STEPS, SEED, LR = 8, 4, 3, 0, 0.1
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}

TP_PLAN = {
    "**.attn.wq": Colwise(),
    "**.attn.wk": Colwise(),
    "**.attn.wv": Colwise(),
    "**.attn.wo": Rowwise(),
    "**.mlp.up": Colwise(),
    "**.mlp.down": Rowwise(),
}
"""Megatron's split of a block: heads and MLP features sharded, one all-reduce per sublayer each way."""


# --- the model: architecture only ------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head attention; the head count follows from the projections' width (so tp shards heads)."""

    def __init__(self):
        super().__init__()
        self.head_dim = DIM // NUM_HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).reshape(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(DIM), Attention()
        self.mlp_norm, self.mlp = nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _data(step: int, batch: int):
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    return ids, targets


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


# --- the single-process reference ------------------------------------------------------------------------------


def _reference_run(batch: int):
    torch.manual_seed(SEED)
    model = Model()
    optimizer = _optimizer(model.parameters())
    losses, grads, params = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, targets = _data(step, batch)
        loss = _loss(model(ids), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        params.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return losses, grads, params


# --- the pipeline side -----------------------------------------------------------------------------------------


def _stage(schedule, pp_rank: int) -> tuple[nn.Sequential, dict[str, str]]:
    """This rank's stage, cut from the seeded reference model, and its module names -> the reference's."""
    torch.manual_seed(SEED)
    reference = Model()
    ranges = partition_uniform(NUM_BLOCKS, schedule.num_stages)
    stages = build_stages(list(reference.blocks), ranges, first=reference.embed, last=reference.head)
    (stage_index,) = schedule.stages[pp_rank]
    stage = stages[stage_index]
    reference_names = {id(module): name for name, module in reference.named_modules()}
    names = {name: reference_names[id(module)] for name, module in stage.named_modules() if name}
    return stage, names


def _reference_name(param_name: str, names: dict[str, str]) -> str:
    module_name, _, attr = param_name.rpartition(".")
    return f"{names[module_name]}.{attr}"


def _full(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (the parameter itself or its gradient) gathered to full size along the parameter's layout."""
    layout = layout_of(param)
    if layout is None or layout.is_replicated:
        return value.detach().clone()
    return gather(set_layout(value.detach().clone(), layout)).clone()


def _train(executor, stage, names, batches, *, step_context=None):
    """3 steps; per step the loss and, by reference name, the full gradients and parameters after the update."""
    optimizer = _optimizer(stage.parameters())
    named = [(_reference_name(n, names), p) for n, p in stage.named_parameters()]
    losses, grads, params = [], [], []
    for ids, targets in batches:
        optimizer.zero_grad()
        if step_context is None:
            result = executor.step(ids, targets)
        else:
            with step_context():
                result = executor.step(ids, targets)
        grads.append({name: _full(p, p.grad) for name, p in named})
        optimizer.step()
        losses.append(result.loss)
        params.append({name: _full(p, p) for name, p in named})
    return {"losses": losses, "grads": grads, "params": params}


def _pipeline_tp(schedule_name: str):
    mesh = Mesh(pp=2, tp=2)
    schedule = make_schedule(schedule_name, mesh.size("pp"), NUM_MICROBATCHES)
    stage, names = _stage(schedule, mesh.rank("pp"))
    parallelize(stage, mesh=mesh, plan=TP_PLAN, axis="tp")
    executor = PipelineExecutor(stage, schedule=schedule, mesh=mesh, loss_fn=_loss, axis="pp")
    sharded = sorted(_reference_name(n, names) for n, p in stage.named_parameters() if not layout_of(p).is_replicated)
    # every tp rank of the first stage feeds the same (replicated) batch
    return {**_train(executor, stage, names, [_data(step, BATCH) for step in range(STEPS)]), "sharded": sharded}


def _dp_shard(step: int, dp_rank: int, dp_size: int):
    ids, targets = _data(step, BATCH * dp_size)
    return ids.chunk(dp_size)[dp_rank], targets.chunk(dp_size)[dp_rank]


def _pipeline_dp(schedule_name: str, use_ddp: bool):
    mesh = Mesh(pp=2, dp=2)
    dp_group = mesh.group("dp")
    schedule = make_schedule(schedule_name, mesh.size("pp"), NUM_MICROBATCHES)
    stage, names = _stage(schedule, mesh.rank("pp"))
    chunk, step_context = stage, None
    if use_ddp:
        if mesh.rank("dp") == 1:  # DDP must replace these with dp rank 0's weights when it wraps the stage
            with torch.no_grad():
                for param in stage.parameters():
                    param.add_(1.0)
        chunk = nn.parallel.DistributedDataParallel(stage, process_group=dp_group.process_group)
        step_context = chunk.no_sync  # the reducer's hooks cannot sync a pipeline step (module docstring)

    def sync_gradients():  # DDP's all-reduce average, driven by the executor instead of autograd hooks
        for param in stage.parameters():
            all_reduce(param.grad, "avg", group=dp_group)

    executor = PipelineExecutor(
        chunk, schedule=schedule, mesh=mesh, loss_fn=_loss, axis="pp", on_backward_end=sync_gradients
    )
    batches = [_dp_shard(step, mesh.rank("dp"), mesh.size("dp")) for step in range(STEPS)]
    return _train(executor, stage, names, batches, step_context=step_context)


def _pipeline_zero1(schedule_name: str):
    """pp=2 x dp=2 with ZeRO-1 over dp: the executor's callback reduces gradients, the optimizer state is sharded."""
    mesh = Mesh(pp=2, dp=2)
    schedule = make_schedule(schedule_name, mesh.size("pp"), NUM_MICROBATCHES)
    stage, names = _stage(schedule, mesh.rank("pp"))
    zero = ZeroOptimizer(stage, _optimizer, mesh=mesh, stage=1, data_axes=("dp",))
    executor = PipelineExecutor(
        stage, schedule=schedule, mesh=mesh, loss_fn=_loss, axis="pp", on_backward_end=zero.reduce_gradients
    )
    losses, grads, params = [], [], []
    for step in range(STEPS):
        ids, targets = _dp_shard(step, mesh.rank("dp"), mesh.size("dp"))
        with CommTracker() as tracker:
            result = executor.step(ids, targets)
        # the gradients were reduced inside the step, by the callback: one reduce-scatter per trainable chunk
        assert tracker.calls("reduce_scatter", axis="dp") == len(zero.trainable_chunks) > 0
        grads.append({_reference_name(n, names): g for n, g in zero.full_grads().items()})
        zero.step()
        zero.zero_grad()
        losses.append(result.loss)
        params.append({_reference_name(n, names): p for n, p in zero.full_params().items()})
    return {"losses": losses, "grads": grads, "params": params}


# --- the claims ------------------------------------------------------------------------------------------------


def _assert_matches(results, reference, *, losses_of):
    ref_losses, ref_grads, ref_params = reference
    for step in range(STEPS):
        torch.testing.assert_close(losses_of(results, step), ref_losses[step], **TOLERANCE)
        for rank, result in enumerate(results):
            for kind, expected in (("grads", ref_grads[step]), ("params", ref_params[step])):
                got = result[kind][step]
                assert set(got) <= set(expected), set(got) - set(expected)
                for name, value in got.items():
                    torch.testing.assert_close(value, expected[name], **TOLERANCE, msg=f"{kind} {name} rank {rank}")
    covered = {name for result in results for name in result["grads"][0]}
    assert covered == set(ref_grads[0]), "the stages together must hold every parameter of the model"


@pytest.mark.parametrize("schedule_name", ["1f1b", "zero_bubble_h1"])
def test_pp2_tp2_matches_single_process(schedule_name):
    results = run_distributed(_pipeline_tp, schedule_name, world_size=4)
    # the plan sharded every q/k/v/o and MLP weight (and the column-parallel biases) on both stages
    for rank, block in ((0, 0), (2, 1)):
        projections = [f"attn.{p}" for p in ("wq", "wk", "wv", "wo")] + ["mlp.up", "mlp.down"]
        expected = [f"blocks.{block}.{p}.weight" for p in projections]
        expected += [f"blocks.{block}.{p}.bias" for p in ("attn.wq", "attn.wk", "attn.wv", "mlp.up")]
        assert results[rank]["sharded"] == sorted(expected)
    # the loss comes back on every rank: every rank's must match
    for rank in range(4):
        _assert_matches(results, _reference_run(BATCH), losses_of=lambda r, step, rank=rank: r[rank]["losses"][step])
    # the tp ranks of a stage hold identical copies of the replicated parameters and gather identical shards
    for first, second in ((0, 1), (2, 3)):
        for name, value in results[first]["params"][-1].items():
            torch.testing.assert_close(results[second]["params"][-1][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("use_ddp", [False, True], ids=["callback", "ddp-no_sync+callback"])
@pytest.mark.parametrize("schedule_name", ["1f1b", "zero_bubble_h1"])
def test_pp2_dp2_matches_single_process_on_the_full_batch(schedule_name, use_ddp):
    results = run_distributed(_pipeline_dp, schedule_name, use_ddp, world_size=4)

    def full_batch_loss(results, step):  # each dp replica's loss is its half-batch mean; halves are equal-sized
        by_dp = [results[0]["losses"][step], results[1]["losses"][step]]  # ranks 0, 1: dp 0, 1 of pp rank 0
        return torch.stack(by_dp).mean()

    _assert_matches(results, _reference_run(2 * BATCH), losses_of=full_batch_loss)
    for first, second in ((0, 1), (2, 3)):  # the dp replicas agree bit for bit after every step
        for step in range(STEPS):
            for name, value in results[first]["params"][step].items():
                torch.testing.assert_close(results[second]["params"][step][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("schedule_name", ["1f1b", "zero_bubble_h1"])
def test_pp2_dp2_with_zero1_through_the_callback_matches_single_process(schedule_name):
    results = run_distributed(_pipeline_zero1, schedule_name, world_size=4)

    def full_batch_loss(results, step):  # dp ranks 0 and 1 of pp rank 0 each report their half-batch mean
        return torch.stack([results[0]["losses"][step], results[1]["losses"][step]]).mean()

    _assert_matches(results, _reference_run(2 * BATCH), losses_of=full_batch_loss)
