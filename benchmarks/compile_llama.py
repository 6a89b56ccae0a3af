#!/usr/bin/env python3
"""torch.compile vs eager for colo's native Llama on CPU: tokens/s of training steps and the compile time.

colo.kernels' ops are torch operators (``torch.ops.colo.*``), so ``torch.compile(model, fullgraph=True)`` captures
the whole model in one graph; inductor generates code for everything around the colo ops (embedding, residual
adds, reshapes, the optimizer is not compiled) and calls the ops themselves as opaque kernels (on CPU their torch
reference backend). The recipe is BENCHMARKS.md's: the native Llama of preset ``bench-25m`` (hidden 512,
intermediate 1376, 6 layers, 8 heads, 4 kv heads, vocab 8192, untied: 25.8M parameters), fp32,
``torch.optim.AdamW(lr=3e-4, fused=True)``, random token batches (``labels = input_ids``, a different seed per
step), one process, one thread. Two shapes: compute-bound (4 x 256 tokens per step) and overhead-bound (1 x 128).

Rows (``--impls``): ``eager``; ``aot_eager`` (``torch.compile(backend="aot_eager", fullgraph=True)``: graph capture
and AOTAutograd without code generation, the bit-equal configuration the tests use); ``inductor``
(``torch.compile(fullgraph=True)``, the default backend). Each row builds a fresh model from the same seed, runs
``--warmup`` steps (the first one compiles forward and backward; its wall time minus the row's median timed step is
reported as the compile time; the first repeat compiles cold, later ones may hit inductor's on-disk caches) and
``--steps`` timed ones. Rows are interleaved per repeat (``--repeats``), the
order rotating; the summary gives medians. Every row trains on the same batches from the same weights, so each
compiled row's losses are checked against eager's step by step (``rtol=1e-5``: inductor fuses and reorders the
element-wise ops around the colo kernels; aot_eager should be bit-equal and its largest relative difference is
reported too).

Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_llama.py --json benchmarks/results/compile_llama_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from colo.apps import Llama, get_preset

SHAPES = {"compute": (4, 256), "overhead": (1, 128)}
IMPLS = ("eager", "aot_eager", "inductor")


def _batch(step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1000 + step))


def run_row(impl: str, shape: str, *, preset: str, warmup: int, steps: int) -> dict:
    """One row: a fresh model, ``warmup + steps`` training steps; times, compile time and losses."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = get_preset(preset)
    model = Llama(config)
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    step_model = model
    if impl == "aot_eager":
        step_model = torch.compile(model, backend="aot_eager", fullgraph=True)
    elif impl == "inductor":
        step_model = torch.compile(model, fullgraph=True)
    batch, seq = SHAPES[shape]
    times, losses = [], []
    for step in range(warmup + steps):
        ids = _batch(step, batch, seq, config.vocab_size)
        start = time.perf_counter()
        loss = step_model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    timed = times[warmup:]
    step_time = statistics.median(timed)
    return {
        "impl": impl,
        "shape": shape,
        "tokens_per_s": batch * seq / step_time,
        "step_s": step_time,
        "first_step_s": times[0],
        "compile_s": times[0] - step_time if impl != "eager" else 0.0,
        "losses": losses,
        "load_avg": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-25m")
    parser.add_argument("--shapes", default="compute,overhead")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    impls = args.impls.split(",")
    rows = []
    for shape in args.shapes.split(","):
        for repeat in range(args.repeats):
            order = impls[repeat % len(impls) :] + impls[: repeat % len(impls)]
            for impl in order:
                row = run_row(impl, shape, preset=args.preset, warmup=args.warmup, steps=args.steps)
                row["repeat"] = repeat
                rows.append(row)
                print(
                    f"{shape:9s} {impl:9s} repeat {repeat}: {row['tokens_per_s']:8.1f} tokens/s, "
                    f"step {row['step_s']:.3f} s, compile {row['compile_s']:.1f} s, load {row['load_avg']:.1f}",
                    flush=True,
                )
    summary = {}
    for shape in args.shapes.split(","):
        eager = [r for r in rows if r["shape"] == shape and r["impl"] == "eager"]
        eager_losses = eager[0]["losses"] if eager else None
        for impl in impls:
            mine = [r for r in rows if r["shape"] == shape and r["impl"] == impl]
            entry = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "compile_s": statistics.median(r["compile_s"] for r in mine),
                # the first repeat compiles from scratch; later ones may hit inductor's on-disk caches
                "compile_s_per_repeat": [round(r["compile_s"], 2) for r in mine],
            }
            if eager_losses is not None:
                worst = max(abs(a - b) / abs(b) for r in mine for a, b in zip(r["losses"], eager_losses, strict=True))
                entry["max_rel_loss_diff_vs_eager"] = worst
                entry["losses_match_rtol_1e-5"] = worst <= 1e-5
            summary[f"{shape}/{impl}"] = entry
        if eager:
            eager_tps = summary[f"{shape}/eager"]["tokens_per_s"]
            for impl in impls:
                summary[f"{shape}/{impl}"]["speedup_vs_eager"] = summary[f"{shape}/{impl}"]["tokens_per_s"] / eager_tps
    for key, entry in summary.items():
        print(key, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}))
    if args.json:
        result = {
            "benchmark": "compile_llama",
            "device": "cpu",
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "settings": vars(args),
            "summary": summary,
            "rows": rows,
        }
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
