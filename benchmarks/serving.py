#!/usr/bin/env python3
"""Serving throughput and latency: colo's `ServingEngine` (continuous batching, paged KV cache) against
transformers ``generate`` on static batches of the same requests (the fair peer on one machine) and one request at a
time, in fp32, int8 and int4 (colo.apps.quant), on CPU.

Workload: ``C`` concurrent clients (``--concurrency``, default 1, 4 and 16) each send one request at time 0: a
random prompt of ``--prompt-len`` (32) tokens, or of a length drawn uniformly from ``--prompt-len`` to
``--prompt-len-max`` when that is given (mixed lengths), and ``--new-tokens`` (32) greedy tokens with the eos
ignored, so every row generates the same number of tokens. Model: the ``tiny-llama`` preset (vocab 4096, hidden
256, 4 layers) with ``intermediate_size=768`` so every int4 group size divides the MLP width (``--model`` for another
preset), weights from ``init_weights(seed)``; the Hugging Face ``LlamaForCausalLM`` gets the same weights
(`colo.apps.models.llama.hf.llama_state_dict_to_hf`), and the quantized rows quantize both the same way
(`quantize_model`, the ``reference`` backend, ``lm_head`` in float).

Rows (``--engines`` x ``--formats``):

- ``colo``: every request added to one `ServingEngine` (``max_batch_size`` 16, a KV budget for 16 requests), then
  ``step()`` until all finish; a request's latency is the time from the start to the step that finished it.
- ``hf-static``: transformers ``generate`` (its dynamic cache, SDPA) on all ``C`` requests as one batch, prompts
  left-padded with an attention mask (static batching: padding, no continuous batching); every request finishes
  with the batch.
- ``hf-sequential``: transformers ``generate`` on one request after another, as a server without batching would;
  a request's latency includes its wait behind the ones before it.

Reported per row and concurrency: generated tokens/s over the whole batch of requests, p50 and p99 request latency
and time to first token (a transformers streamer's clock for the ``hf`` rows; the step that produced a request's
first token for colo), medians over ``--repeats`` repeats (rows interleaved, the order rotated per repeat, one
untimed warm-up per row); the throughput ratios to ``hf-static`` and ``hf-sequential`` in the same format (median
over repeats of the ratio within one repeat: the figure to trust on a shared machine); and the fraction of tokens
equal to the ``colo`` fp32 row's. One thread (``torch.set_num_threads(1)``).

Another mode (an HTTP client against ``colo serve``) can be added as a new entry of `ENGINES`: a function
``(models, prompts, new_tokens) -> (seconds, latencies, first_token_latencies, tokens)``.

On a GPU (``--device cuda --dtype bfloat16``, fp32 format rows only, e.g. ``--model 1b``): both models in bf16 on
the device, transformers with SDPA and its static cache (``cache_implementation="static"``), clocks read after a
device synchronize; no thread limit.

Run::

    OMP_NUM_THREADS=1 python benchmarks/serving.py [--concurrency 1 4 16] [--repeats 3] [--prompt-len-max 128]
    python benchmarks/serving.py --device cuda --dtype bfloat16 --model 1b --formats fp32 --prompt-len 128 \
        --prompt-len-max 1024 --new-tokens 128 --concurrency 1 4 16 --out benchmarks/results/serving_h200.json

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


DEVICE = torch.device("cpu")
"""Where the models run (``--device``)."""


def _sync() -> None:
    """Wait for the device (a clock read after it sees finished work)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def build_models(preset: str, fmt: str, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Module]:
    """The native Llama and the Hugging Face Llama with the same weights, both in format ``fmt`` (``dtype`` on
    `DEVICE` for the float format)."""
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
    elif DEVICE.type != "cpu" or dtype != torch.float32:
        native.to(DEVICE, dtype)
        hf.to(DEVICE, dtype)
        native.rotary_emb.reset_parameters()  # the rotary tables in fp32 on the device, as the model builds them
    return {"native": native, "hf": hf}


def _hf_generate_options() -> dict:
    """transformers' static cache on a GPU (the fair peer there); its default cache on the CPU."""
    return {"cache_implementation": "static"} if DEVICE.type == "cuda" else {}


Run = tuple[float, list[float], list[float], list[list[int]]]
"""``(seconds, latencies, first_token_latencies, tokens)`` of one engine over one batch of requests."""


