#!/usr/bin/env python3
"""The Booster's overhead on 2 CPU processes: Booster(DDP()) and Booster(Zero(stage=3)) next to the plain packages.

The shared recipe of BENCHMARKS.md, with colo's native Llama of the recipe's shape (preset ``bench-25m``: hidden
512, intermediate 1376, 6 layers, 8 heads, 4 kv heads, vocab 8192, untied: 25.8M parameters): fp32,
``torch.optim.AdamW(lr=3e-4, fused=True)`` for every row, random token batches with a different seed per (step,
rank) (``labels = input_ids``), 2 warm-up steps then ``--steps`` timed ones, gloo on loopback, one thread per rank.
Two shapes per rank per step: compute-bound (4 x 256 tokens) and overhead-bound (1 x 128 tokens). No row clips.

Rows (``--impls``), each run in fresh processes so its peak RSS is its own:

- ``single``: one process, plain loop, on rank 0's batches; twice its throughput is the limit (perfect scaling);
- ``booster_ddp``: ``Booster(DDP())``, ``booster.train_step({"input_ids", "labels"})``;
- ``ddp``: torch ``DistributedDataParallel`` configured as the DDP plugin configures it (25 MB buckets,
  ``gradient_as_bucket_view=True``, ``zero_grad(set_to_none=False)``), the plain loop
  (``loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()``);
- ``ddp_sync``: ``ddp`` plus what ``train_step`` adds on top: the global grad norm
  (``clip_grad_norm_(params, inf)``, as the DDP plugin computes it) and the mean loss over ranks (one all-reduce);
- ``booster_zero3``: ``Booster(Zero(stage=3))``;
- ``colo_zero3``: ``colo.zero.ZeroOptimizer(model, AdamW, mesh=Mesh(dp=2), stage=3)``, the loop by hand
  (``zero.backward(loss); zero.step(); zero.zero_grad()``);
- ``colo_zero3_sync``: ``colo_zero3`` plus ``zero.grad_norm()`` and the loss all-reduce;
- ``fsdp2``: torch ``fully_shard`` on each decoder layer, then on the root (fp32), the plain loop;
- ``ddp_defaults`` (not run by default): torch DDP with its own defaults (``gradient_as_bucket_view=False``,
  ``zero_grad(set_to_none=True)``).

The Booster's ``train_step`` computes the global grad norm and averages the loss over ranks on every step; the
plain rows do not (a hand-written loop need not), the ``*_sync`` rows do. So ``booster / plain`` is the overhead
a user sees, and ``booster / plain_sync`` is what is left of it once the plain loop does the same work.

Reported per row: tokens/s over all ranks (``world * batch * seq * steps / slowest rank's timed wall time``),
scaling against 2 x the single-process throughput, peak RSS (``ru_maxrss``, max over ranks), the mean loss over
ranks of every step (every 2-process row trains on the same data from the same initial weights, so they must
agree; ``single`` sees only rank 0's half of the data), and the time per step in each phase (forward, backward,
grad sync wait, grad norm, optimizer, zero_grad, loss all-reduce, the rest; exclusive times, the mean over timed
steps and ranks), from timers around those calls in every row (a few ``perf_counter`` calls per step).
``--repeats`` runs every row several times, interleaved (the row order rotates each repeat); the summary gives
medians and the Booster/plain ratios per repeat. The system load average is recorded before every row.

Run::

    python benchmarks/booster_overhead.py [--shapes compute overhead] [--impls ...] [--steps 8] [--warmup 2]
        [--repeats 3]

Writes ``benchmarks/results/booster_overhead_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_dp import (  # noqa: E402
    LR,
    NUM_RANKS,
    RESULTS,
    SHAPES,
    _adamw,
    _versions,
    loss_agreement,
    median_rows,
    print_agreement,
    print_rows,
    token_batch,
)

PRESET = "bench-25m"
IMPLS = {
    "single": "single process x 2 (the limit)",
    "booster_ddp": "Booster(DDP())",
    "ddp": "torch DDP (plugin's settings), plain loop",
    "ddp_sync": "torch DDP + grad norm + loss all-reduce",
    "booster_zero3": "Booster(Zero(stage=3))",
    "colo_zero3": "colo ZeroOptimizer(stage=3), plain loop",
    "colo_zero3_sync": "colo ZeroOptimizer(stage=3) + grad norm + loss all-reduce",
    "fsdp2": "torch FSDP2 (fully_shard per layer + root)",
    "ddp_defaults": "torch DDP (torch defaults), plain loop",
}
DEFAULT_IMPLS = [impl for impl in IMPLS if impl != "ddp_defaults"]
COMPARISONS = {
    # plugin: (booster row, plain row, plain row doing the Booster's extra work)
    "DDP": ("booster_ddp", "ddp", "ddp_sync"),
    "Zero(stage=3)": ("booster_zero3", "colo_zero3", "colo_zero3_sync"),
}
GOAL = 0.03
EXTRA_WORK = ["grad_norm", "loss_all_reduce"]
"""The phases ``train_step`` runs that the plain loop does not."""
"""The Booster's median overhead over the plain package it wraps: at most 3%."""
RANK_ENV = {"OMP_NUM_THREADS": "1"}


