#!/usr/bin/env python3
"""Pipeline schedules at p=4: colo's measured step time and bubble next to its simulator and torch.pipelining.

Every stage costs fixed sleeps, so the figures measure the schedules, not the CPU (4 ranks on a 2-core machine
would make compute timings meaningless): ``F`` sleeps in the forward, ``B`` in the backward of an identity on
the activation path, ``W`` in the backward of an identity on the weight (so a fused backward sleeps both, and
a split one sleeps each in its own step). With interleaving each of a rank's 2 chunks sleeps half as long, so
every rank does the same work under every schedule.

For each schedule it reports colo's measured step time (median of ``--steps``) and bubble
(``1 - busy / step``), the simulator's prediction on the same cost model (plus the measured p2p latency), and
``torch.distributed.pipelining`` on the same model: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B
(v=2) and ScheduleInterleavedZeroBubble (v=2; torch has no single-chunk ZB-H1, so it stands next to colo's
``zero_bubble_h1``).

A second section runs real compute at p=2 (2 processes, one thread each, ``OMP_NUM_THREADS=1``, gloo): a stack of
pre-norm residual MLP blocks cut into 2 stages (4 for interleaving, 2 chunks per rank). Each rank first times
its stages' ``F``, ``B``, ``W`` and fused ``BW`` on one microbatch, exactly as the executor computes them
(`backward_input` / `backward_weight`, the loss on the last stage, no input gradient on the first), both
ranks at once so they contend for the cores as they will in the pipeline; the medians, per (op, stage), and
the measured p2p time of one activation are the simulator's cost model. Then each schedule runs in colo and
in torch.distributed.pipelining on the same model; the bubble is ``1 - busy / step`` with ``busy`` the
profiled compute of a rank's actions, averaged over ranks (the simulator's definition). colo's own per-action
durations during the timed steps (``on_action`` timestamps) are reported next to the profiled ones.

Writes ``benchmarks/results/pipeline_schedules_cpu.json`` (the sleep section at the top level, the real-compute
section under ``"real_compute_p2"``; a section not run keeps its previous figures).

    python benchmarks/pipeline_schedules.py [--section all|sleep|compute] [--ms 20] [--microbatches 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from colo.comm import Mesh, P2POp, all_gather_object, barrier, batch_send_recv, launch
from colo.pipeline import (
    CostModel,
    PipelineExecutor,
    backward_input,
    backward_weight,
    build_stages,
    make_schedule,
    partition_uniform,
    simulate,
)

RESULTS = Path(__file__).resolve().parent / "results"
NUM_RANKS, DIM, BATCH_PER_MICROBATCH = 4, 16, 2
SCHEDULES = [
    # (colo schedule, torch schedule class name, chunks per rank)
    ("gpipe", "ScheduleGPipe", 1),
    ("1f1b", "Schedule1F1B", 1),
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", 2),
    ("zero_bubble_h1", "ScheduleInterleavedZeroBubble", 1),
]


class SleepBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    """A linear layer whose F, B and W each cost a fixed sleep."""

    def __init__(self, forward_s: float, input_s: float, weight_s: float):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.ones(DIM))  # so the input path exists on the first stage too
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s

    def forward(self, x):
        time.sleep(self.forward_s)
        x = SleepBackward.apply(x * self.scale, self.input_s)
        weight = SleepBackward.apply(self.lin.weight, self.weight_s)
        return torch.nn.functional.linear(x, weight, self.lin.bias)


def _loss(output, target):
    return ((output - target) ** 2).mean()


def _timed_steps(run_step, steps):
    run_step()  # warm-up: shapes, metadata, groups
    times = []
    for _ in range(steps):
        barrier()
        start = time.perf_counter()
        run_step()
        barrier()
        times.append(time.perf_counter() - start)
    return times


def _p2p_latency(group, rounds=40, message=None):
    """Median seconds of one message (default: a small one) between neighbours (ping-pong of ranks 2k, 2k+1, halved)."""
    rank = group.rank
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    message = torch.zeros(BATCH_PER_MICROBATCH, DIM) if message is None else message
    reply = torch.empty_like(message)
    samples = []
    barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if rank % 2 == 0:
            batch_send_recv([P2POp.send(message, peer)], group=group)
            batch_send_recv([P2POp.recv(reply, peer)], group=group)
        else:
            batch_send_recv([P2POp.recv(reply, peer)], group=group)
            batch_send_recv([P2POp.send(message, peer)], group=group)
        samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples)


def _colo(schedule_name, num_chunks, microbatches, seconds, steps):
    mesh = Mesh(pp=NUM_RANKS)
    schedule = make_schedule(schedule_name, NUM_RANKS, microbatches, num_chunks=num_chunks)
    share = seconds / num_chunks
    chunks = [SleepStage(share, share, share) for _ in range(num_chunks)]
    executor = PipelineExecutor(chunks, schedule=schedule, mesh=mesh, loss_fn=_loss)
    batch = torch.randn(microbatches * BATCH_PER_MICROBATCH, DIM)
    target = torch.randn(microbatches * BATCH_PER_MICROBATCH, DIM)
    times = _timed_steps(lambda: executor.step(batch, target, return_loss=False), steps)
    latency = _p2p_latency(mesh.group("pp"))
    return {"times": times, "p2p_latency_s": latency}


def _torch_step(modules, class_name, num_ranks, microbatches, batch, target):
    """One step of torch.distributed.pipelining's ``class_name`` on this rank's ``modules`` (chunk c: stage c*p+r)."""
    from torch.distributed import pipelining

    mesh = Mesh(pp=num_ranks)
    group = mesh.group("pp").process_group
    rank = mesh.rank("pp")
    num_stages = num_ranks * len(modules)
    stages = [
        pipelining.PipelineStage(module, rank + chunk * num_ranks, num_stages, torch.device("cpu"), group=group)
        for chunk, module in enumerate(modules)
    ]
    schedule_class = getattr(pipelining, class_name)
    if class_name in ("ScheduleGPipe", "Schedule1F1B"):
        schedule = schedule_class(stages[0], microbatches, loss_fn=_loss)
    else:
        schedule = schedule_class(stages, microbatches, loss_fn=_loss)
    first, last = rank == 0, rank == (num_stages - 1) % num_ranks

    def run_step():
        kwargs = {"target": target, "losses": []} if last else {}
        if first:
            schedule.step(batch, **kwargs)
        else:
            schedule.step(**kwargs)

    return run_step


def _torch_pipeline(modules, class_name, num_ranks, microbatches, batch, target, steps):
    """Time torch.distributed.pipelining's ``class_name`` on this rank's ``modules``; an error is reported."""
    try:
        return {"times": _timed_steps(_torch_step(modules, class_name, num_ranks, microbatches, batch, target), steps)}
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        return {"error": f"{type(error).__name__}: {error}"}


def _torch(class_name, num_chunks, microbatches, seconds, steps):
    share = seconds / num_chunks
    modules = [SleepStage(share, share, share) for _ in range(num_chunks)]
    batch = torch.randn(microbatches * BATCH_PER_MICROBATCH, DIM)
    target = torch.randn(microbatches * BATCH_PER_MICROBATCH, DIM)
    return _torch_pipeline(modules, class_name, NUM_RANKS, microbatches, batch, target, steps)


def _simulated(schedule_name, num_chunks, microbatches, seconds, p2p):
    share = seconds / num_chunks
    # the first stage's input needs no gradient: its B is empty and its W runs the whole backward
    overrides = {("B", 0): 0.0, ("W", 0): 2 * share} if schedule_name == "zero_bubble_h1" else None
    cost = CostModel(forward=share, backward_input=share, backward_weight=share, p2p=p2p, overrides=overrides)
    schedule = make_schedule(schedule_name, NUM_RANKS, microbatches, num_chunks=num_chunks)
    return simulate(schedule, cost)


# --- real compute at p=2 ------------------------------------------------------------------------------------

COMPUTE_RANKS = 2
COMPUTE_SCHEDULES = SCHEDULES  # the same four pairs as the sleep section
COMPUTE_SHAPE = {"num_blocks": 8, "dim": 256, "hidden": 1024, "seq": 32, "microbatch_size": 4}


class MLPBlock(nn.Module):
    """A pre-norm residual MLP block: ``x + W2 gelu(W1 norm(x))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _compute_chunks(num_stages: int, rank: int, num_chunks: int, shape: dict) -> list[nn.Sequential]:
    """This rank's chunks of the block stack (same seed everywhere): chunk ``c`` is stage ``c * p + rank``."""
    torch.manual_seed(0)
    blocks = [MLPBlock(shape["dim"], shape["hidden"]) for _ in range(shape["num_blocks"])]
    stages = build_stages(blocks, partition_uniform(len(blocks), num_stages))
    return [stages[chunk * COMPUTE_RANKS + rank] for chunk in range(num_chunks)]


