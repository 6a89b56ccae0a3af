#!/usr/bin/env python3
"""Mixture of experts: expert parallelism against replicated experts on 2 processes, and grouped against loop experts.

Part 1 (``ep``): colo's `MoELlama` (hidden 256, intermediate 384, 4 layers, every MLP 8 experts top-2, vocab 4096:
the ``tiny-mixtral`` preset with ``moe_layer_interval=1``), fp32, ``torch.optim.AdamW(lr=3e-4)``, through the Booster
with the `ExpertParallel` plugin and ZeRO-2 on 2 processes (gloo, one thread each), in two rows run in fresh
processes each:

- ``ep2``: ``ExpertParallel(ep=2)``: each rank holds 4 of the 8 experts per layer, tokens travel by all-to-all;
- ``replicated``: ``ExpertParallel(ep=1)`` (``Mesh(dp=2, ep=1)``): every rank holds all 8 experts (plain ZeRO-2 over
  dp=2 for every parameter), no all-to-all.

Both see the same batches (a different seed per step and rank) from the same initial weights, so their losses
agree to rounding (printed). Reported: tokens/s over both ranks after ``--warmup`` steps (median of ``--repeats``
interleaved runs: the machine is shared and noisy), peak RSS (max over ranks; every rank builds the whole model
before its experts are split, so it bounds the peak on the CPU) and the parameter bytes a rank holds after boosting.

Part 2 (``experts``): one `GroupedExperts` of 8 experts (hidden 256, intermediate 384) on ``--tokens`` rows routed
top-2 (uneven counts), forward + backward, ``impl="grouped"`` (``torch.nn.functional.grouped_mm``) against
``impl="loop"`` (one matmul per expert), on the CPU (one thread) and on CUDA when present (fp32 and bf16);
median time per step over ``--iters``.

    python benchmarks/moe_ep.py [--steps 6] [--warmup 2] [--repeats 3] [--iters 20] [--parts ep experts]

Writes ``benchmarks/results/moe_ep_cpu.json`` (``moe_ep_gpu.json`` when CUDA is present).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, SEQ = 4, 128
"""Per rank per step: sequences of tokens."""


def _model():
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    model = MoELlama(get_moe_preset("tiny-mixtral", moe_layer_interval=1))
    model.init_weights(seed=0)
    return model


def run_rank(ep: int, num_steps: int, num_warmup: int) -> dict:
    """One rank of one row: boost, warm up, time ``num_steps`` steps."""
    import resource

    import torch.distributed as dist

    from colo.apps.booster import Booster, ExpertParallel

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model()
    booster = Booster(ExpertParallel(ep=ep, stage=2))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    param_bytes = sum(p.numel() * p.element_size() for p in booster.unwrap().parameters())
    losses, start = [], None
    for index in range(num_warmup + num_steps):
        if index == num_warmup:
            dist.barrier()
            start = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * index + rank)
        tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=generator)
        losses.append(booster.train_step({"input_ids": tokens, "labels": tokens}).loss)
    dist.barrier()
    return {
        "elapsed_s": time.perf_counter() - start,
        "losses": losses,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "param_mb": param_bytes / 2**20,
    }


def measure_ep(args) -> dict:
    """Both rows ``--repeats`` times, interleaved (the order alternates); medians of tokens/s."""
    from colo.comm import launch

    rows = {"ep2": {"ep": 2, "runs": []}, "replicated": {"ep": 1, "runs": []}}
    for repeat in range(args.repeats):
        order = list(rows) if repeat % 2 == 0 else list(reversed(rows))
        for label in order:
            ep = rows[label]["ep"]
            per_rank = launch(run_rank, 2, ep, args.steps, args.warmup, backend="gloo", threads=1, timeout=900)
            elapsed = max(r["elapsed_s"] for r in per_rank)
            rows[label]["runs"].append(
                {
                    "tokens_per_s": 2 * BATCH * SEQ * args.steps / elapsed,
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
                    "param_mb": per_rank[0]["param_mb"],
                    "losses": per_rank[0]["losses"],
                }
            )
    for row in rows.values():
        runs = row["runs"]
        row["tokens_per_s"] = statistics.median(run["tokens_per_s"] for run in runs)
        row["peak_rss_mb"] = statistics.median(run["peak_rss_mb"] for run in runs)
        row["param_mb"] = runs[0]["param_mb"]
        row["losses"] = runs[0]["losses"]
    return rows


def _time_experts(impl: str, device: str, dtype: torch.dtype, tokens: int, iters: int) -> float:
    from colo.tensor.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(8, 256, 384, impl=impl).to(device=device, dtype=dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    choice = torch.randint(0, 8, (tokens * 2,), generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(choice, minlength=8).to(device)
    x = torch.randn(tokens * 2, 256, device=device, dtype=dtype, requires_grad=True)
    times = []
    for index in range(iters + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        experts(x, counts).float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 3:
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_experts(args) -> dict:
    torch.set_num_threads(1)
    cases = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        cases += [("cuda", torch.float32), ("cuda", torch.bfloat16)]
    rows = {}
    for device, dtype in cases:
        name = f"{device}_{str(dtype).removeprefix('torch.')}"
        loop = _time_experts("loop", device, dtype, args.tokens, args.iters)
        grouped = _time_experts("grouped", device, dtype, args.tokens, args.iters)
        rows[name] = {"loop_ms": loop * 1e3, "grouped_ms": grouped * 1e3, "speedup": loop / grouped}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--parts", nargs="+", default=["ep", "experts"], choices=["ep", "experts"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = {
        "benchmark": "moe_ep",
        "host": {"python": sys.version.split()[0], "torch": torch.__version__, "machine": platform.machine()},
        "args": vars(args) | {"out": None},
    }
    if "ep" in args.parts:
        result["ep"] = measure_ep(args)
        print("| row | tokens/s (2 ranks, median) | peak RSS MiB | parameters MiB / rank | losses |")
        print("|---|---|---|---|---|")
        for label, row in result["ep"].items():
            losses = ", ".join(f"{v:.4f}" for v in row["losses"])
            print(
                f"| {label} | {row['tokens_per_s']:.0f} | {row['peak_rss_mb']:.0f} | {row['param_mb']:.1f} | {losses} |"
            )
    if "experts" in args.parts:
        result["experts"] = measure_experts(args)
        print("| device / dtype | loop ms | grouped ms | loop / grouped |")
        print("|---|---|---|---|")
        for name, row in result["experts"].items():
            print(f"| {name} | {row['loop_ms']:.2f} | {row['grouped_ms']:.2f} | {row['speedup']:.2f} |")
    suffix = "gpu" if torch.cuda.is_available() else "cpu"
    out = args.out or RESULTS / f"moe_ep_{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