# --- phase timers ------------------------------------------------------------------------------------------------


class PhaseClock:
    """Exclusive wall time per named phase: a phase opened inside another is subtracted from the outer one."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [name, start, time spent in nested phases]

    def begin(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def end(self, name: str) -> None:
        opened, start, nested = self._stack.pop()
        assert opened == name, f"phase {name!r} closed while {opened!r} is open"
        elapsed = time.perf_counter() - start
        self.totals[name] += elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.begin(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.end(name)

        return timed

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


def instrument(clock: PhaseClock, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Time forward (hooks on the model), backward (``Tensor.backward``) and the optimizer step (its hooks)."""
    model.register_forward_pre_hook(lambda *_: clock.begin("forward"))
    model.register_forward_hook(lambda *_: clock.end("forward"))
    torch.Tensor.backward = clock.wrap("backward", torch.Tensor.backward)  # this rank's process only
    optimizer.register_step_pre_hook(lambda *_: clock.begin("optimizer"))
    optimizer.register_step_post_hook(lambda *_: clock.end("optimizer"))


def instrument_zero(clock: PhaseClock, zero) -> None:
    """Time a ZeroOptimizer's grad sync wait, grad norm, step (the rest of it) and zero_grad."""
    zero.grad_sync.finish = clock.wrap("grad_sync_wait", zero.grad_sync.finish)
    zero.grad_norm = clock.wrap("grad_norm", zero.grad_norm)
    zero.step = clock.wrap("zero_step_rest", zero.step)
    zero.zero_grad = clock.wrap("zero_grad", zero.zero_grad)


# --- what runs on every rank ---------------------------------------------------------------------------------------


def build_model(seed: int) -> torch.nn.Module:
    """The native Llama of the recipe's shape, fp32, the same initial weights on every rank and in every row."""
    from colo.apps.models.llama import Llama, get_preset

    torch.manual_seed(seed)
    return Llama(get_preset(PRESET)).float()


def _mean_over_ranks(clock: PhaseClock, loss: torch.Tensor) -> float:
    """What a hand-written loop does to log the mean loss over ranks: one small all-reduce."""
    import torch.distributed as dist

    clock.begin("loss_all_reduce")
    reduced = loss.detach().double().reshape(1)
    dist.all_reduce(reduced)
    value = reduced.item() / dist.get_world_size()
    clock.end("loss_all_reduce")
    return value


