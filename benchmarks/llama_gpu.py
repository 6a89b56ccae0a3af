#!/usr/bin/env python3
"""The native Llama on one GPU with colo's kernels against the same model in transformers (eager + SDPA) and both
compiled: training tokens/s and MFU.

Rows (``--impls``), every one the same shape (``--preset``, default ``1b``: TinyLlama-1.1B, untied), bf16
parameters and activations, ``torch.optim.AdamW(lr=3e-4, fused=True)`` on the bf16 parameters (no fp32 masters:
the same for every row, so the comparison is of the model's forward and backward), random token batches
(``labels = input_ids``, a different seed per step):

- ``colo``: `colo.apps.Llama` with colo.kernels' Triton ops (RMSNorm, rotary, flash attention, SwiGLU, fused linear
  cross-entropy).
- ``colo-compiled``: the same with every decoder layer compiled (``layer.compile()``, torchtitan's per-block form;
  the colo ops stay opaque to inductor).
- ``hf-sdpa``: ``transformers.LlamaForCausalLM`` built from the equivalent config, ``attn_implementation="sdpa"``
  (flash backend on H100 for bf16), eager.
- ``hf-sdpa-compiled``: the same with every decoder layer compiled.

A row may carry ``@attn=sdpa`` or ``@attn=triton`` (``colo@attn=sdpa``): the row runs with ``COLO_PLAIN_ATTENTION``
set so, measuring colo's model with plain attention through SDPA or through colo's kernel whatever the tuning file
chooses. Compiled rows report dynamo's counters (graph breaks with their reasons, graphs, recompiles);
``--profile`` adds, per colo row, the 25 CUDA kernels with the most self time over one more step.

MFU = tokens/s x ``flops_per_token(config, seq_len)`` (6N + 12·L·S·H·D, the full score matrix as the PaLM
convention counts it) / the device's dense bf16 peak (`colo.kernels.bench.device_peaks`). Each row builds a fresh
model from seed 0, runs ``--warmup`` steps (the first compiles; reported as ``first_step_s``) and ``--steps`` timed
steps (CUDA-synchronized wall time per step; the median is reported); peak memory is torch's allocator high-water
mark. Rows run in the given order, repeated ``--repeats`` times with the order rotated, and the JSON is rewritten
after every row so a run cut short still leaves its rows.

    python benchmarks/llama_gpu.py --json OUT.json [--preset 1b] [--batch 8] [--seq 2048] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from colo.apps import Llama, get_preset
from colo.apps.hf.llama_io import llama_config_to_hf
from colo.apps.models.llama.flops import flops_per_token
from colo.kernels.bench import device_peaks

IMPLS = ("colo", "hf-sdpa", "colo-compiled", "hf-sdpa-compiled")
ROW_OPTIONS = {"attn": "COLO_PLAIN_ATTENTION"}


def _build(impl: str, preset: str) -> torch.nn.Module:
    config = get_preset(preset)
    torch.manual_seed(0)
    if impl.startswith("colo"):
        model = Llama(config)
        model.init_weights(0)
        layers = list(model.layers.values())
    else:
        import transformers

        fields = llama_config_to_hf(config, dtype=torch.bfloat16)
        hf_config = transformers.LlamaConfig(
            **{k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
        )
        model = transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation="sdpa")
        layers = list(model.model.layers)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    if impl.endswith("compiled"):
        for layer in layers:
            layer.compile()
    return model


def run_row(spec: str, *, preset: str, batch: int, seq: int, warmup: int, steps: int, profile: bool = False) -> dict:
    impl, _, option = spec.partition("@")
    saved = dict(os.environ)
    if option:
        name, _, value = option.partition("=")
        os.environ[ROW_OPTIONS[name]] = value
    try:
        row = _run_row(impl, preset=preset, batch=batch, seq=seq, warmup=warmup, steps=steps, profile=profile)
        return row | {"impl": spec}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _profile_step(model, ids) -> list[dict]:
    """The CUDA kernels with the most self time over one training step (forward, backward; no optimizer)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
    events = []
    for event in prof.key_averages():
        self_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        events.append({"name": event.key[:120], "self_ms": self_us / 1e3, "calls": event.count})
    events.sort(key=lambda e: -e["self_ms"])
    return events[:25]


def _dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    return {
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": {str(reason)[:200]: count for reason, count in list(breaks.items())[:10]},
        "totals": {name: sum(values.values()) for name, values in counters.items()},
        "stats": dict(counters.get("stats", {})),
    }


def _run_row(impl: str, *, preset: str, batch: int, seq: int, warmup: int, steps: int, profile: bool) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = _build(impl, preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    config = get_preset(preset)
    times, losses = [], []
    for step in range(warmup + steps):
        ids = torch.randint(
            0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1000 + step)
        ).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step_s = statistics.median(times[warmup:])
    tokens_per_s = batch * seq / step_s
    peak_tflops = device_peaks(torch.cuda.get_device_name())[1]
    flops = flops_per_token(config, seq) * tokens_per_s
    row = {
        "impl": impl,
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "first_step_s": times[0],
        "model_tflops": flops / 1e12,
        "mfu_pct": 100 * flops / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
    }
    if impl.endswith("compiled"):
        row["dynamo"] = _dynamo_counters()
    if profile and impl.startswith("colo"):
        row["profile"] = _profile_step(model, ids)
    optimizer.zero_grad(set_to_none=True)
    del model, optimizer
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="the top CUDA kernels of one step per colo row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    impls = args.impls.split(",")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": "bfloat16",
        "peak_bf16_tflops": device_peaks(torch.cuda.get_device_name())[1],
        "rows": [],
    }
    for repeat in range(args.repeats):
        for impl in impls[repeat % len(impls) :] + impls[: repeat % len(impls)]:
            try:
                row = run_row(
                    impl,
                    preset=args.preset,
                    batch=args.batch,
                    seq=args.seq,
                    warmup=args.warmup,
                    steps=args.steps,
                    profile=args.profile,
                )
            except Exception as error:  # noqa: BLE001 - one failing row must not lose the others
                row = {"impl": impl, "error": f"{type(error).__name__}: {error}"[:500]}
                torch.cuda.empty_cache()
            row["repeat"] = repeat
            report["rows"].append(row)
            summary = (
                row["error"]
                if "error" in row
                else f"{row['tokens_per_s']:9.0f} tokens/s  MFU {row['mfu_pct'] or 0:5.1f}%  "
                f"step {row['step_s']:.3f} s  first {row['first_step_s']:.1f} s  "
                f"peak {row['peak_memory_gib']:.1f} GiB  loss {row['losses'][-1]:.3f}"
            )
            print(f"{impl:22s} {summary}", flush=True)
            if args.json:
                with open(args.json, "w") as file:
                    json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()