def _compute_batch(microbatches: int, shape: dict) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    size = (microbatches * shape["microbatch_size"], shape["seq"], shape["dim"])
    return torch.randn(size, generator=generator), torch.randn(size, generator=generator)


def _profile_chunk(module, *, first: bool, last: bool, microbatches: int, shape: dict, repeats: int) -> dict:
    """Median seconds of ``F``, ``B``, ``W`` and ``BW`` on one microbatch, computed the way the executor does."""
    size = (shape["microbatch_size"], shape["seq"], shape["dim"])
    x, target = torch.randn(size), torch.randn(size)
    inputs = [] if first else [x.requires_grad_(True)]  # the first stage's input needs no gradient
    params = list(module.parameters())

    def forward():
        output = module(x)
        return _loss(output, target).reshape(()) / microbatches if last else output

    samples: dict[str, list[float]] = {"F": [], "B": [], "W": [], "BW": []}
    for repeat in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        output = forward()
        forward_end = time.perf_counter()
        grad = torch.ones_like(output) if last else torch.randn_like(output)
        _, pending = backward_input([output], [grad], inputs, params)
        input_end = time.perf_counter()
        backward_weight(pending)
        weight_end = time.perf_counter()
        output = forward()
        fused_start = time.perf_counter()
        torch.autograd.backward([output], [grad])
        fused_end = time.perf_counter()
        module.zero_grad(set_to_none=True)
        x.grad = None
        if repeat:
            samples["F"].append(forward_end - start)
            samples["B"].append(input_end - forward_end)
            samples["W"].append(weight_end - input_end)
            samples["BW"].append(fused_end - fused_start)
    return {op: statistics.median(values) for op, values in samples.items()}