def _plain_step(clock, model, optimizer, *, grad_norm=None, reduce_loss=False, set_to_none=True):
    optimizer.zero_grad = clock.wrap("zero_grad", optimizer.zero_grad)

    def step(batch: dict) -> float:
        loss = model(**batch).loss
        loss.backward()
        if grad_norm is not None:
            clock.begin("grad_norm")
            grad_norm()
            clock.end("grad_norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        return _mean_over_ranks(clock, loss) if reduce_loss else loss.item()

    return step


def setup_single(clock, model):
    optimizer = _adamw(model.parameters())
    instrument(clock, model, optimizer)
    return _plain_step(clock, model, optimizer)


def _setup_ddp(clock, model, *, sync: bool, plugin_settings: bool = True):
    from torch.nn.parallel import DistributedDataParallel

    from colo.apps.booster import DDP

    plugin = DDP()
    optimizer = _adamw(model.parameters())
    instrument(clock, model, optimizer)
    if plugin_settings:
        wrapped = DistributedDataParallel(
            model, bucket_cap_mb=plugin.bucket_cap_mb, gradient_as_bucket_view=plugin.gradient_as_bucket_view
        )
        set_to_none = not plugin.gradient_as_bucket_view
    else:
        wrapped, set_to_none = DistributedDataParallel(model), True
    params = list(model.parameters())
    grad_norm = (lambda: float(torch.nn.utils.clip_grad_norm_(params, float("inf")))) if sync else None
    return _plain_step(clock, wrapped, optimizer, grad_norm=grad_norm, reduce_loss=sync, set_to_none=set_to_none)


def setup_fsdp2(clock, model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = _adamw(model.parameters())
    instrument(clock, model, optimizer)
    return _plain_step(clock, model, optimizer)


def _setup_colo_zero3(clock, model, *, sync: bool):
    import torch.distributed as dist

    from colo.comm import Mesh
    from colo.zero import ZeroOptimizer

    optimizer = _adamw(model.parameters())
    zero = ZeroOptimizer(model, optimizer, mesh=Mesh(dp=dist.get_world_size()), stage=3)
    instrument(clock, model, zero.optimizer)
    instrument_zero(clock, zero)

    def step(batch: dict) -> float:
        loss = model(**batch).loss
        zero.backward(loss)
        if sync:
            zero.grad_norm()
        zero.step()
        zero.zero_grad()
        return _mean_over_ranks(clock, loss) if sync else loss.item()

    return step


def _setup_booster(clock, model, plugin):
    from colo.apps.booster import Booster

    optimizer = _adamw(model.parameters())
    booster = Booster(plugin)
    booster.boost(model, optimizer)
    engine = booster.engine
    instrument(clock, model, engine.torch_optimizer)
    if hasattr(engine.optimizer, "grad_norm"):  # ZeroEngine: the ZeroOptimizer
        instrument_zero(clock, engine.optimizer)
    else:  # DDPEngine: its norm is torch's clip_grad_norm_, looked up at call time
        torch.nn.utils.clip_grad_norm_ = clock.wrap("grad_norm", torch.nn.utils.clip_grad_norm_)
        engine.zero_grad = clock.wrap("zero_grad", engine.zero_grad)
    engine.mean_over_data_ranks = clock.wrap("loss_all_reduce", engine.mean_over_data_ranks)

    def step(batch: dict) -> float:
        return booster.train_step(batch).loss

    return step


def setup(impl: str, clock: PhaseClock, model: torch.nn.Module):
    if impl == "single":
        return setup_single(clock, model)
    if impl in ("ddp", "ddp_sync", "ddp_defaults"):
        return _setup_ddp(clock, model, sync=impl == "ddp_sync", plugin_settings=impl != "ddp_defaults")
    if impl == "fsdp2":
        return setup_fsdp2(clock, model)
    if impl in ("colo_zero3", "colo_zero3_sync"):
        return _setup_colo_zero3(clock, model, sync=impl == "colo_zero3_sync")
    from colo.apps.booster import DDP, Zero

    if impl == "booster_ddp":
        return _setup_booster(clock, model, DDP())
    if impl == "booster_zero3":
        return _setup_booster(clock, model, Zero(stage=3))
    raise ValueError(f"unknown row {impl!r}")


def run_row(impl: str, batch: int, seq: int, num_steps: int, num_warmup: int, seed: int) -> dict:
    """One rank of one row: build, warm up, time ``num_steps`` steps; losses, per-phase times and peak RSS."""
    import resource

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    clock = PhaseClock()
    step = setup(impl, clock, build_model(seed))
    losses, step_seconds, phases = [], [], []
    start = None
    for index in range(num_warmup + num_steps):
        if index == num_warmup:
            dist.barrier()
            start = time.perf_counter()
        tokens = token_batch(seed, index, rank, batch, seq)
        begin = time.perf_counter()
        losses.append(step({"input_ids": tokens, "labels": tokens}))
        step_seconds.append(time.perf_counter() - begin)
        timed = clock.take()
        timed["other"] = step_seconds[-1] - sum(timed.values())
        phases.append(timed)
    elapsed = time.perf_counter() - start
    timed_phases = phases[num_warmup:]
    names = sorted({name for timed in timed_phases for name in timed})
    return {
        "rank": rank,
        "elapsed_s": elapsed,
        "step_s": step_seconds[num_warmup:],
        "phase_s": {name: statistics.fmean(timed.get(name, 0.0) for timed in timed_phases) for name in names},
        "losses": losses,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }


# --- the driver ----------------------------------------------------------------------------------------------------


def measure(impl: str, shape: str, args) -> dict:
    """Run one row in fresh processes; returns its throughput, peak RSS, phases and losses (or the error)."""
    from colo.comm import RankFailure, RankTimeout, launch

    batch, seq = SHAPES[shape]
    num_ranks = 1 if impl == "single" else NUM_RANKS
    load = os.getloadavg()
    try:
        per_rank = launch(
            run_row, num_ranks, impl, batch, seq, args.steps, args.warmup, args.seed,
            backend="gloo", threads=1, env=RANK_ENV, timeout=args.row_timeout,
        )  # fmt: skip
    except (RankFailure, RankTimeout) as error:
        return {"impl": impl, "shape": shape, "error": str(error), "loadavg_before": load}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in per_rank))]
    names = sorted({name for r in per_rank for name in r["phase_s"]})
    return {
        "impl": impl,
        "shape": shape,
        "num_ranks": num_ranks,
        "tokens_per_s": num_ranks * batch * seq * args.steps / elapsed,
        "elapsed_s": elapsed,
        "median_step_s": statistics.median(max(times) for times in zip(*(r["step_s"] for r in per_rank))),
        "phase_s": {name: statistics.fmean(r["phase_s"].get(name, 0.0) for r in per_rank) for name in names},
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in per_rank],
        "losses": losses,
        "losses_per_rank": [r["losses"] for r in per_rank],
        "loadavg_before": load,
    }


