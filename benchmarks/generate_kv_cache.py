#!/usr/bin/env python3
"""Text generation with and without the KV cache: `colo.apps.generation.continue_prompt` on the native Llama, one
process.

Rows: ``cache`` (``use_cache=True``: the prompt prefilled once, then one single-token forward per new token over
the cached keys and values) and ``no_cache`` (``use_cache=False``: every new token re-runs the model over the whole
context). Models: the ``tiny-llama`` preset with a 320-token vocabulary (a byte-level tokenizer's size) and
``bench-25m`` (BENCHMARKS.md's 25.8M-parameter shape), both fp32, weights from ``init_weights(seed)``. Each run
continues a random ``--prompt-len`` (64) token prompt by ``--new-tokens`` (192) greedy tokens (no end-of-sequence
id, so every run produces all of them; 64 + 192 stays inside both presets' ``max_position_embeddings``, so the
window never slides). One short untimed warm-up generation (8 tokens) per row, then ``--repeats`` timed ones,
the row order alternating per repeat; one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``) unless the
device is a GPU.

Reported per model: tokens/s of each row (new tokens / wall time of the whole ``continue_prompt`` call, prefill
included), medians over the repeats, the ratio ``cache / no_cache`` of the medians, and whether both rows produced
the same tokens (they must: the cached path is exact up to floating-point rounding).

Run::

    OMP_NUM_THREADS=1 python benchmarks/generate_kv_cache.py [--models tiny-llama bench-25m] [--repeats 3]

Writes ``benchmarks/results/generate_kv_cache_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_dp import RESULTS  # noqa: E402

from colo.apps.generation import continue_prompt  # noqa: E402
from colo.apps.models.llama import Llama, get_preset  # noqa: E402

MODELS = {"tiny-llama": {"vocab_size": 320}, "bench-25m": {}}
"""Preset name -> overrides of its config."""
ROWS = {"cache": True, "no_cache": False}
"""Row name -> ``use_cache``."""
WARMUP_TOKENS = 8
"""New tokens of the untimed warm-up generation of each row."""


def build_model(preset: str, seed: int, device: torch.device) -> Llama:
    """The preset's Llama (fp32, eval mode) initialized from ``seed``."""
    config = get_preset(preset, **MODELS[preset])
    with torch.device(device):
        model = Llama(config)
    model.init_weights(seed)
    return model.eval()


def timed_generate(model: Llama, prompt: list[int], *, new_tokens: int, use_cache: bool) -> tuple[float, list[int]]:
    """Wall seconds of one greedy ``continue_prompt`` call, and the tokens it produced."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    tokens = continue_prompt(model, prompt, max_new_tokens=new_tokens, use_cache=use_cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - begin, tokens


def measure(preset: str, args, device: torch.device) -> dict:
    """Both rows on one model: per-repeat tokens/s, medians, the ratio, and whether the tokens agree."""
    model = build_model(preset, args.seed, device)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    for use_cache in ROWS.values():  # warm-up (allocator, kernels, thread pools), short and untimed
        timed_generate(model, prompt, new_tokens=min(args.new_tokens, WARMUP_TOKENS), use_cache=use_cache)
    tokens: dict[str, list[int]] = {}
    runs: dict[str, list[float]] = {row: [] for row in ROWS}
    for repeat in range(args.repeats):
        order = list(ROWS) if repeat % 2 == 0 else list(reversed(ROWS))
        for row in order:
            seconds, produced = timed_generate(model, prompt, new_tokens=args.new_tokens, use_cache=ROWS[row])
            if tokens.setdefault(row, produced) != produced:
                raise RuntimeError(f"{preset} / {row}: repeat {repeat} produced other tokens than repeat 0")
            runs[row].append(args.new_tokens / seconds)
            print(f"[repeat {repeat}] {preset:>10} {row:>8}: {runs[row][-1]:9.1f} tokens/s", flush=True)
    medians = {row: statistics.median(values) for row, values in runs.items()}
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": {
            key: getattr(model.config, key)
            for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
            + ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        },
        "tokens_per_s": runs,
        "median_tokens_per_s": medians,
        "speedup_cache_over_no_cache": medians["cache"] / medians["no_cache"],
        "same_tokens": tokens["cache"] == tokens["no_cache"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per row and model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/generate_kv_cache_<device>.json")
    args = parser.parse_args()
    if args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--prompt-len, --new-tokens and --repeats must be at least 1")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)

    started, load_start = time.perf_counter(), os.getloadavg()[0]
    models = {preset: measure(preset, args, device) for preset in args.models}
    print()
    print(f"{'model':>10} {'cache tok/s':>12} {'no-cache tok/s':>15} {'ratio':>7}  same tokens")
    for preset, result in models.items():
        medians = result["median_tokens_per_s"]
        print(
            f"{preset:>10} {medians['cache']:12.1f} {medians['no_cache']:15.1f} "
            f"{result['speedup_cache_over_no_cache']:6.2f}x  {result['same_tokens']}"
        )
    result = {
        "benchmark": "greedy generation with and without the KV cache, native Llama, one process",
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
            "threads": torch.get_num_threads(),
            "loadavg_1min": {"start": load_start, "end": os.getloadavg()[0]},
            "note": "shared machine: another workload may run alongside; treat the figures as noisy",
            "wall_s": time.perf_counter() - started,
        },
        "recipe": {
            "models": {preset: {"preset": preset, **MODELS[preset], "dtype": "float32"} for preset in args.models},
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "decoding": "greedy",
            "repeats": args.repeats,
            "warmup_tokens": WARMUP_TOKENS,
            "seed": args.seed,
        },
        "models": models,
    }
    out = Path(args.out) if args.out else RESULTS / f"generate_kv_cache_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
