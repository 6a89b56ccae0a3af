#!/usr/bin/env python3
"""1D vs 2D / 2.5D / 3D tensor parallelism: the communication cost model's table, and a CPU run of 1D vs 2D.

1. The model (`colo.tensor.tp_cost.llama_block`, the formulas the tests check against CommTracker exactly): bytes per
   rank and collective calls of one Llama decoder layer, forward + backward, bf16, 8 sequences x 4096 tokens, for a
   7B (hidden 4096, intermediate 11008, 32 / 32 heads) and a 70B (8192, 28672, 64 / 8 heads) Llama at P = 4 .. 512
   tensor-parallel ranks, every scheme valid at P (2.5D: each depth d > 1 with P / d a square; the one moving the
   fewest bytes is listed; ``shardable`` says whether the model's sizes divide as colo's layers need). Also the
   alpha-beta time ``messages * alpha + bytes / beta`` at alpha = 5 us and beta =
   50 GB/s per rank (stated assumptions, not measurements), and which scheme is fastest under it.
2. A CPU run on 4 local ranks (gloo, one thread each): the same pre-norm MLP block (LayerNorm, up 4h, GELU, down,
   residual) under 1D (``Mesh(tp=4)``: replicated norm, column-parallel up, row-parallel down) and 2D (2 x 2 grid:
   `LayerNorm2D`, `Linear2D`), both checked against the single-process block first. Per shape: bytes and calls per
   step (CommTracker), and the medians over rounds of each side's time per step and of the per-round ratio 2D / 1D;
   sides alternate, which goes first alternates too. On a shared 2-core machine the 4 ranks time-slice, so read the
   ratio, not the absolute times.

    python benchmarks/tp_schemes.py [--rounds 9] [--iters 3]

Writes ``benchmarks/results/tp_schemes.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {
    "llama-7b": {"hidden": 4096, "intermediate": 11008, "num_heads": 32, "num_kv_heads": 32},
    "llama-70b": {"hidden": 8192, "intermediate": 28672, "num_heads": 64, "num_kv_heads": 8},
}
TOKENS = 8 * 4096
SIZES = [4, 8, 16, 27, 32, 64, 128, 256, 512]
ALPHA_S, BETA_BYTES_PER_S = 5e-6, 50e9
CPU_SHAPES = [(4, 64, 128), (8, 128, 256)]  # (batch, seq, hidden)


def _feasible(scheme: str, p: int, depth: int, shape: dict) -> bool:
    """Whether colo's layers can shard this model so (the model table itself ignores divisibility)."""
    hidden, inter, heads, kv = shape["hidden"], shape["intermediate"], shape["num_heads"], shape["num_kv_heads"]
    if scheme == "1d":  # heads split over p; kv heads split or replicated (colo.tensor.valid_tp_sizes)
        return heads % p == 0 and (kv % p == 0 or p % kv == 0) and inter % p == 0
    if scheme == "3d":
        q = round(p ** (1 / 3))
        head_dim = hidden // heads
        return all(x % q == 0 for x in (hidden, heads, kv)) and all(
            x % (q * q) == 0 for x in (inter, heads * head_dim, kv * head_dim)
        )
    q = math.isqrt(p // depth)
    return all(x % q == 0 for x in (hidden, inter, heads, kv))


def model_table() -> list[dict]:
    """Every scheme valid at each P for each model: bytes, messages, alpha-beta time; the winners marked."""
    from colo.tensor import tp_cost

    rows = []
    for name, shape in MODELS.items():
        for p in SIZES:
            costs = {"1d": tp_cost.llama_block("1d", tokens=TOKENS, p=p, **shape)}
            if math.isqrt(p) ** 2 == p:
                costs["2d"] = tp_cost.llama_block("2d", tokens=TOKENS, p=p, **shape)
            depths = [d for d in range(2, p + 1) if p % d == 0 and math.isqrt(p // d) ** 2 == p // d and p // d > 1]
            if depths:
                options = {d: tp_cost.llama_block("2.5d", tokens=TOKENS, p=p, depth=d, **shape) for d in depths}
                best = min(options, key=lambda d: options[d].bytes)
                costs[f"2.5d(d={best})"] = options[best]
            if round(p ** (1 / 3)) ** 3 == p:
                costs["3d"] = tp_cost.llama_block("3d", tokens=TOKENS, p=p, **shape)
            schemes = {
                scheme: {
                    "bytes_per_rank": cost.bytes,
                    "messages": cost.messages,
                    "alpha_beta_ms": 1e3 * cost.time(ALPHA_S, BETA_BYTES_PER_S),
                    "shardable": _feasible(
                        scheme.split("(")[0], p, int(scheme.split("=")[1][:-1]) if "d=" in scheme else 1, shape
                    ),
                }
                for scheme, cost in costs.items()
            }
            rows.append(
                {
                    "model": name,
                    "p": p,
                    "schemes": schemes,
                    "fewest_bytes": min(schemes, key=lambda s: schemes[s]["bytes_per_rank"]),
                    "fastest_alpha_beta": min(schemes, key=lambda s: schemes[s]["alpha_beta_ms"]),
                }
            )
    return rows


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Block2D(nn.Module):
    def __init__(self, block: Block, mesh):
        from colo.tensor.tp2d import LayerNorm2D, Linear2D

        super().__init__()
        self.norm = LayerNorm2D.from_layer_norm(block.norm, mesh=mesh)
        self.up, self.down = Linear2D.from_linear(block.up, mesh=mesh), Linear2D.from_linear(block.down, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _step(model, x, grad):
    x.grad = None
    for param in model.parameters():
        param.grad = None
    y = model(x)
    y.backward(grad)
    return y


def _time(model, x, grad, iters: int) -> float:
    from colo.comm import barrier

    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        _step(model, x, grad)
    return (time.perf_counter() - start) / iters


def _on_rank(rounds: int, iters: int, shapes) -> list[dict]:
    from colo.comm import CommTracker, Mesh
    from colo.tensor import Colwise, Rowwise, parallelize, tp_cost
    from colo.tensor.tp2d import shard_batch
    from colo.tensor.tp_grid import grid_mesh

    one_d, two_d = Mesh(tp=4), grid_mesh("2d", 4)
    rows = []
    for batch, seq, hidden in shapes:
        torch.manual_seed(0)
        reference = Block(hidden)
        sides = {
            "1d": parallelize(copy.deepcopy(reference), mesh=one_d, plan={"up": Colwise(), "down": Rowwise()}),
            "2d": Block2D(reference, two_d),
        }
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(batch, seq, hidden, generator=generator).requires_grad_(True)
        grad = torch.randn(batch, seq, hidden, generator=generator)
        expected_y = _step(reference, x, grad).detach()
        expected_grad = x.grad.clone()
        local = lambda t: shard_batch(t, two_d, hidden_split=True)  # noqa: E731
        inputs = {"1d": (x, grad), "2d": (local(x.detach()).requires_grad_(True), local(grad))}
        traffic = {}
        for name, model in sides.items():
            with CommTracker() as tracker:
                y = _step(model, *inputs[name])
            traffic[name] = (tracker.bytes(), tracker.calls())
            got_y, got_grad = (y, x.grad) if name == "1d" else (y, inputs[name][0].grad)
            want_y, want_grad = (
                (expected_y, expected_grad) if name == "1d" else (local(expected_y), local(expected_grad))
            )
            torch.testing.assert_close(got_y.detach(), want_y, rtol=1e-4, atol=1e-5, msg=f"{name} output")
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5, msg=f"{name} input gradient")
        for name, model in sides.items():  # warm-up
            _time(model, *inputs[name], iters)
        times: dict[str, list[float]] = {"1d": [], "2d": []}
        for round_index in range(rounds):
            order = ("1d", "2d") if round_index % 2 == 0 else ("2d", "1d")
            for name in order:
                times[name].append(_time(sides[name], *inputs[name], iters))
        tokens, wide = batch * seq, 4 * hidden
        model_1d = tp_cost.linear_1d(tokens, hidden, wide, 4, kind="column") + tp_cost.linear_1d(
            tokens, wide, hidden, 4, kind="row"
        )
        model_2d = (
            tp_cost.norm_2d(tokens, hidden, 2, kind="layernorm")
            + tp_cost.linear_2d(tokens, hidden, wide, 2)
            + tp_cost.linear_2d(tokens, wide, hidden, 2)
        )
        rows.append(
            {
                "batch": batch,
                "seq": seq,
                "hidden": hidden,
                "model_bytes_per_rank_1d": model_1d.bytes,
                "model_calls_1d": model_1d.messages,
                "model_bytes_per_rank_2d": model_2d.bytes,
                "model_calls_2d": model_2d.messages,
                "bytes_per_rank_1d": traffic["1d"][0],
                "calls_1d": traffic["1d"][1],
                "bytes_per_rank_2d": traffic["2d"][0],
                "calls_2d": traffic["2d"][1],
                "ms_1d": 1e3 * statistics.median(times["1d"]),
                "ms_2d": 1e3 * statistics.median(times["2d"]),
                "ratio_2d_over_1d": statistics.median(b / a for a, b in zip(times["1d"], times["2d"])),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=str(RESULTS / "tp_schemes.json"))
    parser.add_argument("--model-only", action="store_true", help="the cost-model table only (no ranks)")
    args = parser.parse_args()

    table = model_table()
    cpu = None
    if not args.model_only:
        from colo.comm import launch

        per_rank = launch(
            _on_rank, 4, args.rounds, args.iters, CPU_SHAPES, backend="gloo", threads=1, env={"OMP_NUM_THREADS": "1"}
        )
        cpu = per_rank[0]
    result = {
        "benchmark": "tensor-parallel schemes: cost model of a Llama layer (fwd+bwd) and a CPU 1D vs 2D MLP block",
        "model_assumptions": {
            "tokens": TOKENS,
            "element_bytes": 2,
            "alpha_s": ALPHA_S,
            "beta_bytes_per_s": BETA_BYTES_PER_S,
            "formulas": "colo.tensor.tp_cost (checked against CommTracker in tests/test_tp_cost.py, test_tp3d.py)",
        },
        "model_table": table,
        "cpu_environment": {
            "world_size": 4,
            "backend": "gloo",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "omp_threads_per_rank": 1,
            "rounds": args.rounds,
            "iters_per_round": args.iters,
        },
        "cpu_1d_vs_2d": cpu,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    for row in table:
        schemes = ", ".join(
            f"{s}: {v['bytes_per_rank'] / 1e9:.2f} GB / {v['messages']} msgs" for s, v in row["schemes"].items()
        )
        print(f"{row['model']:>10} P={row['p']:>3}  fewest bytes: {row['fewest_bytes']:<10} {schemes}")
        blocked = [s for s, v in row["schemes"].items() if not v["shardable"]]
        if blocked:
            print(f"{'':>16} not shardable with these sizes: {', '.join(blocked)}")
    for row in cpu or []:
        print(json.dumps(row))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