def _phase_medians(ok: list[dict]) -> dict:
    names = sorted({name for r in ok for name in r["phase_s"]})
    return {
        "median_step_s": statistics.median(r["median_step_s"] for r in ok),
        "phase_s": {name: statistics.median(r["phase_s"].get(name, 0.0) for r in ok) for name in names},
    }


def summarize(runs: list[dict], impls: list[str], shapes: list[str]) -> dict:
    """Medians over repeats per (shape, row) (zero_dp's `median_rows` plus the phases), scaling, the Booster/plain
    ratios and the loss agreement."""
    summary: dict[str, dict] = {}
    for shape in shapes:
        rows = median_rows(runs, impls, shape, extra=_phase_medians)
        summary[shape] = {
            "rows": rows,
            "booster_vs_plain": _ratios(runs, rows, shape),
            "loss_agreement": _agreement(rows),
        }
    return summary


def _ratios(runs: list[dict], rows: dict, shape: str) -> dict:
    """Per plugin: booster tokens/s over the plain row's (and the *_sync row's), from the medians and per repeat."""

    def per_repeat(booster: str, plain: str) -> list[float]:
        by_repeat = defaultdict(dict)
        for r in runs:
            if r["shape"] == shape and "error" not in r:
                by_repeat[r["repeat"]][r["impl"]] = r["tokens_per_s"]
        return [
            found[booster] / found[plain]
            for _, found in sorted(by_repeat.items())
            if booster in found and plain in found
        ]

    ratios = {}
    for plugin, (booster, plain, plain_sync) in COMPARISONS.items():
        entry = {}
        for key, other in (("vs_plain", plain), ("vs_plain_sync", plain_sync)):
            if "tokens_per_s" not in rows.get(booster, {}) or "tokens_per_s" not in rows.get(other, {}):
                continue
            ratio = rows[booster]["tokens_per_s"] / rows[other]["tokens_per_s"]
            repeats = per_repeat(booster, other)
            entry[key] = {
                "plain_row": other,
                "throughput_ratio": ratio,  # booster / plain tokens/s, medians over repeats
                "overhead": 1.0 / ratio - 1.0,  # extra time per step
                "overhead_per_repeat": [1.0 / x - 1.0 for x in repeats],  # paired within a repeat
                "median_paired_overhead": statistics.median(1.0 / x - 1.0 for x in repeats) if repeats else None,
                "step_time_overhead": rows[booster]["median_step_s"] / rows[other]["median_step_s"] - 1.0,
            }
        if "phase_s" in rows.get(booster, {}) and "median_step_s" in rows.get(plain, {}):
            # less noisy than whole steps: the time of the work train_step adds (timed in place), over the plain step
            extra = sum(rows[booster]["phase_s"].get(name, 0.0) for name in EXTRA_WORK)
            entry["extra_work"] = {
                "phases": EXTRA_WORK,
                "ms_per_step": 1000 * extra,
                "overhead": extra / rows[plain]["median_step_s"],
            }
        if "vs_plain" in entry:
            entry["meets_goal"] = entry["vs_plain"]["overhead"] <= GOAL
        ratios[plugin] = entry
    return ratios


