#!/usr/bin/env python3
"""Chunked prefill in colo's `ServingEngine`: how long running requests stall while a long prompt is prefilled, with
and without a per-step token budget (``max_tokens_per_step``), on CPU in fp32.

Workload: ``--running`` (4) requests with ``--short-len`` (32) token prompts decode ``--new-tokens`` (64) greedy
tokens each (eos ignored). Once each has ``--arrive-after`` (8) tokens, one request with a ``--long-len`` (1536)
token prompt arrives and generates ``--long-new-tokens`` (8) tokens. Model: the ``tiny-llama`` preset (vocab 4096,
hidden 256, 4 layers, ``max_position_embeddings`` raised to 2048), weights from ``init_weights(seed)``, block size 16.

Reported per setting (no budget, and each ``--budgets`` value): the running requests' inter-token latency while
the long prompt is in the engine (from its arrival to its first token: the longest gap between two tokens of a
running request, and the median), the long request's time to first token, the wall time of the whole workload,
the number of steps the long prefill took, and whether every setting generated the same tokens (greedy: chunking
changes the summation order of attention, not the tokens). Medians over ``--repeats`` rounds, the settings
interleaved with the order rotated every round, one untimed warm-up each. One thread (``torch.set_num_threads(1)``).

Run::

    OMP_NUM_THREADS=1 python benchmarks/serving_chunked_prefill.py [--repeats 3]

Writes ``benchmarks/results/serving_chunked_prefill_cpu.json`` (``--out``).
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
from zero_dp import RESULTS  # noqa: E402

from colo.apps.models.llama import Llama, get_preset  # noqa: E402
from colo.apps.serving import RequestParams, ServingEngine  # noqa: E402


def run(model, short: list[list[int]], long: list[int], args, *, budget: int | None) -> dict:
    """The workload through one engine: the running requests' token times, the long request's first token."""
    engine = ServingEngine(
        model, max_batch_size=len(short) + 1, block_size=16, num_blocks=256, max_tokens_per_step=budget
    )
    params = RequestParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    for index, prompt in enumerate(short):
        engine.add_request(f"run{index}", prompt, params)
    token_times: dict[str, list[float]] = {f"run{index}": [] for index in range(len(short))}
    tokens: dict[str, list[int]] = {name: [] for name in [*token_times, "long"]}
    arrived = first_long = None
    long_steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        if arrived is None and all(len(tokens[name]) >= args.arrive_after for name in token_times):
            arrived = time.perf_counter()
            engine.add_request("long", long, RequestParams(max_tokens=args.long_new_tokens, temperature=0))
        outputs = engine.step()
        now = time.perf_counter()
        if arrived is not None and first_long is None:
            long_steps += 1
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.request_id in token_times:
                token_times[out.request_id] += [now] * len(out.new_token_ids)
            elif out.new_token_ids and first_long is None:
                first_long = now
    end = time.perf_counter()
    gaps = [
        later - earlier
        for times in token_times.values()
        for earlier, later in zip(times, times[1:])
        if arrived <= later <= first_long
    ]
    return {
        "max_gap_s": max(gaps, default=0.0),
        "median_gap_s": statistics.median(gaps) if gaps else 0.0,
        "long_ttft_s": first_long - arrived,
        "long_prefill_steps": long_steps,
        "wall_s": end - start,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--arrive-after", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-new-tokens", type=int, default=8)
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_chunked_prefill_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = get_preset("tiny-llama", max_position_embeddings=2048)
    model = Llama(config)
    model.init_weights(args.seed)
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    short = [
        torch.randint(config.vocab_size, (args.short_len,), generator=generator).tolist() for _ in range(args.running)
    ]
    long = torch.randint(config.vocab_size, (args.long_len,), generator=generator).tolist()
    settings: dict[str, int | None] = {"unchunked": None} | {f"budget {b}": b for b in args.budgets}
    for budget in settings.values():  # warm-up
        run(model, short, long[: args.long_len // 4], args, budget=budget)
    rounds: dict[str, list[dict]] = {name: [] for name in settings}
    names = list(settings)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            rounds[name].append(run(model, short, long, args, budget=settings[name]))
    rows = {}
    for name, results in rounds.items():
        rows[name] = {
            "max_tokens_per_step": settings[name],
            "running_max_gap_s": statistics.median(r["max_gap_s"] for r in results),
            "running_median_gap_s": statistics.median(r["median_gap_s"] for r in results),
            "long_ttft_s": statistics.median(r["long_ttft_s"] for r in results),
            "long_prefill_steps": results[0]["long_prefill_steps"],
            "wall_s": statistics.median(r["wall_s"] for r in results),
        }
    reference = rounds["unchunked"][0]["tokens"]
    same_tokens = all(r["tokens"] == reference for results in rounds.values() for r in results)
    base = rows["unchunked"]
    for row in rows.values():
        row["max_gap_ratio_vs_unchunked"] = row["running_max_gap_s"] / base["running_max_gap_s"]
        row["long_ttft_ratio_vs_unchunked"] = row["long_ttft_s"] / base["long_ttft_s"]
    keys = ("running", "short_len", "new_tokens", "arrive_after", "long_len", "long_new_tokens", "repeats")
    report = {
        "benchmark": "serving_chunked_prefill",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "workload": {key: getattr(args, key) for key in keys}
        | {"model": "tiny-llama", "dtype": "float32", "block_size": 16, "threads": 1},
        "rows": rows,
        "same_tokens": same_tokens,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in rows.items():
        print(
            f"{name:12s}: running requests' longest gap {row['running_max_gap_s'] * 1e3:7.1f} ms "
            f"({row['max_gap_ratio_vs_unchunked']:.2f}x), median gap {row['running_median_gap_s'] * 1e3:6.1f} ms, "
            f"long ttft {row['long_ttft_s'] * 1e3:7.1f} ms ({row['long_ttft_ratio_vs_unchunked']:.2f}x) over "
            f"{row['long_prefill_steps']} steps, wall {row['wall_s']:.2f} s"
        )
    print(f"same tokens: {same_tokens}; wrote {args.out}")


if __name__ == "__main__":
    main()
