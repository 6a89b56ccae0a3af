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
import statistics
import time

import torch

from colo.apps import Llama, get_preset
from colo.apps.hf.llama_io import llama_config_to_hf
from colo.apps.models.llama.flops import flops_per_token
from colo.kernels.bench import device_peaks

IMPLS = ("colo", "hf-sdpa", "colo-compiled", "hf-sdpa-compiled")


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


def run_row(impl: str, *, preset: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    torch._dynamo.reset()
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
                    impl, preset=args.preset, batch=args.batch, seq=args.seq, warmup=args.warmup, steps=args.steps
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
            print(f"{impl:17s} {summary}", flush=True)
            if args.json:
                with open(args.json, "w") as file:
                    json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()