def _agreement(rows: dict) -> dict:
    return loss_agreement({impl: row["losses"] for impl, row in rows.items() if "losses" in row and impl != "single"})


PHASES = ["forward", "backward", "grad_sync_wait", "grad_norm", "optimizer", "zero_step_rest", "zero_grad"]
PHASES += ["loss_all_reduce", "other"]


def print_table(summary: dict, impls: list[str], shapes: list[str]) -> None:
    print_rows(summary, impls, shapes, IMPLS, "row (2 processes)")

    print("\nBooster overhead (plain tokens/s / Booster tokens/s - 1; medians over repeats, then each repeat paired)")
    print(
        "| plugin | shape | vs plain loop | per repeat | vs plain + norm + loss reduce | per repeat "
        "| train_step's norm + loss reduce, of the plain step | goal <= 3% |"
    )
    print("|---" * 8 + "|")
    for shape in shapes:
        for plugin, entry in summary[shape]["booster_vs_plain"].items():
            cells = []
            for key in ("vs_plain", "vs_plain_sync"):
                if key not in entry:
                    cells += ["—", "—"]
                    continue
                cells.append(f"{100 * entry[key]['overhead']:+.1f}%")
                cells.append(" ".join(f"{100 * x:+.1f}%" for x in entry[key]["overhead_per_repeat"]))
            goal = {True: "yes", False: "no"}.get(entry.get("meets_goal"), "—")
            extra = entry.get("extra_work")
            cells.append(f"{extra['ms_per_step']:.1f} ms = {100 * extra['overhead']:.1f}%" if extra else "—")
            print(f"| {plugin} | {shape} | " + " | ".join(cells) + f" | {goal} |")

    for shape in shapes:
        print(
            f"\n{shape}-bound: ms per step by phase (exclusive; mean over timed steps and ranks, median over repeats)"
        )
        print("| row | step | " + " | ".join(PHASES) + " |")
        print("|---" * (len(PHASES) + 2) + "|")
        for impl in impls:
            row = summary[shape]["rows"][impl]
            if "error" in row:
                continue
            cells = [f"{1000 * row['phase_s'][p]:.1f}" if p in row["phase_s"] else "—" for p in PHASES]
            print(f"| {impl} | {1000 * row['median_step_s']:.1f} | " + " | ".join(cells) + " |")

    print_agreement(summary, shapes)
    for shape in shapes:
        for impl in impls:
            row = summary[shape]["rows"][impl]
            if "error" in row:
                print(f"{shape} / {impl} failed:\n{row['error'][-3000:]}")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=DEFAULT_IMPLS)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the whole set of rows, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-timeout", type=float, default=1800.0, help="seconds before a row is killed")
    parser.add_argument("--out", default=str(RESULTS / "booster_overhead_cpu.json"))
    parser.add_argument("--from-json", help="re-summarize the runs saved in this result file instead of running")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1, --warmup at least 0")
    impls = [impl for impl in IMPLS if impl in args.impls]  # table order
    if "single" not in impls:
        print("note: without the 'single' row there is no scaling column", file=sys.stderr)

    if args.from_json:  # re-summarize the runs of an earlier result (same rows and recipe), rewrite it in place
        result = json.loads(Path(args.from_json).read_text())
        impls = [impl for impl in IMPLS if impl in result["rows"]]
        shapes = list(result["recipe"]["shapes"])
        result["summary"] = summarize(result["runs"], impls, shapes)
        print_table(result["summary"], impls, shapes)
        Path(args.from_json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"rewrote {args.from_json}")
        return 0

    uptime_start = _uptime()
    print(f"load at start: {uptime_start}", flush=True)
    started = time.time()
    runs = []
    for repeat in range(args.repeats):
        order = impls[repeat % len(impls) :] + impls[: repeat % len(impls)]
        for shape in args.shapes:
            for impl in order:
                row = measure(impl, shape, args)
                row["repeat"] = repeat
                runs.append(row)
                status = f"{row['tokens_per_s']:8.1f} tokens/s" if "error" not in row else "FAILED"
                load = row["loadavg_before"][0]
                print(f"[repeat {repeat}] {shape:>8} {impl:>16}: {status}  (load {load:.2f})", flush=True)
    uptime_end = _uptime()
    print(f"load at end: {uptime_end}", flush=True)

    summary = summarize(runs, impls, args.shapes)
    print()
    print_table(summary, impls, args.shapes)
    loads = [r["loadavg_before"][0] for r in runs]
    result = {
        "benchmark": "Booster overhead: Booster(DDP()) / Booster(Zero(stage=3)) vs plain torch DDP / colo "
        "ZeroOptimizer and FSDP2, native Llama bench-25m (25.8M parameters), 2 CPU processes (gloo)",
        "goal": f"the Booster's median overhead over the plain package it wraps is at most {100 * GOAL:.0f}%",
        "environment": {
            **_versions(),
            "world_size": NUM_RANKS,
            "backend": "gloo",
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "omp_threads_per_rank": 1,
            "rank_env": RANK_ENV,
            "load": {
                "note": "shared machine: another workload may run alongside; treat the figures as noisy",
                "uptime_start": uptime_start,
                "uptime_end": uptime_end,
                "loadavg_1min_before_rows": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                "wall_s": time.time() - started,
            },
        },
        "recipe": {
            "model": {"class": "colo.apps.models.llama.Llama", "preset": PRESET, "dtype": "float32"},
            "optimizer": {"class": "torch.optim.AdamW", "lr": LR, "fused": True},
            "clipping": None,
            "shapes": {shape: {"batch": SHAPES[shape][0], "seq": SHAPES[shape][1]} for shape in args.shapes},
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "seed": args.seed,
        },
        "rows": {impl: IMPLS[impl] for impl in impls},
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
