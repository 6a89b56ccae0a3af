#!/usr/bin/env python3
"""Serving throughput and latency: colo's `ServingEngine` (continuous batching, paged KV cache) against
transformers ``generate`` serving one request at a time, in fp32, int8 and int4 (colo.apps.quant), on CPU.

Workload: ``C`` concurrent clients (``--concurrency``, default 1, 4 and 16) each send one request at time 0: a
random ``--prompt-len`` (32) token prompt, ``--new-tokens`` (32) greedy tokens with the eos ignored, so every row
generates the same number of tokens. Model: the ``tiny-llama`` preset (vocab 4096, hidden 256, 4 layers) with
``intermediate_size=768`` so every int4 group size divides the MLP width (``--model`` for another preset), weights
from ``init_weights(seed)``; the Hugging Face ``LlamaForCausalLM`` gets the same weights
(`colo.apps.models.llama.hf.llama_state_dict_to_hf`), and the quantized rows quantize both the same way
(`quantize_model`, the ``reference`` backend, ``lm_head`` in float).

Rows (``--engines`` x ``--formats``):

- ``colo``: every request added to one `ServingEngine` (``max_batch_size`` 16, a KV budget for 16 requests), then
  ``step()`` until all finish; a request's latency is the time from the start to the step that finished it.
- ``hf-sequential``: transformers ``generate`` (its dynamic cache) on one request after another, as a server
  without batching would; a request's latency includes its wait behind the ones before it.

Reported per row and concurrency: generated tokens/s over the whole batch of requests, p50 and p99 request latency
(medians over ``--repeats`` repeats, rows interleaved with the order rotated per repeat, one untimed warm-up per
row), the throughput ratio to ``hf-sequential`` in the same format (median over repeats of the ratio within one
repeat: the figure to trust on a shared machine), and the fraction of tokens equal to the ``colo`` fp32 row's. One
thread (``torch.set_num_threads(1)``).

Another mode (an HTTP client against ``colo serve``) can be added as a new entry of `ENGINES`: a function
``(models, prompts, new_tokens) -> (seconds, latencies, tokens)``.

Run::

    OMP_NUM_THREADS=1 python benchmarks/serving.py [--concurrency 1 4 16] [--repeats 3]

Writes ``benchmarks/results/serving_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_dp import RESULTS  # noqa: E402

from colo.apps.models.llama import Llama, get_preset  # noqa: E402
from colo.apps.quant import quantize_model  # noqa: E402
from colo.apps.serving import RequestParams, ServingEngine  # noqa: E402

FORMATS = {"fp32": (None, None), "int8": ("int8", None), "int4-g32": ("int4", 32)}
"""Format -> (quantize_model mode, int4 group size); fp32 is the float model."""
MODELS = {"tiny-llama": {"intermediate_size": 768}, "bench-25m": {}}


def build_models(preset: str, fmt: str, seed: int) -> dict[str, torch.nn.Module]:
    """The native Llama and the Hugging Face Llama with the same weights, both in format ``fmt``."""
    import transformers

    from colo.apps.hf.llama_io import llama_config_to_hf
    from colo.apps.models.llama.hf import llama_state_dict_to_hf

    native = Llama(get_preset(preset, **MODELS.get(preset, {})))
    native.init_weights(seed)
    native.eval()
    hf_config = transformers.LlamaConfig(**llama_config_to_hf(native.config), attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(llama_state_dict_to_hf(native.state_dict(), native.config), strict=False)
    if unexpected or any("rotary" not in name for name in missing):
        raise RuntimeError(f"HF weights do not match: missing {missing}, unexpected {unexpected}")
    mode, group_size = FORMATS[fmt]
    if mode is not None:
        for model in (native, hf):
            quantize_model(model, mode, group_size=group_size, skip=("lm_head",))
    return {"native": native, "hf": hf}


def run_colo(models, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
    """All requests in flight at once through one `ServingEngine`."""
    engine = ServingEngine(models["native"], max_batch_size=16, block_size=16, num_blocks=16 * 8)
    params = RequestParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    latencies: dict[str, float] = {}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                latencies[out.request_id] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    order = [str(i) for i in range(len(prompts))]
    return seconds, [latencies[i] for i in order], [tokens[i] for i in order]


def run_hf_sequential(models, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
    """transformers ``generate``, one request after another (no batching)."""
    model = models["hf"]
    latencies, tokens = [], []
    start = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            latencies.append(time.perf_counter() - start)
            tokens.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - start, latencies, tokens


ENGINES: dict[str, Callable] = {"colo": run_colo, "hf-sequential": run_hf_sequential}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation between order statistics)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "serving_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = {fmt: build_models(args.model, fmt, args.seed) for fmt in args.formats}
    vocab = models[args.formats[0]]["native"].config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (max(args.concurrency), args.prompt_len), generator=generator).tolist()
    rows = [(engine, fmt) for fmt in args.formats for engine in args.engines]
    for engine, fmt in rows:  # warm-up
        ENGINES[engine](models[fmt], prompts[:2], 4)
    runs: dict[tuple, list[tuple[float, list[float]]]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    for repeat in range(args.repeats):
        order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
        for concurrency in args.concurrency:
            for engine, fmt in order:
                seconds, latencies, generated = ENGINES[engine](models[fmt], prompts[:concurrency], args.new_tokens)
                runs.setdefault((engine, fmt, concurrency), []).append((seconds, latencies))
                tokens[(engine, fmt, concurrency)] = generated
                print(
                    f"[repeat {repeat}] {engine:>14} {fmt:>8} c={concurrency:<3} "
                    f"{concurrency * args.new_tokens / seconds:8.1f} tok/s",
                    flush=True,
                )
    results = []
    for (engine, fmt, concurrency), measured in runs.items():
        reference = tokens.get(("colo", "fp32", concurrency))
        generated = tokens[(engine, fmt, concurrency)]
        equal = None
        if reference is not None:
            pairs = [(a, b) for x, y in zip(generated, reference, strict=True) for a, b in zip(x, y, strict=True)]
            equal = sum(a == b for a, b in pairs) / len(pairs)
        results.append(
            {
                "engine": engine,
                "format": fmt,
                "concurrency": concurrency,
                "tokens_per_s": statistics.median(concurrency * args.new_tokens / s for s, _ in measured),
                "p50_latency_s": statistics.median(percentile(lat, 50) for _, lat in measured),
                "p99_latency_s": statistics.median(percentile(lat, 99) for _, lat in measured),
                "seconds_all": [s for s, _ in measured],
                "tokens_equal_to_colo_fp32": equal,
            }
        )
    for r in results:  # the same repeat's runs side by side: the figure that survives a noisy machine
        base = runs.get(("hf-sequential", r["format"], r["concurrency"]))
        r["throughput_vs_hf_sequential"] = (
            statistics.median(b / s for (s, _), (b, _) in zip(runs[(r["engine"], r["format"], r["concurrency"])], base))
            if base is not None
            else None
        )
    print(
        f"\n{'engine':>14} {'format':>8} {'conc':>5} {'tok/s':>9} {'p50 s':>8} {'p99 s':>8} {'x hf-seq':>9} "
        f"{'=colo fp32':>10}"
    )
    for r in results:
        equal = "-" if r["tokens_equal_to_colo_fp32"] is None else f"{r['tokens_equal_to_colo_fp32']:.3f}"
        ratio = "-" if r["throughput_vs_hf_sequential"] is None else f"{r['throughput_vs_hf_sequential']:.2f}"
        print(
            f"{r['engine']:>14} {r['format']:>8} {r['concurrency']:>5} {r['tokens_per_s']:9.1f} "
            f"{r['p50_latency_s']:8.3f} {r['p99_latency_s']:8.3f} {ratio:>9} {equal:>10}"
        )
    import transformers

    payload = {
        "benchmark": "serving: colo ServingEngine (continuous batching, paged KV) vs transformers generate one "
        "request at a time",
        "device": "cpu",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "settings": {
            "model": args.model,
            "model_overrides": MODELS.get(args.model, {}),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "seed": args.seed,
            "greedy": True,
            "quantize_backend": "reference",
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
