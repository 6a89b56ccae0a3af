#!/usr/bin/env python3
"""`colo plan` on this machine: the planner's top candidates for a CPU workload, run for real on 2 ranks.

The ``cpu`` cluster preset's compute figures are first measured here (fp32 matmul FLOP/s and memory bandwidth in
one process; the gloo link keeps the preset's figures). The planner then ranks every layout of the workload (the
tiny-llama shape, fp32, 2 ranks); from the ranked list the fastest layout of each distinct structure (tp, pp,
checkpointing) is kept, and the first three whose predicted step times span at least 20% are run through the
Booster on 2 ranks (``--steps`` timed steps after 2 warm-up steps, median). Reported: predicted and measured step
time of each, and whether the planner's choice (the first) is within 5% of the measured fastest.

Run::

    OMP_NUM_THREADS=1 python benchmarks/plan_cpu.py [--steps 5] [--out benchmarks/results/plan_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

SEQ, GLOBAL_BATCH, PRESET = 256, 8, "tiny-llama"


def measure_machine() -> dict:
    """fp32 matmul FLOP/s and copy bandwidth of one thread (what each rank gets)."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    began, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        a @ b
    flops = 2 * 512**3 * repeats / (time.perf_counter() - began)
    x = torch.empty(1 << 24)
    y = torch.empty_like(x)
    y.copy_(x)
    began = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    bandwidth = 2 * x.numel() * 4 * 5 / (time.perf_counter() - began)
    return {"fp32_flops": flops, "memory_bandwidth": bandwidth}


def _run_layout(fields: dict, steps: int) -> list[float]:
    import torch

    from colo.apps import Booster, Llama, get_preset
    from colo.apps.plan import Layout

    torch.set_num_threads(1)
    layout = Layout(**fields)
    torch.manual_seed(0)
    config = get_preset(PRESET)
    model = Llama(config)
    booster = Booster(layout.plugin_object())
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    mesh = booster.engine.mesh
    rows = GLOBAL_BATCH // mesh.size("dp")
    times = []
    for step in range(2 + steps):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, SEQ), generator=generator)
        start = mesh.rank("dp") * rows
        batch = {"input_ids": ids[start : start + rows], "labels": ids[start : start + rows].clone()}
        torch.distributed.barrier()
        began = time.perf_counter()
        booster.train_step(batch)
        torch.distributed.barrier()
        times.append(time.perf_counter() - began)
    return times[2:]


def main() -> None:
    from colo.apps.models.llama import get_preset
    from colo.apps.plan import Workload, get_cluster, search
    from colo.comm.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/plan_cpu.json")
    args = parser.parse_args()
    machine = measure_machine()
    base = get_cluster("cpu")
    cluster = dataclasses.replace(
        base,
        peak_flops={"fp32": machine["fp32_flops"], "bf16": machine["fp32_flops"] / 10},
        memory_bandwidth=machine["memory_bandwidth"],
    )
    workload = Workload(get_preset(PRESET), SEQ, GLOBAL_BATCH, model_name=PRESET, precision="fp32")
    ranked = search(workload, cluster, top=10_000, micro_batch_sizes=(1, 2, 4))
    distinct, seen = [], set()
    for result in ranked:
        layout = result.layout
        key = (layout.tp, layout.pp, layout.activation_checkpointing)
        if key not in seen:
            seen.add(key)
            distinct.append(result)
    chosen = [distinct[0]]
    for result in distinct[1:]:
        if len(chosen) == 2 and result.time.total < 1.2 * chosen[0].time.total:
            continue
        chosen.append(result)
        if len(chosen) == 3:
            break
    rows = []
    for result in chosen:
        fields = {f.name: getattr(result.layout, f.name) for f in dataclasses.fields(result.layout) if f.init}
        per_rank = run_distributed(_run_layout, fields, args.steps, world_size=2, timeout=600)
        measured = statistics.median(max(times) for times in zip(*per_rank))
        rows.append(
            {
                "layout": result.layout.describe(),
                "predicted_step_s": round(result.time.total, 4),
                "measured_step_s": round(measured, 4),
                "predicted_memory_mib": round(result.memory.device_total / 2**20, 1),
            }
        )
        print(f"{rows[-1]['layout']:60} predicted {result.time.total:.3f} s  measured {measured:.3f} s")
    fastest = min(row["measured_step_s"] for row in rows)
    summary = {
        "workload": {"model": PRESET, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "precision": "fp32", "ranks": 2},
        "machine": machine,
        "predicted_spread": round(rows[-1]["predicted_step_s"] / rows[0]["predicted_step_s"] - 1, 3),
        "chosen_vs_fastest_measured": round(rows[0]["measured_step_s"] / fastest - 1, 4),
        "chosen_within_5pct": rows[0]["measured_step_s"] <= 1.05 * fastest,
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
