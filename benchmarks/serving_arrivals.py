#!/usr/bin/env python3
"""Serving under arrivals over time: colo's `ServingEngine` (continuous batching) against a static-batching server
over transformers ``generate`` and against one request at a time, on the same timed requests (issue 48).

`benchmarks/serving.py` sends every request at time 0 with one output length, where static batching wastes nothing.
Here the workload is what a server sees: ``--requests`` requests arriving as a Poisson process of ``--rate``
requests/s (seeded), prompts of ``--prompt-len`` to ``--prompt-len-max`` tokens, and each its own number of greedy
tokens, uniform in ``--new-tokens`` to ``--new-tokens-max`` (eos ignored). The three servers:

- ``colo``: a request is added to one `ServingEngine` when its arrival time has come; the loop steps the engine
  whenever it has work (``max_batch_size`` ``--max-batch``, a KV budget for that many of the longest requests).
- ``hf-static``: when idle, the server takes every request that has arrived (at most ``--max-batch``) as one
  left-padded batch and runs ``generate`` for the longest output among them (each row then keeps its own tokens);
  requests arriving meanwhile wait for the batch to end, as in a server without continuous batching.
- ``hf-sequential``: ``generate`` on one request at a time, in arrival order.

Reported per server: output tokens/s over the makespan (first arrival to last completion), p50 / p99 latency and
time to first token counted from each request's arrival (a transformers streamer's clock for the ``hf`` servers,
the engine step of the first token for colo), medians over ``--repeats`` interleaved repeats, and colo's ratios to
each peer within one repeat (their median). Tokens are compared with colo's. fp32, one thread, tiny-llama (the
model of `benchmarks/serving.py`).

    OMP_NUM_THREADS=1 python benchmarks/serving_arrivals.py [--requests 32] [--rate 40] [--repeats 3]

Writes ``benchmarks/results/serving_arrivals_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import _first_token_clock, build_models, percentile  # noqa: E402
from zero_dp import RESULTS  # noqa: E402

from colo.apps.serving import RequestParams, ServingEngine  # noqa: E402


def _wait_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_colo(models, work: dict, max_batch: int) -> dict:
    prompts, outputs, arrivals = work["prompts"], work["new_tokens"], work["arrivals"]
    longest = max(len(p) for p in prompts) + max(outputs)
    engine = ServingEngine(
        models["native"], max_batch_size=max_batch, block_size=16, num_blocks=max_batch * -(-longest // 16)
    )
    start = time.perf_counter()
    pending = list(range(len(prompts)))
    first, done, tokens = {}, {}, {str(i): [] for i in range(len(prompts))}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            index = pending.pop(0)
            params = RequestParams(max_tokens=outputs[index], temperature=0, ignore_eos=True)
            engine.add_request(str(index), prompts[index], params)
        if not engine.has_unfinished():
            _wait_until(start + arrivals[pending[0]])
            continue
        for out in engine.step():
            moment = time.perf_counter() - start
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = moment
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                done[out.request_id] = moment
    order = [str(i) for i in range(len(prompts))]
    return _result(work, [done[i] for i in order], [first[i] for i in order], [tokens[i] for i in order])


def _generate(model, batch: list[list[int]], new_tokens: int, start: float):
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    clock = _first_token_clock(start)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0, streamer=clock,
        )  # fmt: skip
    return out[:, width:].tolist(), clock.first, time.perf_counter() - start


def run_hf_static(models, work: dict, max_batch: int) -> dict:
    return _run_hf(models, work, max_batch)


def run_hf_sequential(models, work: dict, max_batch: int) -> dict:
    return _run_hf(models, work, 1)


def _run_hf(models, work: dict, max_batch: int) -> dict:
    prompts, outputs, arrivals = work["prompts"], work["new_tokens"], work["arrivals"]
    count = len(prompts)
    first, done, tokens = [0.0] * count, [0.0] * count, [[] for _ in range(count)]
    start = time.perf_counter()
    served = 0
    while served < count:
        _wait_until(start + arrivals[served])
        now = time.perf_counter() - start
        batch = [i for i in range(served, count) if arrivals[i] <= now][:max_batch]
        generated, first_at, end = _generate(
            models["hf"], [prompts[i] for i in batch], max(outputs[i] for i in batch), start
        )
        for index, row in zip(batch, generated, strict=True):
            first[index], done[index], tokens[index] = first_at, end, row[: outputs[index]]
        served += len(batch)
    return _result(work, done, first, tokens)


def _result(work: dict, done: list[float], first: list[float], tokens: list[list[int]]) -> dict:
    arrivals = work["arrivals"]
    makespan = max(done) - min(arrivals)
    return {
        "tokens_per_s": sum(work["new_tokens"]) / makespan,
        "makespan_s": makespan,
        "latency_s": [d - a for d, a in zip(done, arrivals, strict=True)],
        "first_token_s": [f - a for f, a in zip(first, arrivals, strict=True)],
        "tokens": tokens,
    }


SERVERS = {"colo": run_colo, "hf-static": run_hf_static, "hf-sequential": run_hf_sequential}


def workload(args, vocab: int) -> dict:
    draw = random.Random(args.seed)
    arrivals, moment = [], 0.0
    for _ in range(args.requests):
        arrivals.append(moment)
        moment += draw.expovariate(args.rate)
    return {
        "prompts": [
            [draw.randrange(vocab) for _ in range(draw.randint(args.prompt_len, args.prompt_len_max))]
            for _ in range(args.requests)
        ],
        "new_tokens": [draw.randint(args.new_tokens, args.new_tokens_max) for _ in range(args.requests)],
        "arrivals": arrivals,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=40.0, help="Poisson arrivals, requests per second")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--prompt-len-max", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--new-tokens-max", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "serving_arrivals_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = build_models(args.model, "fp32", args.seed)
    work = workload(args, models["native"].config.vocab_size)
    warm = {key: value[:2] for key, value in work.items()} | {"arrivals": [0.0, 0.0]}
    for server in SERVERS.values():
        server(models, warm, args.max_batch)
    runs: dict[str, list[dict]] = {name: [] for name in SERVERS}
    names = list(SERVERS)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            result = SERVERS[name](models, work, args.max_batch)
            runs[name].append(result)
            print(
                f"[repeat {repeat}] {name:>14} {result['tokens_per_s']:8.1f} tok/s  makespan "
                f"{result['makespan_s']:.2f} s  p50 latency {percentile(result['latency_s'], 50):.3f} s  "
                f"p50 ttft {percentile(result['first_token_s'], 50):.3f} s",
                flush=True,
            )
    reference = runs["colo"][-1]["tokens"]
    rows = []
    for name, results in runs.items():
        row = {
            "server": name,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "makespan_s": statistics.median(r["makespan_s"] for r in results),
            "p50_latency_s": statistics.median(percentile(r["latency_s"], 50) for r in results),
            "p99_latency_s": statistics.median(percentile(r["latency_s"], 99) for r in results),
            "p50_first_token_s": statistics.median(percentile(r["first_token_s"], 50) for r in results),
            "p99_first_token_s": statistics.median(percentile(r["first_token_s"], 99) for r in results),
        }
        pairs = [(a, b) for x, y in zip(results[-1]["tokens"], reference, strict=True) for a, b in zip(x, y)]
        row["tokens_equal_to_colo"] = sum(a == b for a, b in pairs) / len(pairs)
        rows.append(row)
    colo = runs["colo"]
    for row in rows:
        own = runs[row["server"]]
        row["colo_throughput_ratio"] = statistics.median(
            c["tokens_per_s"] / o["tokens_per_s"] for c, o in zip(colo, own, strict=True)
        )
        row["colo_p50_ttft_ratio"] = statistics.median(
            percentile(c["first_token_s"], 50) / percentile(o["first_token_s"], 50) for c, o in zip(colo, own)
        )
    print(f"\n{'server':>14} {'tok/s':>8} {'p50 lat':>8} {'p99 lat':>8} {'p50 ttft':>9} {'colo x':>7} {'=colo':>6}")
    for row in rows:
        print(
            f"{row['server']:>14} {row['tokens_per_s']:8.1f} {row['p50_latency_s']:8.3f} {row['p99_latency_s']:8.3f} "
            f"{row['p50_first_token_s']:9.3f} {row['colo_throughput_ratio']:7.2f} {row['tokens_equal_to_colo']:6.3f}"
        )
    import transformers

    payload = {
        "benchmark": "serving under Poisson arrivals with varied output lengths: colo ServingEngine vs a static-"
        "batching server over transformers generate vs one request at a time",
        "device": "cpu",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
        },
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
