#!/usr/bin/env python3
"""Prefix caching in colo's `ServingEngine`: time to first token for requests sharing a long system prompt, with
prefix caching on and off, on CPU in fp32.

Workload: ``--requests`` (8) requests, each a shared ``--system-len`` (512) token system prompt followed by its own
random ``--user-len`` (16) tokens, ``--new-tokens`` (8) greedy tokens with the eos ignored. They arrive one after
another (each once the one before finished), so a request's time to first token is its own prefill (and the cache
of the requests before it), not a wait in a queue. Model: the ``tiny-llama`` preset (vocab 4096, hidden 256, 4
layers, ``max_position_embeddings`` raised to 1024), weights from ``init_weights(seed)``, block size 16.

Reported per setting (``on`` / ``off``): the median time to first token of the first request and of the requests
after it (medians over ``--repeats`` rounds, the two settings interleaved with the order swapped every round, one
untimed warm-up each), the prompt tokens the engine prefilled (fed to the model) and those it took from the cache,
the ratio off / on of the later requests' time to first token (median over rounds of the ratio within a round: the
figure to trust on a shared machine), and whether both settings generated the same tokens. One thread
(``torch.set_num_threads(1)``).

Run::

    OMP_NUM_THREADS=1 python benchmarks/serving_prefix_cache.py [--repeats 5]

Writes ``benchmarks/results/serving_prefix_cache_cpu.json`` (``--out``).
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


def run(model, prompts: list[list[int]], new_tokens: int, *, prefix_caching: bool) -> dict:
    """The requests one after another through one engine; each one's time to first token and tokens."""
    engine = ServingEngine(
        model, max_batch_size=4, block_size=16, num_blocks=4 * 64, enable_prefix_caching=prefix_caching
    )
    params = RequestParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    first_token, tokens = [], []
    for index, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(str(index), prompt, params)
        generated: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and not generated:
                    first_token.append(time.perf_counter() - start)
                generated += out.new_token_ids
        tokens.append(generated)
    return {
        "ttft_s": first_token,
        "tokens": tokens,
        "prefilled_tokens": engine.num_prefill_tokens,
        "cached_tokens": engine.num_prefix_cached_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_prefix_cache_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = get_preset("tiny-llama", max_position_embeddings=1024)
    model = Llama(config)
    model.init_weights(args.seed)
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    system = torch.randint(config.vocab_size, (args.system_len,), generator=generator).tolist()
    prompts = [
        system + torch.randint(config.vocab_size, (args.user_len,), generator=generator).tolist()
        for _ in range(args.requests)
    ]
    settings = {"on": True, "off": False}
    for enabled in settings.values():  # warm-up
        run(model, prompts[:2], args.new_tokens, prefix_caching=enabled)
    rounds: dict[str, list[dict]] = {name: [] for name in settings}
    for repeat in range(args.repeats):
        order = list(settings) if repeat % 2 == 0 else list(settings)[::-1]
        for name in order:
            rounds[name].append(run(model, prompts, args.new_tokens, prefix_caching=settings[name]))
    rows = {}
    for name in settings:
        results = rounds[name]
        rows[name] = {
            "ttft_first_s": statistics.median(r["ttft_s"][0] for r in results),
            "ttft_later_p50_s": statistics.median(statistics.median(r["ttft_s"][1:]) for r in results),
            "prefilled_tokens": results[0]["prefilled_tokens"],
            "cached_tokens": results[0]["cached_tokens"],
        }
    ratios = [
        statistics.median(off["ttft_s"][1:]) / statistics.median(on["ttft_s"][1:])
        for on, off in zip(rounds["on"], rounds["off"], strict=True)
    ]
    same_tokens = all(on["tokens"] == off["tokens"] for on, off in zip(rounds["on"], rounds["off"], strict=True))
    report = {
        "benchmark": "serving_prefix_cache",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "workload": {key: getattr(args, key) for key in ("requests", "system_len", "user_len", "new_tokens", "repeats")}
        | {"model": "tiny-llama", "dtype": "float32", "block_size": 16, "threads": 1},
        "rows": rows,
        "later_ttft_ratio_off_over_on": {"median": statistics.median(ratios), "per_round": ratios},
        "same_tokens": same_tokens,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in rows.items():
        print(
            f"prefix caching {name:3s}: first request ttft {row['ttft_first_s'] * 1e3:7.1f} ms, later p50 "
            f"{row['ttft_later_p50_s'] * 1e3:7.1f} ms, prefilled {row['prefilled_tokens']} tokens, cached "
            f"{row['cached_tokens']}"
        )
    print(f"later requests' ttft off/on: {statistics.median(ratios):.2f}x (per round {[round(r, 2) for r in ratios]})")
    print(f"same tokens: {same_tokens}; wrote {args.out}")


if __name__ == "__main__":
    main()
