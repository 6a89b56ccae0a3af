#!/usr/bin/env python3
"""Training step time at one model and one device budget: Gemini (auto, static) against ZeRO-3 with CPU offload.

Rows, all fp32 AdamW (lr 1e-3) on the same MLP stack, seed and data, in one process:

- ``gemini_auto``: `GeminiOptimizer(placement="auto", device_capacity=BUDGET)`; the first step is the warm-up.
- ``gemini_static``: the budget minus the non-model memory auto's warm-up measured (so both rows plan the same
  total device memory) as its arena; parameters homed on the device up to what that leaves beside the chunks in
  use, the rest and all optimizer state on the host (Colossal-AI's ``offload_param_frac`` / ``offload_optim_frac``).
- ``colo_zero3_offload``: colo.zero's `ZeroOptimizer(stage=3, offload_optimizer=True)` (ZeRO-Offload: masters,
  gradients and optimizer state on the host). It has no device budget: its compute copies stay on the device.
- ``deepspeed_zero3_offload``: DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on the CPU,
  ``stage3_max_live_parameters`` set to the static row's chunk budget (its nearest knob), when deepspeed is
  installed.

Without a GPU the "device" is host memory for every row (Gemini's device tier is a preallocated arena of host
memory standing in for it, DeepSpeed runs on its CPU accelerator), so the times compare the bookkeeping, copies
and optimizer implementations, not PCIe transfers. Rounds alternate between the rows; a round times
``--steps`` steps of each. Reported per row: median step time over rounds, the loss after the last step (all rows
train the same model on the same data, so they should agree), device high-water mark and bytes moved per step
where the row reports them.

    python benchmarks/gemini_offload.py [--rounds 5] [--steps 2] [--blocks 8] [--hidden 512] [--budget-fraction 0.75]

Writes ``benchmarks/results/gemini_offload_cpu.json``.

With ``--device cuda`` the rows train on the GPU: Gemini's device tier is the GPU under ``device_capacity`` (the
budget), its host tier host memory; colo's ZeRO-3 row keeps its compute copies on the GPU and its optimizer on the
host; DeepSpeed offloads parameters and optimizer state to the host (DeepSpeedCPUAdam, compiled on first use).
Host threads are left at torch's default there (the host optimizers use them). ``--out`` names the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class MLPStack(nn.Module):
    def __init__(self, hidden: int, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(num_blocks))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(step: int, *, rows: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, hidden, generator=generator), torch.randn(rows, hidden, generator=generator)


class Row:
    """One system under test: ``step(x, y) -> loss``, plus what it reports."""

    name = ""
    note = ""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    def report(self) -> dict:
        return {}


class GeminiRow(Row):
    def __init__(self, name: str, model: nn.Module, mesh, **fields) -> None:
        from colo.gemini import GeminiOptimizer

        self.name = name
        self.model = model
        self.gemini = GeminiOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh=mesh, **fields)

    def step(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        self.gemini.backward(loss)
        self.gemini.step()
        self.gemini.zero_grad()
        return loss.item()

    def report(self):
        report = self.gemini.memory_report()
        planned = report.steps[2:] or report.steps  # after the warm-up
        return {
            "device_capacity_bytes": int(report.tiers["device"].capacity),
            "device_high_water_bytes": report.tiers["device"].high_water,
            "host_high_water_bytes": report.tiers["host"].high_water,
            "bytes_moved_per_step": statistics.median(step.total_moved for step in planned),
            "prefetch_hits_per_step": statistics.median(step.prefetch_hits for step in planned),
            "prefetch_misses_per_step": statistics.median(step.prefetch_misses for step in planned),
            "evictions_per_step": statistics.median(step.evictions for step in planned),
            "non_model_peak_bytes": report.non_model_peak,
            "param_homes": sorted({r.home for r in self.gemini.manager.residency.values()}),
            "optimizer_tiers": sorted({s.tier for s in self.gemini.hybrid.states.values()}),
        }


class ZeroRow(Row):
    name = "colo_zero3_offload"
    note = "ZeroOptimizer(stage=3, offload_optimizer=True): no device budget; compute copies stay on the device"

    def __init__(self, model: nn.Module, mesh) -> None:
        from colo.zero import ZeroOptimizer

        self.model = model
        self.zero = ZeroOptimizer(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh=mesh, stage=3, offload_optimizer=True
        )

    def step(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        self.zero.backward(loss)
        self.zero.step()
        self.zero.zero_grad()
        return loss.item()

    def report(self):
        report = self.zero.memory_report()
        return {"memory_report": {k: v for k, v in vars(report).items() if isinstance(v, (int, float))}}


class DeepSpeedRow(Row):
    name = "deepspeed_zero3_offload"

    def __init__(self, model: nn.Module, budget_bytes: int) -> None:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        self.note = (
            f"deepspeed {deepspeed.__version__} on its CPU accelerator: offload_param and offload_optimizer to cpu "
            f"(DeepSpeedCPUAdam), stage3_max_live_parameters={budget_bytes // 4} (the chunk budget of the static "
            "row in fp32 elements), prefetch bucket 1/4 of that"
        )
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"},
                "stage3_max_live_parameters": budget_bytes // 4,
                "stage3_prefetch_bucket_size": budget_bytes // 16,
                "stage3_param_persistence_threshold": 0,
            },
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        with contextlib.redirect_stdout(io.StringIO()):
            self.engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

    def step(self, x, y):
        loss = F.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


def _reference_losses(model: nn.Module, batches) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _deepspeed_status() -> tuple[bool, str]:
    try:
        import deepspeed  # noqa: F401
    except Exception as error:  # not installed, or its import fails on this machine
        return False, f"deepspeed is not usable here: {type(error).__name__}: {error}"
    return True, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps of each row per round")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64, help="batch rows (tokens)")
    parser.add_argument("--budget-fraction", type=float, default=0.75, help="device budget / parameter bytes")
    parser.add_argument("--skip-deepspeed", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "gemini_offload_cpu.json")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(1)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    from colo.comm import Mesh, find_free_port, init_distributed

    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    init_distributed()
    mesh = Mesh(dp=1)

    torch.manual_seed(0)
    base = MLPStack(args.hidden, args.blocks)
    num_params = sum(p.numel() for p in base.parameters())
    param_bytes = num_params * 4
    budget = int(param_bytes * args.budget_fraction)
    warmup = 2
    total_steps = warmup + args.rounds * args.steps
    batches = [
        tuple(t.to(device) for t in _batch(step, rows=args.rows, hidden=args.hidden)) for step in range(total_steps)
    ]
    reference = _reference_losses(copy.deepcopy(base).to(device), batches)

    chunk_numel = 4 * args.hidden * args.hidden + 4 * args.hidden  # one up or down projection per chunk
    auto = GeminiRow(
        "gemini_auto", copy.deepcopy(base), mesh, placement="auto", device_capacity=budget, chunk_numel=chunk_numel
    )
    auto.note = "device_capacity = the budget (chunks + the non-model memory the warm-up recorded)"
    auto_warmup = [auto.step(*batches[step]) for step in range(warmup)]
    # the other rows get the same total: the budget minus the activations etc. auto set aside
    non_model = auto.gemini.memory_report().non_model_peak
    chunk_budget = budget - non_model
    working = 3 * 2 * chunk_numel * 4  # about three chunks in use with their gradient buckets
    device_fraction = max(0.0, min(1.0, (chunk_budget - working) / param_bytes))
    static = GeminiRow(
        "gemini_static",
        copy.deepcopy(base),
        mesh,
        param_fractions={"device": device_fraction, "host": 1.0 - device_fraction},
        optim_fractions={"host": 1.0},
        device_capacity=chunk_budget,
        chunk_numel=chunk_numel,
    )
    static.note = (
        f"device_capacity = budget - auto's non-model peak; param_fractions device {device_fraction:.2f} / host "
        f"{1 - device_fraction:.2f}; optimizer state on the host"
    )
    rows: list[Row] = [auto, static, ZeroRow(copy.deepcopy(base).to(device), mesh)]
    deepspeed_ok, deepspeed_reason = _deepspeed_status()
    if deepspeed_ok and not args.skip_deepspeed:
        try:
            rows.append(DeepSpeedRow(copy.deepcopy(base), chunk_budget))
        except Exception as error:  # building its CPU ops can fail on a machine without a compiler
            deepspeed_ok, deepspeed_reason = False, f"deepspeed.initialize failed: {type(error).__name__}: {error}"

    times: dict[str, list[float]] = {row.name: [] for row in rows}
    losses: dict[str, list[float]] = {row.name: [] for row in rows}
    losses[auto.name] = auto_warmup
    for step in range(warmup):
        for row in rows[1:]:
            losses[row.name].append(row.step(*batches[step]))
    step = warmup
    for round_index in range(args.rounds):
        order = rows if round_index % 2 == 0 else rows[::-1]
        for row in order:
            start = time.perf_counter()
            for k in range(args.steps):
                losses[row.name].append(row.step(*batches[step + k]))
            times[row.name].append((time.perf_counter() - start) / args.steps)
        step += args.steps

    results = []
    for row in rows:
        median = statistics.median(times[row.name])
        deviation = max(abs(a - b) / abs(b) for a, b in zip(losses[row.name], reference))
        results.append(
            {
                "name": row.name,
                "note": row.note,
                "step_ms": 1000 * median,
                "step_ms_per_round": [1000 * t for t in times[row.name]],
                "final_loss": losses[row.name][-1],
                "max_relative_loss_deviation_from_torch_adamw": deviation,
                **row.report(),
            }
        )
    gemini_auto = results[0]["step_ms"]
    for result in results:
        result["ratio_to_gemini_auto"] = result["step_ms"] / gemini_auto
    payload = {
        "benchmark": "training step time at one model and device budget: Gemini auto/static vs ZeRO-3 + CPU offload",
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else "cpu (no GPU: Gemini's device tier is a preallocated host arena)",
            "world_size": 1,
        },
        "model": {
            "kind": "MLP stack (LayerNorm, Linear h->4h, GELU, Linear 4h->h, residual)",
            "hidden": args.hidden,
            "blocks": args.blocks,
            "batch_rows": args.rows,
            "num_params": num_params,
            "param_bytes_fp32": param_bytes,
            "precision": "fp32",
        },
        "device_budget_bytes": budget,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup_steps": warmup,
        "rows": results,
        "left_out": [] if deepspeed_ok else [{"name": "deepspeed_zero3_offload", "why": deepspeed_reason}],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    width = max(len(r["name"]) for r in results)
    print(f"model {num_params / 1e6:.1f}M params ({param_bytes / 2**20:.1f} MiB fp32), budget {budget / 2**20:.1f} MiB")
    for result in results:
        print(
            f"{result['name']:{width}}  {result['step_ms']:8.1f} ms/step  x{result['ratio_to_gemini_auto']:.2f}  "
            f"loss dev {result['max_relative_loss_deviation_from_torch_adamw']:.1e}"
        )
    if not deepspeed_ok:
        print(f"deepspeed row left out: {deepspeed_reason}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