def _compute_profile(num_chunks: int, microbatches: int, shape: dict, repeats: int) -> dict:
    """Every stage's profiled costs (both ranks profile at once) and the p2p time of one activation."""
    mesh = Mesh(pp=COMPUTE_RANKS)
    rank, num_stages = mesh.rank("pp"), COMPUTE_RANKS * num_chunks
    chunks = _compute_chunks(num_stages, rank, num_chunks, shape)
    barrier()
    mine = {}
    for chunk, module in enumerate(chunks):
        stage = chunk * COMPUTE_RANKS + rank
        mine[stage] = _profile_chunk(
            module, first=stage == 0, last=stage == num_stages - 1, microbatches=microbatches, shape=shape,
            repeats=repeats,
        )  # fmt: skip
    costs = {stage: cost for part in all_gather_object(mine, group=mesh.group("pp")) for stage, cost in part.items()}
    activation = torch.zeros(shape["microbatch_size"], shape["seq"], shape["dim"])
    return {"costs": costs, "p2p_s": _p2p_latency(mesh.group("pp"), message=activation)}


def _colo_compute_step(schedule_name, num_chunks, microbatches, shape):
    """One colo step, and the per-action durations it records (``on_action`` timestamps)."""
    mesh = Mesh(pp=COMPUTE_RANKS)
    rank = mesh.rank("pp")
    schedule = make_schedule(schedule_name, COMPUTE_RANKS, microbatches, num_chunks=num_chunks)
    chunks = _compute_chunks(schedule.num_stages, rank, num_chunks, shape)
    marks: list[tuple[object, float]] = []
    executor = PipelineExecutor(
        chunks, schedule=schedule, mesh=mesh, loss_fn=_loss, on_action=lambda a: marks.append((a, time.perf_counter()))
    )
    batch, target = _compute_batch(microbatches, shape)
    record: dict[str, list] = {"busy": []}

    def run_step():
        marks.clear()
        marks.append((None, time.perf_counter()))
        executor.step(batch, target, return_loss=False)
        busy = 0.0
        for (_, before), (action, after) in zip(marks, marks[1:]):
            if action.op in ("F", "B", "W", "BW"):
                record.setdefault(action.op, {}).setdefault(schedule.stages[rank][action.chunk], []).append(
                    after - before
                )
                busy += after - before
        record["busy"].append(busy)

    return run_step, record


