#!/usr/bin/env python3
"""Asynchronous (one-step off-policy, ``grpo.max_staleness=1``) against synchronous GRPO on the ``tiny-grpo`` preset
(issue 46): wall time per update and the held-out reward at the same number of updates.

Rows, each a fresh ``colo train --preset tiny-grpo`` process (one rank, DDP, fp32; the preset's 150 SFT steps then
150 GRPO steps of 16 prompts x 8 completions, evals of the held-out greedy exact-match reward every 50 steps), on the
same two cores:

- ``sync``: ``grpo.max_staleness=0`` (today's loop: rollout, rewards, reference forward, update, one after the
  other) with ``--threads`` intra-op threads (``OMP_NUM_THREADS``; default 2: both cores for every phase);
- ``async``: ``grpo.max_staleness=1`` with ``--threads / 2`` intra-op threads for each of its two threads (the main
  thread: rewards, reference forward, update; the rollout thread: the next step's generation), so both sides use
  the same cores;
- ``async_process``: ``async`` with ``grpo.rollout_worker=process``: the rollout in a child process (``--threads /
  2`` intra-op threads) instead of a thread, so the rollout and the update share no GIL;
- ``sync_1thread``: ``sync`` with one intra-op thread (half the cores: what the asynchronous row's main thread has).

The rows run ``--repeats`` times, interleaved (the order alternating each repeat); repeat ``r`` runs every row with
``seed = --first-seed + r`` (the weights' initialization, the prompts and the sampling), so the rewards of a row vary
over repeats as seeds do and each repeat compares the rows on the same seed. Per run:
the median wall time between consecutive GRPO steps (``time`` of ``metrics.jsonl`` with one log record per step;
the first GRPO step, which builds the reference and, under ``async``, samples its own rollout, and the steps right
after an eval are left out), the mean phase times the step records (``grpo/time_rollout``: the rollout time the step
waited for; ``grpo/time_rollout_background``: the background generation's own; ``grpo/time_logprobs``;
``grpo/time_update``), the held-out greedy reward at each eval, staleness and importance-weight metrics, and the load
average before and after. Reported: medians over repeats and the async / sync ratio of the median update time (of
every repeat, and of the medians). No assertion on timings.

Run::

    python benchmarks/grpo_async.py [--repeats 3] [--threads 2] [--rows sync async] [--set key=value ...]

Writes ``benchmarks/results/grpo_async_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ROWS = ("sync", "sync_1thread", "async", "async_process")


def run_row(row: str, args, output_dir: str, seed: int) -> dict:
    threads = {"sync": args.threads, "sync_1thread": 1}.get(row, max(args.threads // 2, 1))
    overrides = [
        f"output_dir={output_dir}",
        f"seed={seed}",
        f"grpo.max_staleness={int(row.startswith('async'))}",
        f"grpo.rollout_worker={'process' if row == 'async_process' else 'thread'}",
        "logging.every_steps=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "checkpoint.enabled=false",
        "sample.max_new_tokens=0",
        *args.set,
    ]
    command = [sys.executable, "-c", "import sys; from colo.apps.cli.app import main; main(sys.argv[1:])"]
    command += ["train", "--preset", "tiny-grpo", *[item for o in overrides for item in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{row} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as lines:
        records = [json.loads(line) for line in lines]
    return {"threads": threads, "seconds": seconds, "load_before": load_before, "load_after": os.getloadavg()[0]} | (
        summarize(records)
    )


def summarize(records: list[dict]) -> dict:
    steps = {r["step"]: r for r in records if "grpo/reward_mean" in r and "loss" in r}
    evals = {r["step"]: r["eval_grpo/greedy_reward"] for r in records if "eval_grpo/greedy_reward" in r}
    grpo = sorted(steps)
    gaps = [
        steps[s]["time"] - steps[s - 1]["time"]
        for s in grpo[1:]
        if s - 1 in steps and s - 1 != grpo[0] and s - 1 not in evals
    ]

    def mean(name: str) -> float | None:
        values = [steps[s][name] for s in grpo[1:] if name in steps[s]]
        return statistics.fmean(values) if values else None

    return {
        "grpo_steps": len(grpo),
        "update_seconds_median": statistics.median(gaps),
        "update_seconds_mean": statistics.fmean(gaps),
        "phases_mean": {
            name: mean(f"grpo/{name}")
            for name in ("time_rollout", "time_rollout_background", "time_logprobs", "time_update")
        },
        "greedy_reward": evals,
        "final_greedy_reward": evals[max(evals)] if evals else None,
        "update_seconds_total": steps[grpo[-1]]["time"] - steps[grpo[0]]["time"],
        "train_reward_mean_last_20": statistics.fmean(steps[s]["grpo/reward_mean"] for s in grpo[-20:]),
        "staleness_mean": mean("grpo/staleness"),
        "importance_weight_mean": mean("grpo/importance_weight_mean"),
        "importance_weight_max": max((steps[s].get("grpo/importance_weight_max", 0.0) for s in grpo), default=None),
        "importance_weight_capped_mean": mean("grpo/importance_weight_capped"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="repeat r runs every row with seed first + r")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of sync; async: half per thread")
    parser.add_argument("--rows", nargs="+", default=["sync", "async"], choices=ROWS)
    parser.add_argument("--set", nargs="*", default=[], help="more run-config overrides (key=value), both rows")
    parser.add_argument("--out", default=str(RESULTS / "grpo_async_cpu.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {row: [] for row in args.rows}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            order = args.rows if repeat % 2 == 0 else list(reversed(args.rows))
            for row in order:
                seed = args.first_seed + repeat
                result = run_row(row, args, os.path.join(scratch, f"{row}-{repeat}"), seed)
                result["seed"] = seed
                runs[row].append(result)
                print(
                    f"repeat {repeat} (seed {seed}) {row}: update {result['update_seconds_median'] * 1e3:.1f} ms "
                    f"(median), final greedy reward {result['final_greedy_reward']}, phases {result['phases_mean']}, "
                    f"load {result['load_before']:.1f} -> {result['load_after']:.1f}",
                    flush=True,
                )
    summary = {}
    for row, results in runs.items():
        summary[row] = {
            "update_seconds_median": statistics.median(r["update_seconds_median"] for r in results),
            "update_seconds_total_median": statistics.median(r["update_seconds_total"] for r in results),
            "final_greedy_reward_median": (
                statistics.median(r["final_greedy_reward"] for r in results)
                if all(r["final_greedy_reward"] is not None for r in results)
                else None
            ),
            "final_greedy_reward_each": [r["final_greedy_reward"] for r in results],
            "phases_mean_median": {
                name: statistics.median(r["phases_mean"][name] for r in results)
                for name in results[0]["phases_mean"]
                if all(r["phases_mean"][name] is not None for r in results)
            },
        }
    for base in ("sync", "sync_1thread"):
        for row in ("async", "async_process"):
            if base in runs and row in runs:
                pairs = zip(runs[row], runs[base], strict=True)
                summary[f"{row}_over_{base}_update_time"] = {
                    "of_medians": summary[row]["update_seconds_median"] / summary[base]["update_seconds_median"],
                    "per_repeat": [a["update_seconds_median"] / s["update_seconds_median"] for a, s in pairs],
                    "goal": 0.7,
                }
    out = {
        "benchmark": "grpo_async",
        "preset": "tiny-grpo",
        "overrides": args.set,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
