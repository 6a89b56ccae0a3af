"""The executor runs every generator's schedule and matches a single-process reference step by step.

The model: token embedding, 8 residual blocks, and a head whose weight is tied to the embedding. Stages pass
a dict ``{"h": float activations, "pos": int64 positions}`` (a dict crosses boundaries, with a tensor that
carries no gradient). The pipeline copy of the model is split into ``p * v`` stages; the embedding lives on
the first stage and the head, with its own copy of the tied weight, on the last; the executor sums the two
copies' gradients. Each rank trains 3 SGD-with-momentum steps and returns its losses and gradients by
parameter name; the test compares them with the same model trained on the whole batch in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.pipeline import PipelineExecutor, build_stages, make_schedule, partition_uniform, simulate

VOCAB, DIM, SEQ, BATCH, NUM_BLOCKS, STEPS = 16, 8, 4, 8, 8, 3

# Microbatching sums per-microbatch gradients (each scaled by 1/m) instead of one full-batch reduction, so
# results differ from the reference by float32 rounding only; after 3 optimizer steps that stays below 1e-5.
RTOL, ATOL = 1e-4, 1e-6


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return {"h": F.embedding(ids, self.weight), "pos": pos}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h, pos):
        return {"h": h + torch.tanh(self.lin(self.norm(h) + 0.01 * pos.unsqueeze(-1).float())), "pos": pos}


class Head(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, h, pos):
        return h @ self.weight.t()


class StageModule(nn.Module):
    """The blocks of one stage; calls ``Embed`` on token ids when it is the first stage."""

    def __init__(self, modules: nn.Sequential):
        super().__init__()
        self.layers = modules

    def forward(self, *args, **kwargs):
        value = args[0] if args else kwargs
        for layer in self.layers:
            value = layer(**value) if isinstance(value, dict) else layer(value)
        return value


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))

    def forward(self, ids):
        value = self.embed(ids)
        for block in self.blocks:
            value = block(**value)
        return value["h"] @ self.embed.weight.t()


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _data(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, targets


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _reference_run():
    torch.manual_seed(0)
    model = Reference()
    optimizer = _optimizer(model.parameters())
    losses, grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, targets = _data(step)
        loss = _loss(model(ids), targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return losses, grads


def _stage_modules(schedule, rank):
    """This rank's chunks, cut from the same seeded reference model, and their parameter names."""
    torch.manual_seed(0)
    reference = Reference()
    head = Head(reference.embed.weight)
    ranges = partition_uniform(NUM_BLOCKS, schedule.num_stages)
    parts = build_stages(list(reference.blocks), ranges, first=reference.embed, last=head)
    names = {id(p): n for n, p in reference.named_parameters()}
    names[id(head.weight)] = "embed.weight"  # the tied copy answers for the reference's shared weight
    chunks = [StageModule(parts[stage]) for stage in schedule.stages[rank]]
    return chunks, names


def _pipeline_run(schedule_name, num_microbatches_list, num_chunks):
    mesh = Mesh(pp=torch.distributed.get_world_size())
    rank = mesh.rank("pp")
    runs = {}
    for num_microbatches in num_microbatches_list:
        schedule = make_schedule(schedule_name, mesh.size("pp"), num_microbatches, num_chunks=num_chunks)
        chunks, names = _stage_modules(schedule, rank)
        tied_here = _tied_params(chunks)
        tied = {"embed": tied_here} if tied_here else {}
        executor = PipelineExecutor(chunks, schedule=schedule, mesh=mesh, loss_fn=_loss, tied_parameters=tied)
        params = [p for chunk in chunks for p in chunk.parameters()]
        optimizer = _optimizer(params)
        losses, grads, actions, peaks = [], [], [], []
        for step in range(STEPS):
            optimizer.zero_grad()
            ids, targets = _data(step)
            result = executor.step(ids, targets)
            losses.append(result.loss)
            grads.append({names[id(p)]: p.grad.clone() for p in params})
            actions.append(result.actions)
            peaks.append(result.peak_live_activations)
            optimizer.step()
        runs[num_microbatches] = {
            "losses": losses,
            "grads": grads,
            "actions_match": all(a == schedule.actions[rank] for a in actions),
            "peak": peaks[-1],
            "simulated_peak": simulate(schedule).peak_live_activations[rank],
        }
    return runs


def _tied_params(chunks):
    """The tied weight on this rank: the embedding (first stage) and/or the head's copy (last stage)."""
    return [m.weight for chunk in chunks for m in chunk.modules() if isinstance(m, (Embed, Head))]


CASES = [
    pytest.param("gpipe", 2, 1, id="gpipe-p2"),
    pytest.param("1f1b", 2, 1, id="1f1b-p2"),
    pytest.param("interleaved_1f1b", 2, 2, id="interleaved-v2-p2"),
    pytest.param("zero_bubble_h1", 2, 1, id="zb-h1-p2"),
    pytest.param("gpipe", 4, 1, id="gpipe-p4"),
    pytest.param("1f1b", 4, 1, id="1f1b-p4"),
    pytest.param("interleaved_1f1b", 4, 2, id="interleaved-v2-p4"),
    pytest.param("zero_bubble_h1", 4, 1, id="zb-h1-p4"),
]