def run_colo(models, prompts: list[list[int]], new_tokens: int) -> Run:
    """All requests in flight at once through one `ServingEngine` (a KV budget for 16 of the longest request)."""
    blocks_per_request = -(-(max(len(p) for p in prompts) + new_tokens) // 16)
    engine = ServingEngine(models["native"], max_batch_size=16, block_size=16, num_blocks=16 * blocks_per_request)
    params = RequestParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    latencies: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():  # the step's tokens reached the host: its work is done
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                latencies[out.request_id] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    order = [str(i) for i in range(len(prompts))]
    return seconds, [latencies[i] for i in order], [first[i] for i in order], [tokens[i] for i in order]


def _first_token_clock(start: float):
    """A transformers streamer that notes when ``generate`` emits its first new tokens (its first ``put`` is the
    prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenClock(BaseStreamer):
        def __init__(self) -> None:
            self.puts, self.first = 0, None

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter() - start

        def end(self) -> None:
            pass

    return FirstTokenClock()


def run_hf_static(models, prompts: list[list[int]], new_tokens: int) -> Run:
    """transformers ``generate`` on every request as one left-padded batch (static batching)."""
    model = models["hf"]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    _sync()
    start = time.perf_counter()
    clock = _first_token_clock(start)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0, streamer=clock, **_hf_generate_options(),
        )  # fmt: skip
    _sync()
    seconds = time.perf_counter() - start
    return seconds, [seconds] * len(prompts), [clock.first] * len(prompts), out[:, width:].tolist()


def run_hf_sequential(models, prompts: list[list[int]], new_tokens: int) -> Run:
    """transformers ``generate``, one request after another (no batching)."""
    model = models["hf"]
    latencies, first, tokens = [], [], []
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=DEVICE)
            clock = _first_token_clock(start)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0, streamer=clock, **_hf_generate_options(),
            )  # fmt: skip
            _sync()
            latencies.append(time.perf_counter() - start)
            first.append(clock.first)
            tokens.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - start, latencies, first, tokens


ENGINES: dict[str, Callable] = {"colo": run_colo, "hf-static": run_hf_static, "hf-sequential": run_hf_sequential}


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
    parser.add_argument("--prompt-len-max", type=int, default=None, help="mixed lengths: uniform in [len, max]")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=str(RESULTS / "serving_cpu.json"))
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if (DEVICE.type != "cpu" or dtype != torch.float32) and args.formats != ["fp32"]:
        parser.error("--device cuda / --dtype bfloat16 run the float models only: pass --formats fp32")
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)
    models = {fmt: build_models(args.model, fmt, args.seed, dtype) for fmt in args.formats}
    vocab = models[args.formats[0]]["native"].config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    longest = args.prompt_len_max or args.prompt_len
    lengths = torch.randint(args.prompt_len, longest + 1, (max(args.concurrency),), generator=generator).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    rows = [(engine, fmt) for fmt in args.formats for engine in args.engines]
    for engine, fmt in rows:  # warm-up
        ENGINES[engine](models[fmt], prompts[:2], 4)
    runs: dict[tuple, list[tuple[float, list[float], list[float]]]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    for repeat in range(args.repeats):
        order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
        for concurrency in args.concurrency:
            for engine, fmt in order:
                seconds, latencies, first, generated = ENGINES[engine](
                    models[fmt], prompts[:concurrency], args.new_tokens
                )
                runs.setdefault((engine, fmt, concurrency), []).append((seconds, latencies, first))
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
                "tokens_per_s": statistics.median(concurrency * args.new_tokens / s for s, _, _ in measured),
                "p50_latency_s": statistics.median(percentile(lat, 50) for _, lat, _ in measured),
                "p99_latency_s": statistics.median(percentile(lat, 99) for _, lat, _ in measured),
                "p50_first_token_s": statistics.median(percentile(first, 50) for _, _, first in measured),
                "p99_first_token_s": statistics.median(percentile(first, 99) for _, _, first in measured),
                "seconds_all": [s for s, _, _ in measured],
                "tokens_equal_to_colo_fp32": equal,
            }
        )
    for r in results:  # the same repeat's runs side by side: the figures that survive a noisy machine
        own = runs[(r["engine"], r["format"], r["concurrency"])]
        for peer in ("hf-static", "hf-sequential"):
            base = runs.get((peer, r["format"], r["concurrency"]))
            r[f"throughput_vs_{peer.replace('-', '_')}"] = (
                statistics.median(b[0] / s[0] for s, b in zip(own, base)) if base is not None else None
            )
    print(
        f"\n{'engine':>14} {'format':>8} {'conc':>5} {'tok/s':>9} {'p50 s':>8} {'p99 s':>8} {'ttft p50':>9} "
        f"{'x static':>9} {'x hf-seq':>9} {'=colo fp32':>10}"
    )
    for r in results:
        equal = "-" if r["tokens_equal_to_colo_fp32"] is None else f"{r['tokens_equal_to_colo_fp32']:.3f}"
        ratios = [
            "-" if r[key] is None else f"{r[key]:.2f}"
            for key in ("throughput_vs_hf_static", "throughput_vs_hf_sequential")
        ]
        print(
            f"{r['engine']:>14} {r['format']:>8} {r['concurrency']:>5} {r['tokens_per_s']:9.1f} "
            f"{r['p50_latency_s']:8.3f} {r['p99_latency_s']:8.3f} {r['p50_first_token_s']:9.3f} {ratios[0]:>9} "
            f"{ratios[1]:>9} {equal:>10}"
        )
    import transformers

    payload = {
        "benchmark": "serving: colo ServingEngine (continuous batching, paged KV, prefix caching) vs transformers "
        "generate on static batches of the same requests and one request at a time",
        "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "hf_cache": "static" if DEVICE.type == "cuda" else "dynamic",
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
            "prompt_len_max": args.prompt_len_max,
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