def _compute_run(colo_name, torch_name, num_chunks, torch_num_chunks, microbatches, shape, steps, repeats):
    """Profile the stages, then time colo and torch on the same model, alternating steps (same machine load)."""
    profile = _compute_profile(num_chunks, microbatches, shape, repeats)
    colo_step, record = _colo_compute_step(colo_name, num_chunks, microbatches, shape)
    rank = torch.distributed.get_rank()
    batch, target = _compute_batch(microbatches, shape)
    torch_chunks = _compute_chunks(COMPUTE_RANKS * torch_num_chunks, rank, torch_num_chunks, shape)
    runs = {"colo": colo_step}
    error = None
    try:
        runs["torch"] = _torch_step(torch_chunks, torch_name, COMPUTE_RANKS, microbatches, batch, target)
        runs["torch"]()  # warm-up (a schedule that cannot run fails here, on every rank alike)
    except Exception as failure:  # noqa: BLE001 - reported, not hidden
        runs.pop("torch")
        error = f"{type(failure).__name__}: {failure}"
    colo_step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, run_step in runs.items():
            barrier()
            start = time.perf_counter()
            run_step()
            barrier()
            times[name].append(time.perf_counter() - start)
    in_situ = {
        op: {stage: statistics.median(values[microbatches:]) for stage, values in by_stage.items()}  # skip warm-up
        for op, by_stage in record.items()
        if op != "busy"
    }
    return {
        "profile": profile,
        "colo_times": times["colo"],
        "torch_times": times.get("torch"),
        "torch_error": error,
        "colo_busy_s": statistics.median(record["busy"][1:]),
        "in_situ": in_situ,
    }


def _cost_model(costs: dict, p2p: float) -> CostModel:
    overrides = {(op, stage): seconds for stage, ops in costs.items() for op, seconds in ops.items()}
    return CostModel(p2p=p2p, overrides=overrides)


def _compute_section(args) -> dict:
    shape = dict(COMPUTE_SHAPE)
    microbatches = args.microbatches
    rows = []
    for colo_name, torch_name, num_chunks in COMPUTE_SCHEDULES:
        torch_num_chunks = 2 if torch_name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble") else 1
        runs = launch(_compute_run, COMPUTE_RANKS, colo_name, torch_name, num_chunks, torch_num_chunks, microbatches,
                      shape, args.steps, args.profile_repeats, backend="gloo", threads=1)  # fmt: skip
        run, profile = runs[0], runs[0]["profile"]
        schedule = make_schedule(colo_name, COMPUTE_RANKS, microbatches, num_chunks=num_chunks)
        sim = simulate(schedule, _cost_model(profile["costs"], profile["p2p_s"]))
        in_situ_costs = {}
        for rank_run in runs:
            for op, by_stage in rank_run["in_situ"].items():
                for stage, seconds in by_stage.items():
                    in_situ_costs.setdefault(stage, {})[op] = seconds
        sim_in_situ = simulate(schedule, _cost_model(in_situ_costs, profile["p2p_s"]))
        busy = statistics.mean(sim.busy)  # profiled compute per rank, averaged over ranks
        measured = statistics.median(run["colo_times"])
        torch_time = statistics.median(run["torch_times"]) if run["torch_times"] else None
        row = {
            "schedule": colo_name,
            "num_chunks": num_chunks,
            "profiled_costs_s": {str(stage): cost for stage, cost in sorted(profile["costs"].items())},
            "p2p_s": profile["p2p_s"],
            "busy_per_rank_s": busy,
            "colo_step_s": measured,
            "colo_steps_s": run["colo_times"],
            "colo_bubble": 1 - busy / measured,
            "simulated_step_s": sim.makespan,
            "simulated_bubble": sim.bubble_ratio,
            "simulator_error": sim.makespan / measured - 1,
            "colo_costs_in_situ_s": {str(stage): cost for stage, cost in sorted(in_situ_costs.items())},
            "colo_busy_in_situ_s": [rank_run["colo_busy_s"] for rank_run in runs],
            "colo_bubble_in_situ": 1 - statistics.mean(rank_run["colo_busy_s"] for rank_run in runs) / measured,
            "simulated_in_situ_step_s": sim_in_situ.makespan,
            "simulator_in_situ_error": sim_in_situ.makespan / measured - 1,
            "torch_schedule": torch_name,
            "torch_num_chunks": torch_num_chunks,
            "torch_step_s": torch_time,
            "torch_steps_s": run["torch_times"],
            "torch_bubble": None if torch_time is None else 1 - busy / torch_time,
            "torch_error": run["torch_error"],
            "colo_vs_torch": None if torch_time is None else measured / torch_time,
        }
        rows.append(row)
        torch_text = f"{torch_time * 1e3:7.1f} ms" if torch_time else f"failed: {row['torch_error'][:60]}"
        print(
            f"{colo_name:18s} colo {measured * 1e3:7.1f} ms (bubble {row['colo_bubble']:5.1%})  "
            f"simulated {sim.makespan * 1e3:7.1f} ms ({row['simulator_error']:+.1%}; from in-situ costs "
            f"{row['simulator_in_situ_error']:+.1%})  torch {torch_name} {torch_text}",
            flush=True,
        )
    return {
        "device": "cpu (gloo on loopback), 2 processes, 1 thread each (OMP_NUM_THREADS=1)",
        "num_ranks": COMPUTE_RANKS,
        "num_microbatches": microbatches,
        "model": f"{shape['num_blocks']} pre-norm residual MLP blocks (dim {shape['dim']}, hidden {shape['hidden']})",
        "microbatch_shape": [shape["microbatch_size"], shape["seq"], shape["dim"]],
        "profile_repeats": args.profile_repeats,
        "steps": args.steps,
        "torch_version": torch.__version__,
        "note": (
            "colo and torch run in the same processes, alternating timed steps. torch has no single-chunk ZB-H1: "
            "ScheduleInterleavedZeroBubble (2 chunks per rank) stands next to colo's zero_bubble_h1. Bubbles are "
            "1 - busy / step with busy the profiled compute per rank (a profile taken under heavier load than the "
            "timed steps can make one negative); colo_bubble_in_situ uses colo's own compute time in the timed steps, "
            "and simulated_in_situ its per-action medians from them, instead of the standalone profile."
        ),
        "rows": rows,
    }


