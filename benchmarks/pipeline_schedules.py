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
``zero_bubble_h1``). Writes ``benchmarks/results/pipeline_schedules_cpu.json``.

    python benchmarks/pipeline_schedules.py [--ms 20] [--microbatches 8] [--steps 3]
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

from colo.comm import Mesh, P2POp, barrier, batch_send_recv, launch
from colo.pipeline import CostModel, PipelineExecutor, make_schedule, simulate

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


def _p2p_latency(group, rounds=40):
    """Median seconds of one small message between neighbours (ping-pong between ranks 2k and 2k+1, halved)."""
    rank = group.rank
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    message, reply = torch.zeros(BATCH_PER_MICROBATCH, DIM), torch.empty(BATCH_PER_MICROBATCH, DIM)
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


def _torch(class_name, num_chunks, microbatches, seconds, steps):
    from torch.distributed import pipelining

    mesh = Mesh(pp=NUM_RANKS)
    group = mesh.group("pp").process_group
    rank = mesh.rank("pp")
    share = seconds / num_chunks
    num_stages = NUM_RANKS * num_chunks
    stages = [
        pipelining.PipelineStage(
            SleepStage(share, share, share), rank + chunk * NUM_RANKS, num_stages, torch.device("cpu"), group=group
        )
        for chunk in range(num_chunks)
    ]
    schedule_class = getattr(pipelining, class_name)
    if class_name in ("ScheduleGPipe", "Schedule1F1B"):
        schedule = schedule_class(stages[0], microbatches, loss_fn=_loss)
    else:
        schedule = schedule_class(stages, microbatches, loss_fn=_loss)
    batch = torch.randn(microbatches * BATCH_PER_MICROBATCH, DIM)
    target = torch.randn(microbatches * BATCH_PER_MICROBATCH, DIM)
    first, last = rank == 0, rank == (num_stages - 1) % NUM_RANKS

    def run_step():
        kwargs = {"target": target, "losses": []} if last else {}
        if first:
            schedule.step(batch, **kwargs)
        else:
            schedule.step(**kwargs)

    try:
        return {"times": _timed_steps(run_step, steps)}
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        return {"error": f"{type(error).__name__}: {error}"}


def _simulated(schedule_name, num_chunks, microbatches, seconds, p2p):
    share = seconds / num_chunks
    # the first stage's input needs no gradient: its B is empty and its W runs the whole backward
    overrides = {("B", 0): 0.0, ("W", 0): 2 * share} if schedule_name == "zero_bubble_h1" else None
    cost = CostModel(forward=share, backward_input=share, backward_weight=share, p2p=p2p, overrides=overrides)
    schedule = make_schedule(schedule_name, NUM_RANKS, microbatches, num_chunks=num_chunks)
    return simulate(schedule, cost)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", type=float, default=20.0, help="sleep of each of F, B and W per stage (ms)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=str(RESULTS / "pipeline_schedules_cpu.json"))
    args = parser.parse_args()
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
    result = {
        "benchmark": "pipeline_schedules",
        "device": "cpu (gloo on loopback), stages cost fixed sleeps",
        "num_ranks": NUM_RANKS,
        "num_microbatches": args.microbatches,
        "sleep_per_op_s": seconds,
        "busy_per_rank_s": busy,
        "torch_version": torch.__version__,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
