#!/usr/bin/env python3
"""FSDP x TP on 4 CPU processes: colo's ``HybridParallel(tp=2, zero_stage=3)`` next to torch FSDP2 + DTensor TP.

The shared recipe of BENCHMARKS.md (`zero_dp.py`'s model, optimizer, batches and timing), laid out dp2 x tp2 over
4 processes, gloo on loopback, one thread per rank. The two tensor-parallel ranks of a data rank share its batch,
so every step trains on 2 x (sequences x tokens) per row:

- ``colo``: ``Booster(HybridParallel(tp=2, zero_stage=3)).boost(model, AdamW(...))``, ``booster.train_step``: the
  Hugging Face Llama plan (q/k/v, gate/up column-parallel, o/down row-parallel, vocabulary-parallel embedding and
  ``lm_head`` with the vocabulary-parallel loss), each rank's tp shards packed in chunks sharded over dp and
  gathered per chunk with prefetch;
- ``fsdp2_tp``: torchtitan's recipe on the same model, ``parallelize_module`` over ``mesh["tp"]`` (the same
  column / row split, ``embed_tokens`` row-parallel over the vocabulary, ``lm_head`` column-parallel with its
  logits left sharded for ``loss_parallel``), then ``fully_shard`` on each decoder layer and the root over
  ``mesh["dp"]``; the next-token loss by ``F.cross_entropy`` under ``loss_parallel()``.

Both use ``torch.optim.AdamW(lr=3e-4, fused=True)``. Reported per row: tokens/s over the data ranks (``dp x batch x
seq x steps / slowest rank's wall time``), peak RSS (max over ranks), every step's loss (the rows must agree: the
same model, data and optimizer). ``--repeats`` interleaves the rows and reports medians: 4 ranks share the
machine's cores, so read the ratio, not the absolute figures.

Run::

    python benchmarks/hybrid_zero3.py [--shapes compute overhead] [--steps 8] [--warmup 2] [--repeats 3]

Writes ``benchmarks/results/hybrid_zero3_cpu.json`` (``--out``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_dp import LR, MODEL_CONFIG, SHAPES, build_model, token_batch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DP, TP = 2, 2
IMPLS = {
    "colo": "colo HybridParallel(tp=2, zero_stage=3)",
    "fsdp2_tp": "torch FSDP2 + DTensor TP (parallelize_module, fully_shard)",
}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=True)


def setup_colo(model):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel

    booster = Booster(HybridParallel(tp=TP, zero_stage=3))
    booster.boost(model, _adamw(model.parameters()))

    def step(tokens: torch.Tensor) -> float:
        return booster.train_step({"input_ids": tokens, "labels": tokens}).loss

    return step


def setup_fsdp2_tp(model):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    parallelize_module(
        model,
        mesh["tp"],
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    layer_plan = {
        **dict.fromkeys(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ColwiseParallel()),
        "self_attn.o_proj": RowwiseParallel(),
        **dict.fromkeys(("mlp.gate_proj", "mlp.up_proj"), ColwiseParallel()),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], layer_plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = _adamw(model.parameters())
    dp_group = mesh["dp"].get_group()

    def step(tokens: torch.Tensor) -> float:
        logits = model(input_ids=tokens, use_cache=False).logits  # a DTensor sharded over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.full_tensor().detach() if hasattr(loss, "full_tensor") else loss.detach()
        dist.all_reduce(value, group=dp_group)  # the mean over data ranks, as the booster reports it
        return value.item() / DP

    return step


SETUPS = {"colo": setup_colo, "fsdp2_tp": setup_fsdp2_tp}


def run_row(impl: str, batch: int, seq: int, num_steps: int, num_warmup: int, seed: int) -> dict:
    """One rank of one row: build, warm up, time ``num_steps`` steps; the losses of every step and peak RSS."""
    import resource

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    data_rank = rank // TP  # tp is the innermost axis in both layouts: ranks 2d and 2d+1 share a batch
    model = build_model(seed)
    step = SETUPS[impl](model)
    losses, start = [], None
    for index in range(num_warmup + num_steps):
        if index == num_warmup:
            dist.barrier()
            start = time.perf_counter()
        losses.append(step(token_batch(seed, index, data_rank, batch, seq)))
    return {
        "elapsed_s": time.perf_counter() - start,
        "losses": losses,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure(impl: str, shape: str, args) -> dict:
    from colo.comm import RankFailure, RankTimeout, launch

    batch, seq = SHAPES[shape]
    try:
        per_rank = launch(
            run_row, DP * TP, impl, batch, seq, args.steps, args.warmup, args.seed,
            backend="gloo", threads=1, env={"OMP_NUM_THREADS": "1"}, timeout=args.row_timeout,
        )  # fmt: skip
    except (RankFailure, RankTimeout) as error:
        return {"impl": impl, "shape": shape, "error": str(error)}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    return {
        "impl": impl,
        "shape": shape,
        "tokens_per_s": DP * batch * seq * args.steps / elapsed,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "losses": per_rank[0]["losses"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=str(RESULTS / "hybrid_zero3_cpu.json"))
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        order = args.impls[repeat % len(args.impls) :] + args.impls[: repeat % len(args.impls)]
        for shape in args.shapes:
            for impl in order:
                row = measure(impl, shape, args)
                row["repeat"] = repeat
                runs.append(row)
                status = f"{row['tokens_per_s']:8.1f} tokens/s" if "error" not in row else "FAILED"
                print(f"[repeat {repeat}] {shape:>8} {impl:>9}: {status}", flush=True)
    summary = {}
    for shape in args.shapes:
        rows = {}
        for impl in args.impls:
            ok = [r for r in runs if r["impl"] == impl and r["shape"] == shape and "error" not in r]
            if not ok:
                failed = [r["error"] for r in runs if r["impl"] == impl and r["shape"] == shape]
                rows[impl] = {"error": failed[0] if failed else "not run"}
                print(f"{shape} / {impl} failed:\n{rows[impl]['error'][-3000:]}")
                continue
            rows[impl] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                "tokens_per_s_repeats": [r["tokens_per_s"] for r in ok],
                "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ok),
                "losses": ok[0]["losses"],
            }
        if all("tokens_per_s" in rows.get(impl, {}) for impl in IMPLS):
            rows["ratio_colo_over_fsdp2_tp"] = rows["colo"]["tokens_per_s"] / rows["fsdp2_tp"]["tokens_per_s"]
            rows["max_abs_loss_diff"] = max(
                abs(a - b) for a, b in zip(rows["colo"]["losses"], rows["fsdp2_tp"]["losses"])
            )
        summary[shape] = rows
    print(
        "\n| row (dp2 x tp2, 4 processes) | "
        + " | ".join(f"{s}-bound tokens/s" for s in args.shapes)
        + " | peak RSS (MB) |"
    )
    print("|---" * (len(args.shapes) + 2) + "|")
    for impl in args.impls:
        cells = [f"{summary[s][impl].get('tokens_per_s', float('nan')):.0f}" for s in args.shapes]
        rss = " / ".join(f"{summary[s][impl].get('peak_rss_mb', float('nan')):.0f}" for s in args.shapes)
        print(f"| {IMPLS[impl]} | " + " | ".join(cells) + f" | {rss} |")
    for shape in args.shapes:
        if "ratio_colo_over_fsdp2_tp" in summary[shape]:
            print(
                f"{shape}: colo / FSDP2+TP = {summary[shape]['ratio_colo_over_fsdp2_tp']:.2f}; "
                f"max |loss diff| {summary[shape]['max_abs_loss_diff']:.1e}"
            )
    result = {
        "benchmark": "dp2 x tp2 ZeRO-3 (FSDP x TP), 25.8M-parameter HF Llama, 4 CPU processes (gloo): colo vs "
        "torch FSDP2 + DTensor TP",
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "world_size": DP * TP},
        "recipe": {"model": MODEL_CONFIG, "lr": LR, "shapes": {s: SHAPES[s] for s in args.shapes}, **vars(args)},
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
