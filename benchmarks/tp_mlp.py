#!/usr/bin/env python3
"""A tp=2 Megatron MLP block, forward + backward: colo's `parallelize` against torch's `parallelize_module`.

Both sides shard the same ``nn.Linear(h, 4h) -> GELU -> nn.Linear(4h, h)`` block, built from the same seed, with
column-parallel up and row-parallel down projections (colo: ``Colwise()`` / ``Rowwise()``; torch:
``ColwiseParallel()`` / ``RowwiseParallel()`` over DTensor), and run it on the same data: the input requires a
gradient, so each side communicates one all-reduce of b*s*h in forward and one in backward. Before timing,
both are checked against the single-process block (output and input gradient).

Rounds alternate between the two (which goes first alternates too); a round times ``--iters`` steps of each
after a barrier. Reported per shape: the medians over rounds of each side's time per step and of the per-round
ratio colo / torch (goal: <= 1.0). Runs on 2 local CPU processes (gloo), one thread each.

    python benchmarks/tp_mlp.py [--rounds 15] [--iters 5]

Writes ``benchmarks/results/tp_mlp_cpu.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
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
SHAPES = [(2, 16, 64), (4, 64, 256), (8, 128, 512)]  # (batch, seq, hidden)


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
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
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from colo.comm import Mesh
    from colo.tensor import Colwise, Rowwise, parallelize

    mesh = Mesh(tp=2)
    device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rows = []
    for batch, seq, hidden in shapes:
        torch.manual_seed(0)
        reference = MLP(hidden)
        colo_model = parallelize(copy.deepcopy(reference), mesh=mesh, plan={"up": Colwise(), "down": Rowwise()})
        torch_model = parallelize_module(
            copy.deepcopy(reference), device_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(batch, seq, hidden, generator=generator).requires_grad_(True)
        grad = torch.randn(batch, seq, hidden, generator=generator)
        expected_y = _step(reference, x, grad).detach()
        expected_grad = x.grad.clone()
        for name, model in (("colo", colo_model), ("torch", torch_model)):
            y = _step(model, x, grad)
            torch.testing.assert_close(y.detach(), expected_y, rtol=1e-4, atol=1e-5, msg=f"{name} output")
            torch.testing.assert_close(x.grad, expected_grad, rtol=1e-4, atol=1e-5, msg=f"{name} input gradient")
        sides = {"colo": colo_model, "torch": torch_model}
        for model in sides.values():  # warm-up
            _time(model, x, grad, iters)
        times: dict[str, list[float]] = {"colo": [], "torch": []}
        for round_index in range(rounds):
            order = ("colo", "torch") if round_index % 2 == 0 else ("torch", "colo")
            for name in order:
                times[name].append(_time(sides[name], x, grad, iters))
        ratios = [c / t for c, t in zip(times["colo"], times["torch"])]
        rows.append(
            {
                "batch": batch,
                "seq": seq,
                "hidden": hidden,
                "ffn_hidden": 4 * hidden,
                "allreduce_bytes_each_way": batch * seq * hidden * 4,
                "colo_ms": 1e3 * statistics.median(times["colo"]),
                "torch_ms": 1e3 * statistics.median(times["torch"]),
                "ratio": statistics.median(ratios),
                "rank": dist.get_rank(),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", default=str(RESULTS / "tp_mlp_cpu.json"))
    args = parser.parse_args()

    from colo.comm import launch

    per_rank = launch(
        _on_rank, 2, args.rounds, args.iters, SHAPES, backend="gloo", threads=1, env={"OMP_NUM_THREADS": "1"}
    )
    rows = per_rank[0]
    for row, other in zip(rows, per_rank[1]):  # rank 1's view of the same rounds, for the record
        row["rank1_ratio"] = other["ratio"]
        del row["rank"]
    result = {
        "benchmark": "tp=2 MLP block forward+backward: colo parallelize vs torch parallelize_module",
        "environment": {
            "world_size": 2,
            "backend": "gloo",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "omp_threads_per_rank": 1,
            "rounds": args.rounds,
            "iters_per_round": args.iters,
        },
        "shapes": rows,
        "median_ratio_over_shapes": statistics.median(row["ratio"] for row in rows),
    }
    print(f"{'b x s x h':>14}{'colo ms':>10}{'torch ms':>10}{'colo/torch':>12}")
    for row in rows:
        shape = f"{row['batch']}x{row['seq']}x{row['hidden']}"
        print(f"{shape:>14}{row['colo_ms']:>10.3f}{row['torch_ms']:>10.3f}{row['ratio']:>12.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
