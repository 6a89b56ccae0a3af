#!/usr/bin/env python3
"""ZeRO / data parallelism on 2 CPU processes: colo ZeRO-1/2/3 next to torch DDP, FSDP2 and DeepSpeed ZeRO-2/3.

The shared recipe of BENCHMARKS.md: a Hugging Face ``LlamaForCausalLM`` built from a config (hidden 512,
intermediate 1376, 6 layers, 8 heads, 4 kv heads, vocab 8192, untied embeddings: 25.8M parameters), fp32 with
fp32 communication, ``torch.optim.AdamW(lr=3e-4, fused=True)`` for every row, random token batches with a
different seed per (step, rank), 2 warm-up steps then ``--steps`` timed ones, gloo on loopback, one thread per
rank (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``). Two shapes per rank per step: compute-bound
(4 x 256 tokens) and overhead-bound (1 x 128 tokens).

Rows (``--impls``), each run in fresh processes so its peak RSS is its own:

- ``single``: one process on rank 0's batches; twice its throughput is the limit (perfect scaling);
- ``colo_zero1`` / ``colo_zero2`` / ``colo_zero3``: ``colo.zero.ZeroOptimizer(model, AdamW(...), mesh=Mesh(dp=2),
  stage=s)`` with its defaults;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its defaults (25 MB buckets);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each decoder layer, then on the root, defaults (fp32);
- ``deepspeed_zero2`` / ``deepspeed_zero3``: ``deepspeed.initialize`` with the same torch AdamW as its client
  optimizer (``zero_allow_untested_optimizer``), fp32 (no fp16/bf16 section), ``communication_data_type`` fp32,
  otherwise DeepSpeed's ZeRO defaults. DeepSpeed runs on its CPU accelerator: the ranks get ``DS_ACCELERATOR=cpu``
  (what DeepSpeed picks anyway without CUDA, set so a GPU machine measures the same thing) and ``LOCAL_SIZE=2``
  (the CPU accelerator's device count, which it otherwise derives from NUMA nodes);
  ``deepspeed.init_distributed(dist_backend="gloo")`` adopts the process group the launcher already created
  (without oneCCL the CPU accelerator's backend is gloo too). At init DeepSpeed JIT-compiles its shared-memory
  comm op (``deepspeed_shm_comm_op``: a C++ compiler and ninja are needed; cached under ~/.cache/torch_extensions);
  it serves only inference all-reduces, so ZeRO's collectives here go through gloo like everyone else's.

Reported per row: tokens/s over all ranks (``world * batch * seq * steps / slowest rank's timed wall time``),
scaling efficiency against 2 x the single-process throughput, peak RSS (``ru_maxrss``, max over ranks), and the
loss of every step (mean over ranks: every row trains on the same data from the same initial weights, so the
2-process rows must agree to ~3-4 decimals; ``single`` sees only rank 0's half of the data and is left out of
that check). ``--repeats`` runs the whole set of rows several times, interleaved (the row order rotates each
repeat), and reports medians: the machine is shared and noisy.

Install the peers with the ``bench`` extra (keeping the installed torch)::

    echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > /tmp/torch-constraint.txt
    pip install -c /tmp/torch-constraint.txt -e ".[bench]"   # transformers>=4.45, deepspeed>=0.15
    # or only the two: pip install -c /tmp/torch-constraint.txt transformers deepspeed

Run::

    python benchmarks/zero_dp.py [--shapes compute overhead] [--impls ...] [--steps 8] [--warmup 2] [--repeats 1]

Writes ``benchmarks/results/zero_dp_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
NUM_RANKS = 2
LR = 3e-4
MODEL_CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "tie_word_embeddings": False,
}
SHAPES = {"compute": (4, 256), "overhead": (1, 128)}
"""Per rank per step: (sequences, tokens per sequence)."""


@dataclass(frozen=True)
class Impl:
    label: str
    num_ranks: int = NUM_RANKS


IMPLS = {
    "single": Impl("single process x 2 (the limit)", num_ranks=1),
    "colo_zero1": Impl("colo ZeRO-1"),
    "colo_zero2": Impl("colo ZeRO-2"),
    "colo_zero3": Impl("colo ZeRO-3"),
    "ddp": Impl("torch DDP"),
    "fsdp2": Impl("torch FSDP2 (fully_shard per layer + root)"),
    "deepspeed_zero2": Impl("DeepSpeed ZeRO-2"),
    "deepspeed_zero3": Impl("DeepSpeed ZeRO-3"),
}
RANK_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(NUM_RANKS)}


# --- what runs on every rank ---------------------------------------------------------------------------------------


def build_model(seed: int) -> torch.nn.Module:
    """The recipe's 25.8M-parameter Llama, fp32, the same initial weights on every rank and in every row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def token_batch(seed: int, step: int, rank: int, batch: int, seq: int) -> torch.Tensor:
    """Random tokens, a different seed per (step, rank); the same in every row."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, MODEL_CONFIG["vocab_size"], (batch, seq), generator=generator)


def _plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    def step(tokens: torch.Tensor) -> float:
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=True)


def setup_single(model, batch):
    return _plain_step(model, _adamw(model.parameters()))


def setup_ddp(model, batch):
    from torch.nn.parallel import DistributedDataParallel

    return _plain_step(DistributedDataParallel(model), _adamw(model.parameters()))


def setup_fsdp2(model, batch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _plain_step(model, _adamw(model.parameters()))


def _setup_colo(model, stage: int):
    import torch.distributed as dist

    from colo.comm import Mesh
    from colo.zero import ZeroOptimizer

    zero = ZeroOptimizer(model, _adamw(model.parameters()), mesh=Mesh(dp=dist.get_world_size()), stage=stage)

    def step(tokens: torch.Tensor) -> float:
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        return loss.item()

    return step


def _setup_deepspeed(model, batch: int, stage: int):
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "communication_data_type": "fp32",
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()), config=config)

    def step(tokens: torch.Tensor) -> float:
        loss = engine(input_ids=tokens, labels=tokens, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


SETUPS = {
    "single": setup_single,
    "ddp": setup_ddp,
    "fsdp2": setup_fsdp2,
    "colo_zero1": lambda model, batch: _setup_colo(model, 1),
    "colo_zero2": lambda model, batch: _setup_colo(model, 2),
    "colo_zero3": lambda model, batch: _setup_colo(model, 3),
    "deepspeed_zero2": lambda model, batch: _setup_deepspeed(model, batch, 2),
    "deepspeed_zero3": lambda model, batch: _setup_deepspeed(model, batch, 3),
}


def run_row(impl: str, batch: int, seq: int, num_steps: int, num_warmup: int, seed: int) -> dict:
    """One rank of one row: build, warm up, time ``num_steps`` steps; the losses of every step and peak RSS."""
    import resource

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build_model(seed)
    step = SETUPS[impl](model, batch)
    losses, step_seconds = [], []
    start = None
    for index in range(num_warmup + num_steps):
        if index == num_warmup:
            dist.barrier()
            start = time.perf_counter()
        tokens = token_batch(seed, index, rank, batch, seq)
        begin = time.perf_counter()
        losses.append(step(tokens))
        step_seconds.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - start
    return {
        "rank": rank,
        "elapsed_s": elapsed,
        "step_s": step_seconds[num_warmup:],
        "losses": losses,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }


# --- the driver ----------------------------------------------------------------------------------------------------


def measure(impl: str, shape: str, args) -> dict:
    """Run one row in fresh processes; returns its throughput, peak RSS and losses (or the error)."""
    from colo.comm import RankFailure, RankTimeout, launch

    batch, seq = SHAPES[shape]
    num_ranks = IMPLS[impl].num_ranks
    try:
        per_rank = launch(
            run_row, num_ranks, impl, batch, seq, args.steps, args.warmup, args.seed,
            backend="gloo", threads=1, env=RANK_ENV, timeout=args.row_timeout,
        )  # fmt: skip
    except (RankFailure, RankTimeout) as error:
        return {"impl": impl, "shape": shape, "error": str(error)}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in per_rank))]
    return {
        "impl": impl,
        "shape": shape,
        "num_ranks": num_ranks,
        "tokens_per_s": num_ranks * batch * seq * args.steps / elapsed,
        "elapsed_s": elapsed,
        "median_step_s": statistics.median(max(times) for times in zip(*(r["step_s"] for r in per_rank))),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in per_rank],
        "losses": losses,
        "losses_per_rank": [r["losses"] for r in per_rank],
    }


def median_rows(runs: list[dict], impls: list[str], shape: str, *, extra=None) -> dict[str, dict]:
    """One row per impl for ``shape``: medians over the repeats (tokens/s, peak RSS; ``extra(ok_runs)`` adds a
    benchmark's own columns), the first repeat's losses, and the scaling against ``NUM_RANKS`` x the single row.
    Shared by every benchmark that runs the interleaved impl x shape x repeat grid (zero_dp, booster_overhead)."""
    rows = {}
    for impl in impls:
        ok = [r for r in runs if r["impl"] == impl and r["shape"] == shape and "error" not in r]
        failed = [r for r in runs if r["impl"] == impl and r["shape"] == shape and "error" in r]
        if not ok:
            rows[impl] = {"error": failed[0]["error"] if failed else "not run"}
            continue
        rows[impl] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
            "tokens_per_s_repeats": [r["tokens_per_s"] for r in ok],
            **(extra(ok) if extra is not None else {}),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ok),
            "losses": ok[0]["losses"],
        }
    single = rows.get("single", {}).get("tokens_per_s")
    if single:
        rows["single"]["limit_tokens_per_s"] = NUM_RANKS * single
        for impl, row in rows.items():
            if "tokens_per_s" in row:
                row["scaling"] = 1.0 if impl == "single" else row["tokens_per_s"] / (NUM_RANKS * single)
    return rows


def summarize(runs: list[dict], impls: list[str], shapes: list[str]) -> dict:
    """Medians over repeats per (shape, impl), scaling vs 2 x single, and the loss agreement of the 2-rank rows."""
    summary: dict[str, dict] = {}
    for shape in shapes:
        rows = median_rows(runs, impls, shape)
        multi = {impl: row["losses"] for impl, row in rows.items() if "losses" in row and IMPLS[impl].num_ranks > 1}
        summary[shape] = {"rows": rows, "loss_agreement": loss_agreement(multi)}
    return summary


def loss_agreement(multi: dict[str, list[float]]) -> dict:
    """How the multi-process rows' per-step losses agree: final losses, their spread, max |diff| vs a reference."""
    if not multi:
        return {}
    reference = "ddp" if "ddp" in multi else next(iter(multi))
    finals = {impl: losses[-1] for impl, losses in multi.items()}
    return {
        "reference": reference,
        "final_losses": finals,
        "final_loss_spread": max(finals.values()) - min(finals.values()),
        "max_abs_diff_vs_reference": {
            impl: max(abs(a - b) for a, b in zip(losses, multi[reference])) for impl, losses in multi.items()
        },
    }


def print_rows(summary: dict, impls: list[str], shapes: list[str], labels: dict[str, str], first_column: str) -> None:
    """The table of tokens/s, scaling and peak RSS per row and shape (single x NUM_RANKS is the limit)."""
    header = f"| {first_column} |"
    for shape in shapes:
        header += f" {shape}-bound tokens/s | scaling |"
    header += " peak RSS (MB), " + " / ".join(shapes) + " |"
    print(header)
    print("|---" * (1 + 2 * len(shapes) + 1) + "|")
    for impl in impls:
        line = f"| {labels[impl]} |"
        rss = []
        for shape in shapes:
            row = summary[shape]["rows"][impl]
            if "error" in row:
                line += " failed | — |"
                rss.append("—")
                continue
            tokens_per_s = row["tokens_per_s"] * (NUM_RANKS if impl == "single" else 1)  # the limit: 2 x single
            scaling = f"{100 * row['scaling']:.0f}%" if "scaling" in row else "—"
            line += f" {tokens_per_s:.0f} | {scaling} |"
            rss.append(f"{row['peak_rss_mb']:.0f}")
        print(line + " " + " / ".join(rss) + " |")


def print_agreement(summary: dict, shapes: list[str]) -> None:
    """The loss-agreement lines of each shape."""
    for shape in shapes:
        agreement = summary[shape]["loss_agreement"]
        if not agreement:
            continue
        finals = ", ".join(f"{impl} {loss:.5f}" for impl, loss in agreement["final_losses"].items())
        diffs = ", ".join(f"{impl} {d:.1e}" for impl, d in agreement["max_abs_diff_vs_reference"].items())
        print(f"{shape}: final losses {finals}; spread {agreement['final_loss_spread']:.1e}")
        print(f"{shape}: max |loss - {agreement['reference']}| over all steps: {diffs}")


def print_table(summary: dict, impls: list[str], shapes: list[str]) -> None:
    print_rows(summary, impls, shapes, {impl: IMPLS[impl].label for impl in impls}, "implementation (2 processes)")
    print_agreement(summary, shapes)
    for shape in shapes:
        for impl in impls:
            row = summary[shape]["rows"][impl]
            if "error" in row:
                print(f"{shape} / {impl} failed:\n{row['error'][-3000:]}")


def _versions() -> dict:
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "deepspeed"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # not installed, or fails to import: its rows will say why
            versions[name] = None
    return versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the whole set of rows, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-timeout", type=float, default=1800.0, help="seconds before a row is killed")
    parser.add_argument("--out", default=str(RESULTS / "zero_dp_cpu.json"))
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1, --warmup at least 0")
    impls = [impl for impl in IMPLS if impl in args.impls]  # table order
    if "single" not in impls:
        print("note: without the 'single' row there is no scaling column", file=sys.stderr)

    runs = []
    for repeat in range(args.repeats):
        order = impls[repeat % len(impls) :] + impls[: repeat % len(impls)]
        for shape in args.shapes:
            for impl in order:
                row = measure(impl, shape, args)
                row["repeat"] = repeat
                runs.append(row)
                status = f"{row['tokens_per_s']:8.1f} tokens/s" if "error" not in row else "FAILED"
                print(f"[repeat {repeat}] {shape:>8} {impl:>16}: {status}", flush=True)

    summary = summarize(runs, impls, args.shapes)
    print()
    print_table(summary, impls, args.shapes)
    result = {
        "benchmark": "ZeRO / data parallelism, 25.8M-parameter HF Llama, 2 CPU processes (gloo): colo vs peers",
        "environment": {
            **_versions(),
            "world_size": NUM_RANKS,
            "backend": "gloo",
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "omp_threads_per_rank": 1,
            "rank_env": RANK_ENV,
        },
        "recipe": {
            "model": {"class": "LlamaForCausalLM", **MODEL_CONFIG, "dtype": "float32", "attn_implementation": "sdpa"},
            "optimizer": {"class": "torch.optim.AdamW", "lr": LR, "fused": True},
            "shapes": {shape: {"batch": SHAPES[shape][0], "seq": SHAPES[shape][1]} for shape in args.shapes},
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "seed": args.seed,
        },
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
