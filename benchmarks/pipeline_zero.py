#!/usr/bin/env python3
"""ZeRO x PP on 4 CPU processes (pp2 x dp2, gloo): colo's ``HybridParallel(pp=2, zero_stage=3)`` next to
torchtitan's composition, FSDP2 ``fully_shard`` per stage + ``torch.distributed.pipelining`` (issue 43).

The same model, data and optimizer in every row: colo's native ``Llama`` (``get_preset(--preset)``, default
``tiny-llama``: 5.0M parameters, hidden 256, 4 layers, vocabulary 4096; untied embeddings), built on the meta
device and materialized from one seed, cut into two stages of contiguous decoder layers (the embedding on the
first, the final norm and ``lm_head`` on the last), ``torch.optim.AdamW(lr=3e-4, fused=True)``, random tokens (a
different seed per step and data rank, the same in every row), ``--microbatches`` microbatches per step, the loss
``causal_lm_loss`` (the mean next-token cross-entropy of each microbatch, averaged
over the microbatches and the data ranks). One thread per rank, ``OMP_NUM_THREADS=1``. Rows:

- ``colo_z3_1f1b``: ``HybridParallel(pp=2, zero_stage=3, schedule="1f1b", pipeline_zero_sync="step")``
  (each stage's chunks gathered once per step, held over the microbatches, reduce-scattered after the last
  backward: torchtitan's ``reshard_after_forward=False`` layout);
- ``colo_z3_zbh1``: the same under ``schedule="zero_bubble_h1"`` (torch's pipelining has no single-chunk ZB-H1:
  reported beside the peer, not against a torch row of its own);
- ``colo_z1_1f1b``: ``zero_stage=1`` under 1F1B (the cost of sharding parameters and gradients);
- ``torch_fsdp2_pp``: the peer. A 2D ``DeviceMesh("cpu", (2, 2), ("pp", "dp"))`` (rank = 2 * stage + data rank,
  colo's layout); this rank's stage (colo's ``LlamaStage``, the same module colo pipelines, so the same kernels),
  ``fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)`` on each decoder layer and on the stage root
  (torchtitan under PP), ``PipelineStage`` over ``mesh["pp"]`` and ``Schedule1F1B(stage, microbatches,
  loss_fn=causal_lm_loss)`` (torch scales the gradients by 1 / microbatches, FSDP2 averages over dp: the same
  gradients as colo's).

Reported per row: tokens/s (``dp x batch x seq x steps / the slowest rank's wall time`` after ``--warmup`` steps),
peak RSS (``ru_maxrss``, max over the 4 ranks, each row in fresh processes), every step's loss (the rows must
agree). ``--repeats`` interleaves the rows (the order rotates per repeat) and the summary holds medians, with the
ratios colo / peer: 4 ranks share 2 loaded cores, so read the ratios, not the absolute figures.

Run (one command runs every row)::

    python benchmarks/pipeline_zero.py [--preset tiny-llama] [--shapes compute overhead] [--microbatches 4]
        [--steps 6] [--warmup 2] [--repeats 4]

Writes ``benchmarks/results/pipeline_zero_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PP, DP = 2, 2
LR = 3e-4
IMPLS = {
    "colo_z3_1f1b": "colo HybridParallel(pp=2, zero_stage=3), 1F1B, step policy",
    "colo_z3_zbh1": "colo HybridParallel(pp=2, zero_stage=3), ZB-H1, step policy",
    "colo_z1_1f1b": "colo HybridParallel(pp=2, zero_stage=1), 1F1B",
    "colo_z1_zbh1": "colo HybridParallel(pp=2, zero_stage=1), ZB-H1 (not a default row)",
    "torch_fsdp2_pp": "torch FSDP2 fully_shard per stage (reshard_after_forward=False) + pipelining Schedule1F1B",
}
DEFAULT_IMPLS = ["colo_z3_1f1b", "colo_z3_zbh1", "colo_z1_1f1b", "torch_fsdp2_pp"]
PEER = "torch_fsdp2_pp"
SHAPES = {"compute": (4, 256), "overhead": (4, 64)}
"""Per data rank per step: (sequences, tokens per sequence), cut into ``--microbatches`` microbatches of rows:
with 4 microbatches, 1 x 256 tokens (compute-leaning) and 1 x 64 tokens (communication and framework overhead
dominate)."""
COLO_SETTINGS = {
    "colo_z3_1f1b": {"zero_stage": 3, "schedule": "1f1b", "pipeline_zero_sync": "step"},
    "colo_z3_zbh1": {"zero_stage": 3, "schedule": "zero_bubble_h1", "pipeline_zero_sync": "step"},
    "colo_z1_1f1b": {"zero_stage": 1, "schedule": "1f1b"},
    "colo_z1_zbh1": {"zero_stage": 1, "schedule": "zero_bubble_h1"},
}


def _config(preset: str):
    from colo.apps import get_preset

    return get_preset(preset, tie_word_embeddings=False)


def _meta_model(preset: str):
    from colo.apps import Llama

    with torch.device("meta"):
        return Llama(_config(preset))


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=True)


def token_batch(seed: int, step: int, data_rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Random tokens, a different seed per (step, data rank); the same in every row."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + data_rank)
    return torch.randint(0, vocab, (batch, seq), generator=generator)


def setup_colo(impl: str, preset: str, microbatches: int, seed: int):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel

    model = _meta_model(preset)  # the plugin materializes only this rank's stage, from `seed`
    plugin = HybridParallel(pp=PP, num_microbatches=microbatches, seed=seed, precision="fp32", **COLO_SETTINGS[impl])
    booster = Booster(plugin)
    booster.boost(model, _adamw(model.parameters()))

    def step(tokens: torch.Tensor) -> float:
        return float(booster.train_step({"input_ids": tokens, "labels": tokens}).loss)

    return step


def setup_torch(impl: str, preset: str, microbatches: int, seed: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from colo.apps.models.llama import llama_pipeline_stages
    from colo.apps.models.llama.loss import causal_lm_loss

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    stage_index = mesh["pp"].get_local_rank()
    model = _meta_model(preset)
    module = llama_pipeline_stages(model, PP)[stage_index]
    del model  # only this rank's stage is materialized
    module.to_empty(device="cpu")
    module.init_weights(seed)  # the values the whole model gets from `seed`, as colo's plugin materializes it
    for layer in module.layers.values():
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    optimizer = _adamw(module.parameters())
    stage = PipelineStage(module, stage_index, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, microbatches, loss_fn=causal_lm_loss)
    first, last = stage_index == 0, stage_index == PP - 1
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    last_rank = dist.get_global_rank(pp_group, PP - 1)

    def step(tokens: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(tokens)
        else:
            schedule.step(target=tokens, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # the mean over microbatches and data ranks, on every rank (as the booster reports it; outside the compute)
        value = torch.stack(losses).mean().detach() if last else torch.zeros(())
        dist.all_reduce(value, group=dp_group)
        dist.broadcast(value, src=last_rank, group=pp_group)
        return value.item() / DP

    return step


def run_row(impl: str, preset: str, batch: int, seq: int, microbatches: int, steps: int, warmup: int, seed: int):
    """One rank of one row: build, warm up, time ``steps`` steps; every step's loss and this rank's peak RSS."""
    import resource

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    data_rank = rank % DP  # pp is the outer axis in both layouts: ranks d and DP + d share a batch
    vocab = _config(preset).vocab_size
    step = (setup_torch if impl == PEER else setup_colo)(impl, preset, microbatches, seed)
    losses, times, start = [], [], None
    for index in range(warmup + steps):
        if index == warmup:
            dist.barrier()
            start = time.perf_counter()
        t0 = time.perf_counter()
        losses.append(step(token_batch(seed, index, data_rank, batch, seq, vocab)))
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return {
        "elapsed_s": time.perf_counter() - start,
        "step_s": times,
        "losses": losses,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure(impl: str, shape: str, args) -> dict:
    from colo.comm import RankFailure, RankTimeout, launch

    batch, seq = SHAPES[shape]
    try:
        per_rank = launch(
            run_row, PP * DP, impl, args.preset, batch, seq, args.microbatches, args.steps, args.warmup,
            args.seed, backend="gloo", threads=1, env={"OMP_NUM_THREADS": "1"}, timeout=args.row_timeout,
        )  # fmt: skip
    except (RankFailure, RankTimeout) as error:
        return {"impl": impl, "shape": shape, "error": str(error)}
    except Exception as error:  # noqa: BLE001 - recorded, not hidden
        return {"impl": impl, "shape": shape, "error": f"{type(error).__name__}: {error}"}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    return {
        "impl": impl,
        "shape": shape,
        "tokens_per_s": DP * batch * seq * args.steps / elapsed,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in per_rank],
        "median_step_s": statistics.median(per_rank[0]["step_s"][args.warmup :]),
        "losses": per_rank[0]["losses"],
    }


def _load() -> list[float]:
    return list(os.getloadavg())


def summarize(runs: list[dict], args) -> dict:
    """Medians over the repeats of one shape, and the ratios colo / peer and ZeRO-3 / ZeRO-1."""
    rows: dict = {}
    for impl in args.impls:
        ok = [r for r in runs if r["impl"] == impl and "error" not in r]
        if not ok:
            failed = [r["error"] for r in runs if r["impl"] == impl]
            rows[impl] = {"error": failed[0] if failed else "not run"}
            continue
        rows[impl] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
            "tokens_per_s_repeats": [r["tokens_per_s"] for r in ok],
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ok),
            "peak_rss_mb_repeats": [r["peak_rss_mb"] for r in ok],
            "peak_rss_mb_per_rank": ok[0]["peak_rss_mb_per_rank"],
            "median_step_s_rank0": statistics.median(r["median_step_s"] for r in ok),
            "losses": ok[0]["losses"],
        }
    ratios = {}
    peer = rows.get(PEER, {})
    for impl in args.impls:
        if impl == PEER or "tokens_per_s" not in rows[impl] or "tokens_per_s" not in peer:
            continue
        ratios[f"{impl}/{PEER}"] = {
            "tokens_per_s": rows[impl]["tokens_per_s"] / peer["tokens_per_s"],
            "peak_rss": rows[impl]["peak_rss_mb"] / peer["peak_rss_mb"],
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(rows[impl]["losses"], peer["losses"])),
        }
    z1 = rows.get("colo_z1_1f1b", {})
    for impl in ("colo_z3_1f1b", "colo_z3_zbh1"):
        if "tokens_per_s" in rows.get(impl, {}) and "tokens_per_s" in z1:
            ratios[f"{impl}/colo_z1_1f1b"] = {
                "tokens_per_s": rows[impl]["tokens_per_s"] / z1["tokens_per_s"],
                "peak_rss": rows[impl]["peak_rss_mb"] / z1["peak_rss_mb"],
            }
    return {"rows": rows, "ratios": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=DEFAULT_IMPLS)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(RESULTS / "pipeline_zero_cpu.json"))
    parser.add_argument(
        "--append",
        action="store_true",
        help="add this run's repeats to those already in --out (same recipe) and summarize them all",
    )
    args = parser.parse_args()
    load_before = _load()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    previous, sessions = [], []
    if args.append and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        keys = ("preset", "microbatches", "steps", "warmup", "seed")
        if any(old["recipe"][key] != getattr(args, key) for key in keys):
            raise SystemExit(f"--append: {args.out} was measured with another recipe ({keys})")
        previous = old["runs"]
        sessions = old["machine"].get(
            "sessions", [{k: old["machine"][k] for k in ("started_utc", "load_avg_before", "load_avg_after")}]
        )
    offset = 1 + max((r["repeat"] for r in previous), default=-1)
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(args.impls)
        for shape in args.shapes:
            for impl in args.impls[shift:] + args.impls[:shift]:
                row = measure(impl, shape, args)
                row["repeat"], row["load_avg"] = offset + repeat, _load()
                runs.append(row)
                status = (
                    f"{row['tokens_per_s']:8.1f} tokens/s, {row['peak_rss_mb']:.0f} MB"
                    if "error" not in row
                    else "FAILED"
                )
                print(f"[repeat {repeat}] {shape:>8} {impl:>15}: {status} (load {row['load_avg'][0]:.1f})", flush=True)
                if "error" in row:
                    print(row["error"][-3000:], flush=True)
    runs = previous + runs
    shapes = sorted({r["shape"] for r in runs}, key=list(SHAPES).index)
    args.impls = [impl for impl in IMPLS if any(r["impl"] == impl for r in runs)]
    args.shapes = shapes
    summary: dict = {shape: summarize([r for r in runs if r["shape"] == shape], args) for shape in args.shapes}
    for shape in args.shapes:
        batch, seq = SHAPES[shape]
        print(f"\n{shape}: {batch} x {seq} tokens per data rank per step, {args.microbatches} microbatches")
        print("| row (pp2 x dp2, 4 processes) | tokens/s (median) | peak RSS, max over ranks (MB) |")
        print("|---|---|---|")
        for impl in args.impls:
            row = summary[shape]["rows"][impl]
            if "error" in row:
                print(f"| {IMPLS[impl]} | failed | - |")
            else:
                print(f"| {IMPLS[impl]} | {row['tokens_per_s']:.0f} | {row['peak_rss_mb']:.0f} |")
        for name, ratio in summary[shape]["ratios"].items():
            extra = f", max |loss diff| {ratio['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in ratio else ""
            print(f"{name}: tokens/s {ratio['tokens_per_s']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x{extra}")
    config = _config(args.preset)
    params = sum(p.numel() for p in _meta_model(args.preset).parameters())
    result = {
        "benchmark": "pp2 x dp2 ZeRO-3 x PP, 4 CPU processes (gloo): colo HybridParallel vs torch FSDP2 + "
        "torch.distributed.pipelining (torchtitan's composition), issue 43",
        "machine": {
            "description": "shared 2-core CPU (other sessions' jobs running), 4 ranks x 1 thread, no GPU",
            "cpu_count": os.cpu_count(),
            "load_avg_before": load_before,
            "load_avg_after": _load(),
            "started_utc": started,
            "sessions": [
                *sessions,
                {"started_utc": started, "load_avg_before": load_before, "load_avg_after": _load()},
            ],
            "repeats_total": 1 + max(r["repeat"] for r in runs),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "world_size": PP * DP,
        },
        "recipe": {
            "model": {
                "preset": args.preset,
                "parameters": params,
                **{
                    k: getattr(config, k)
                    for k in (
                        "vocab_size",
                        "hidden_size",
                        "intermediate_size",
                        "num_hidden_layers",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "tie_word_embeddings",
                    )
                },
            },
            "optimizer": f"torch.optim.AdamW(lr={LR}, fused=True)",
            "shapes": {
                shape: {
                    "batch_per_data_rank": SHAPES[shape][0],
                    "seq": SHAPES[shape][1],
                    "tokens_per_step": DP * SHAPES[shape][0] * SHAPES[shape][1],
                }
                for shape in args.shapes
            },
            **vars(args),
        },
        "rows": {impl: IMPLS[impl] for impl in args.impls},
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