# --- the sleep section at p=4 ------------------------------------------------------------------------------


def _sleep_section(args) -> dict:
    seconds = args.ms / 1000
    busy = 3 * seconds * args.microbatches  # compute per rank per step, every schedule
    rows = []
    for colo_name, torch_name, num_chunks in SCHEDULES:
        colo_run = launch(_colo, NUM_RANKS, colo_name, num_chunks, args.microbatches, seconds, args.steps,
                          backend="gloo", threads=1)[0]  # fmt: skip
        torch_run = launch(_torch, NUM_RANKS, torch_name, num_chunks, args.microbatches, seconds, args.steps,
                           backend="gloo", threads=1)[0]  # fmt: skip
        measured = statistics.median(colo_run["times"])
        sim = _simulated(colo_name, num_chunks, args.microbatches, seconds, colo_run["p2p_latency_s"])
        torch_time = statistics.median(torch_run["times"]) if "times" in torch_run else None
        row = {
            "schedule": colo_name,
            "num_chunks": num_chunks,
            "colo_step_s": measured,
            "colo_steps_s": colo_run["times"],
            "colo_bubble": 1 - busy / measured,
            "simulated_step_s": sim.makespan,
            "simulated_bubble": 1 - busy / sim.makespan,
            "simulator_error": sim.makespan / measured - 1,
            "p2p_latency_s": colo_run["p2p_latency_s"],
            "torch_schedule": torch_name,
            "torch_step_s": torch_time,
            "torch_steps_s": torch_run.get("times"),
            "torch_bubble": None if torch_time is None else 1 - busy / torch_time,
            "torch_error": torch_run.get("error"),
            "colo_vs_torch": None if torch_time is None else measured / torch_time,
        }
        rows.append(row)
        torch_text = f"{torch_time * 1e3:7.1f} ms" if torch_time else f"failed: {row['torch_error'][:60]}"
        print(
            f"{colo_name:18s} colo {measured * 1e3:7.1f} ms (bubble {row['colo_bubble']:5.1%})  "
            f"simulated {sim.makespan * 1e3:7.1f} ms ({row['simulator_error']:+.1%})  "
            f"torch {torch_name} {torch_text}",
            flush=True,
        )
    return {
        "benchmark": "pipeline_schedules",
        "device": "cpu (gloo on loopback), stages cost fixed sleeps",
        "num_ranks": NUM_RANKS,
        "num_microbatches": args.microbatches,
        "sleep_per_op_s": seconds,
        "busy_per_rank_s": busy,
        "torch_version": torch.__version__,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=("all", "sleep", "compute"), default="all")
    parser.add_argument("--ms", type=float, default=20.0, help="sleep of each of F, B and W per stage (ms)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile-repeats", type=int, default=10, help="rounds of the per-stage cost profile")
    parser.add_argument("--json", default=str(RESULTS / "pipeline_schedules_cpu.json"))
    args = parser.parse_args()
    path = Path(args.json)
    result = json.loads(path.read_text()) if path.exists() else {}
    if args.section in ("all", "sleep"):
        print(f"== sleep-based stages, p={NUM_RANKS}", flush=True)
        result = {**_sleep_section(args), "real_compute_p2": result.get("real_compute_p2")}
    if args.section in ("all", "compute"):
        print(f"== real compute, p={COMPUTE_RANKS}", flush=True)
        result["real_compute_p2"] = _compute_section(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