@pytest.mark.parametrize("schedule_name, num_ranks, num_chunks", CASES)
def test_matches_single_process_reference(schedule_name, num_ranks, num_chunks):
    ref_losses, ref_grads = _reference_run()
    results = run_distributed(_pipeline_run, schedule_name, [4, 8], num_chunks, world_size=num_ranks)
    for num_microbatches in (4, 8):
        per_rank = [r[num_microbatches] for r in results]
        for step in range(STEPS):
            for rank_result in per_rank:  # the loss comes back on every rank
                torch.testing.assert_close(rank_result["losses"][step], ref_losses[step], rtol=RTOL, atol=ATOL)
            gathered = {}
            for rank_result in per_rank:
                for name, grad in rank_result["grads"][step].items():
                    if name in gathered:  # the tied weight: both copies hold the summed gradient
                        torch.testing.assert_close(grad, gathered[name], rtol=0, atol=0)
                    gathered[name] = grad
            assert set(gathered) == set(ref_grads[step])
            for name, grad in gathered.items():
                torch.testing.assert_close(grad, ref_grads[step][name], rtol=RTOL, atol=ATOL, msg=name)
        for rank, rank_result in enumerate(per_rank):
            assert rank_result["actions_match"], f"rank {rank} did not run exactly its schedule"
            assert rank_result["peak"] == rank_result["simulated_peak"]


def test_chunks_on_one_rank_hand_over_locally():
    """p=1 with two chunks: stage 0 feeds stage 1 on the same rank, and the tied weight lives twice on it."""
    ref_losses, ref_grads = _reference_run()
    (result,) = run_distributed(_pipeline_run, "interleaved_1f1b", [4], 2, world_size=1)
    for step in range(STEPS):
        torch.testing.assert_close(result[4]["losses"][step], ref_losses[step], rtol=RTOL, atol=ATOL)
        for name, grad in result[4]["grads"][step].items():
            torch.testing.assert_close(grad, ref_grads[step][name], rtol=RTOL, atol=ATOL, msg=name)
    assert result[4]["actions_match"]


def _evaluate_run(schedule_name, num_chunks):
    mesh = Mesh(pp=torch.distributed.get_world_size())
    schedule = make_schedule(schedule_name, mesh.size("pp"), 4, num_chunks=num_chunks)
    chunks, _ = _stage_modules(schedule, mesh.rank("pp"))
    executor = PipelineExecutor(chunks, schedule=schedule, mesh=mesh, loss_fn=_loss)
    before = [p.detach().clone() for chunk in chunks for p in chunk.parameters()]
    ids, targets = _data(0)
    loss = executor.evaluate(ids, targets)
    params = [p for chunk in chunks for p in chunk.parameters()]
    untouched = all(torch.equal(a, b) for a, b in zip(before, params)) and all(p.grad is None for p in params)
    return loss, untouched


@pytest.mark.parametrize(
    "schedule_name, num_ranks, num_chunks",
    [pytest.param("1f1b", 2, 1, id="1f1b-p2"), pytest.param("interleaved_1f1b", 2, 2, id="interleaved-v2-p2")],
)
def test_evaluate_gives_the_reference_loss_without_gradients(schedule_name, num_ranks, num_chunks):
    torch.manual_seed(0)
    reference = Reference()
    ids, targets = _data(0)
    with torch.no_grad():  # the mean of 4 microbatch means of equal size = the full-batch mean, up to rounding
        expected = _loss(reference(ids), targets)
    for loss, untouched in run_distributed(_evaluate_run, schedule_name, num_chunks, world_size=num_ranks):
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
        assert untouched


def _forward_outputs_run(schedule_name, num_chunks):
    mesh = Mesh(pp=torch.distributed.get_world_size())
    schedule = make_schedule(schedule_name, mesh.size("pp"), 4, num_chunks=num_chunks)
    chunks, _ = _stage_modules(schedule, mesh.rank("pp"))
    executor = PipelineExecutor(chunks, schedule=schedule, mesh=mesh, loss_fn=_loss)
    ids, targets = _data(0)
    rows = executor.forward_outputs(ids, targets, output_fn=lambda output, target: (output, target), num_microbatches=2)
    return None if rows is None else [(output.detach(), target) for output, target in rows]


@pytest.mark.parametrize(
    "schedule_name, num_chunks",
    [pytest.param("1f1b", 1, id="1f1b-p2"), pytest.param("interleaved_1f1b", 2, id="interleaved-v2-p2")],
)
def test_forward_outputs_returns_the_last_stage_output_per_microbatch(schedule_name, num_chunks):
    """`forward_outputs` in 2 microbatches (not the schedule's 4): on the last stage's rank the reference model's
    output of each half of the batch with that half's targets; ``None`` on the other rank."""
    torch.manual_seed(0)
    reference = Reference()
    ids, targets = _data(0)
    with torch.no_grad():
        expected = reference(ids)
    first, last = run_distributed(_forward_outputs_run, schedule_name, num_chunks, world_size=2)
    assert first is None and len(last) == 2
    half = ids.shape[0] // 2
    for index, (output, target) in enumerate(last):
        rows = slice(index * half, (index + 1) * half)
        torch.testing.assert_close(output, expected[rows], rtol=RTOL, atol=ATOL)
        assert torch.equal(target, targets[rows])
