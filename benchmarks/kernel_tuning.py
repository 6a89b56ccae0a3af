#!/usr/bin/env python3
"""Measure launch configurations of colo's Triton kernels on this GPU and write a tuning file (`colo.kernels.tuning`).

    python benchmarks/kernel_tuning.py --out tuning.json --report report.json [--kernels attention,rms_norm,adamw]

For each kernel and class of inputs every candidate configuration is timed (CUDA events, median of ``--repeats``
after ``--warmup`` calls; the first candidate is the kernel's built-in default) and checked against a reference (a
candidate outside tolerance, or one that fails to compile, is dropped and reported); the fastest becomes an entry for
the GPU's compute capability. Nothing here changes numerics: only block sizes, warps and pipeline stages.

- attention: the forward, backward_dkdv and backward_dq kernels for the Llama-1b class (head dim 64, 8 query heads
  per kv head, causal, 8 x 2048) and the kernel-bench class (head dim 128, 32 heads, causal, 4 x 4096; the full mask
  takes the causal winners). With the tuned configurations, colo's kernel against ``scaled_dot_product_attention``
  (its FlashAttention-2 backend) per class, forward + backward; where SDPA is faster by more than ``--sdpa-margin``
  a ``flash_attention.plain`` entry makes ``flash_attention`` run SDPA for plain (no documents) attention of that
  class (see ``COLO_PLAIN_ATTENTION``). Then the head-dim-128 sweep 1k-16k, causal and full, both ways, for the report.
- rms_norm: rows per program and warps, forward and backward, bf16 16384 rows of 2048 and 4096.
- adamw: chunk size, warps and the alignment hint over 537M fp32 parameters, beside torch's ``fused=True`` AdamW.

``--device cpu --quick`` runs every step on tiny shapes in Triton's interpreter (``TRITON_INTERPRET=1``): a check of
this script, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import time
from collections.abc import Callable

import torch

fa = importlib.import_module("colo.kernels.flash_attention")
rows_module = importlib.import_module("colo.kernels._rows")
rms_module = importlib.import_module("colo.kernels.rms_norm")
adamw_module = importlib.import_module("colo.kernels.adamw")
from colo.kernels.bench import _median_ms  # noqa: E402 (the same timer as the kernel bench)

ATTENTION_CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages); the kernel's default is tried first
    "forward": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)],
    "backward_dkdv": [(64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (128, 64, 8, 2)],
    "backward_dq": [(128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 128, 8, 2)],
}
RMS_CANDIDATES = {  # (ROWS, num_warps) per BLOCK_N
    2048: [(1, 2), (1, 8), (1, 16), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16)],
    4096: [(1, 4), (1, 16), (1, 32), (2, 8), (2, 16), (4, 16), (4, 32)],
}
ADAMW_CANDIDATES = [(block, warps, aligned) for aligned in (True, False) for block in (1024, 2048, 4096, 8192)
                    for warps in (4, 8)]  # fmt: skip


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


class Tuner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.capability = list(torch.cuda.get_device_capability()) if self.device.type == "cuda" else [0, 0]
        self.entries: list[dict] = []
        self.report: dict = {
            "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
            "capability": self.capability,
            "torch": torch.__version__,
            "quick": args.quick,
            "attention": [],
            "attention_plain": [],
            "attention_sweep": [],
            "rms_norm": [],
            "adamw": [],
            "errors": [],
        }

    def time(self, fn: Callable[[], object]) -> float:
        return _median_ms(fn, self.device, self.args.warmup, self.args.repeats)

    def save(self) -> None:
        tuning = {
            "about": "Launch configurations measured by benchmarks/kernel_tuning.py; see colo.kernels.tuning.",
            "entries": self.entries,
        }
        with open(self.args.out, "w") as handle:
            json.dump(tuning, handle, indent=1)
        if self.args.report:
            with open(self.args.report, "w") as handle:
                json.dump(self.report, handle, indent=1)

    def add_entry(self, kernel: str, match: dict, config: dict, measured: dict) -> None:
        self.entries.append(
            {"kernel": kernel, "capability": self.capability, "match": match, "config": config, "measured": measured}
        )

    # ------------------------------------------------------------------------------------------------------------
    # attention
    # ------------------------------------------------------------------------------------------------------------

    def attention_inputs(self, batch: int, seq: int, heads_q: int, heads_kv: int, head_dim: int):
        generator = torch.Generator(device=self.device).manual_seed(0)

        def make(heads):
            shape = (batch, seq, heads, head_dim)
            return torch.randn(shape, device=self.device, dtype=self.dtype, generator=generator)

        return make(heads_q), make(heads_kv), make(heads_kv), make(heads_q)

    def tune_attention(self) -> None:
        quick = self.args.quick
        classes = [  # name, (batch, seq, heads_q, heads_kv, head_dim), causal values tuned, causal values entered
            ("llama-1b", (1, 48, 4, 2, 16) if quick else (8, 2048, 32, 4, 64), True),
            ("d128", (1, 48, 2, 2, 32) if quick else (4, 4096, 32, 32, 128), True),
        ]
        overrides: dict[str, dict] = {}
        default_launch = fa._launch_config

        def launch(q, kernel, causal):
            config = default_launch(q, kernel, causal)
            config.update(overrides.get(kernel, {}))
            return config

        fa._launch_config = launch
        try:
            for name, shape, causal in classes:
                q, k, v, dout = self.attention_inputs(*shape)
                scale = 1.0 / math.sqrt(shape[-1])
                reference = self.attention_reference(q, k, v, dout, causal, scale)
                out, lse = fa._block_forward_triton(q, k, v, causal, scale)
                chosen: dict[str, dict] = {}
                for kernel in fa.KERNELS:
                    default = {key: value for key, value in default_launch(q, kernel, causal).items()}
                    default.pop("NATIVE_DOT")
                    default.setdefault("num_stages", 3 if self.device.type == "cuda" else 1)
                    candidates = [default] + [
                        dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), values))
                        for values in ATTENTION_CANDIDATES[kernel]
                    ]
                    if quick:
                        candidates = [default, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}]
                    results = []
                    for candidate in candidates:
                        overrides.clear()
                        overrides.update(chosen)
                        overrides[kernel] = candidate
                        row = {"class": name, "kernel": kernel, "config": candidate}
                        try:
                            if kernel == "forward":
                                fn = functools.partial(fa._block_forward_triton, q, k, v, causal, scale)
                                got = fn()[0]
                                row["error_vs_reference"] = relative_error(got, reference["out"])
                                ok = row["error_vs_reference"] < 2e-2
                            else:
                                fn = functools.partial(
                                    fa._block_backward_triton, dout, q, k, v, out, lse, causal, scale
                                )
                                grads = fn()
                                errors = [relative_error(g, reference[n]) for g, n in zip(grads, ("dq", "dk", "dv"))]
                                row["error_vs_reference"] = max(errors)
                                ok = row["error_vs_reference"] < 3e-2
                            row["ms"] = self.time(fn) if ok else None
                            row["ok"] = ok
                        except Exception as error:  # noqa: BLE001 - a config that does not compile is dropped
                            row.update(ok=False, ms=None, error=f"{type(error).__name__}: {error}"[:300])
                        results.append(row)
                        self.report["attention"].append(row)
                        print("attention", json.dumps(row), flush=True)
                    good = [row for row in results if row["ok"]]
                    if not good:
                        continue
                    best = min(good, key=lambda row: row["ms"])
                    chosen[kernel] = best["config"]
                    default_ms = results[0]["ms"]
                    measured = {"shape": list(shape), "ms": best["ms"], "default_ms": default_ms}
                    match = {"dtype": str(self.dtype).removeprefix("torch."), "head_dim": shape[-1]}
                    self.add_entry(f"flash_attention.{kernel}", match, best["config"], measured)
                self.save()
        finally:
            overrides.clear()
            fa._launch_config = default_launch
        self.choose_plain_attention(classes)
        self.attention_sweep()

    def attention_reference(self, q, k, v, dout, causal, scale) -> dict:
        """SDPA's output and gradients (any backend) in the inputs' dtype."""
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = fa._sdpa_attention(q, k, v, causal, scale)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}

    def plain_pair(self, shape, causal):
        q, k, v, dout = self.attention_inputs(*shape)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        scale = 1.0 / math.sqrt(shape[-1])

        def colo():
            return fa.flash_attention(q, k, v, causal=causal, backend="triton")

        def sdpa():
            return fa._sdpa_attention(q, k, v, causal, scale)

        def with_backward(forward):
            def run():
                torch.autograd.grad(forward(), (q, k, v), dout)

            return run

        return colo, sdpa, with_backward

    def choose_plain_attention(self, classes) -> None:
        """Colo's tuned kernel against SDPA per class, forward + backward; SDPA is entered where it is faster."""
        tuning_path = self.args.out
        self.save()
        import os

        from colo.kernels import tuning

        os.environ[tuning.TUNING_ENV] = tuning_path
        tuning.clear_cache()
        for name, shape, _ in classes:
            for causal in (True, False):
                if name == "llama-1b" and not causal:
                    continue
                colo, sdpa, with_backward = self.plain_pair(shape, causal)
                row = {"class": name, "shape": list(shape), "causal": causal}
                try:
                    row["colo_forward_ms"] = self.time(colo)
                    row["sdpa_forward_ms"] = self.time(sdpa)
                    row["colo_forward_backward_ms"] = self.time(with_backward(colo))
                    row["sdpa_forward_backward_ms"] = self.time(with_backward(sdpa))
                    row["colo_vs_sdpa"] = row["sdpa_forward_backward_ms"] / row["colo_forward_backward_ms"]
                except Exception as error:  # noqa: BLE001
                    row["error"] = f"{type(error).__name__}: {error}"[:300]
                self.report["attention_plain"].append(row)
                print("attention_plain", json.dumps(row), flush=True)
                if row.get("colo_vs_sdpa", 1.0) < 1.0 - self.args.sdpa_margin:
                    match = {"dtype": str(self.dtype).removeprefix("torch."), "head_dim": shape[-1], "causal": causal}
                    measured = {k: row[k] for k in row if k.endswith("_ms")} | {"shape": list(shape)}
                    self.add_entry("flash_attention.plain", match, {"implementation": "sdpa"}, measured)
        self.save()
        # the sweep below measures colo's kernel itself against SDPA's flash backend
        tuning.clear_cache()

    def attention_sweep(self) -> None:
        from colo.kernels.bench import _sdpa_flash

        seqs = (32,) if self.args.quick else (1024, 2048, 4096, 8192, 16384)
        heads, head_dim = (2, 32) if self.args.quick else (32, 128)
        for seq in seqs:
            for causal in (True, False):
                batch = max(1, 16384 // seq) if not self.args.quick else 1
                colo, _, with_backward = self.plain_pair((batch, seq, heads, heads, head_dim), causal)
                q, k, v, dout = self.attention_inputs(batch, seq, heads, heads, head_dim)
                q_t, k_t, v_t = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

                flash = functools.partial(_sdpa_flash, q_t, k_t, v_t, causal)

                def flash_backward(flash=flash, inputs=(q_t, k_t, v_t), dout=dout):
                    torch.autograd.grad(flash(), inputs, dout)

                flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
                row = {"shape": [batch, seq, heads, head_dim], "causal": causal}
                try:
                    row["colo_forward_ms"] = self.time(colo)
                    row["colo_forward_backward_ms"] = self.time(with_backward(colo))
                    if self.device.type == "cuda":
                        row["sdpa_flash_forward_ms"] = self.time(flash)
                        row["sdpa_flash_forward_backward_ms"] = self.time(flash_backward)
                        row["forward_vs_sdpa_flash"] = row["sdpa_flash_forward_ms"] / row["colo_forward_ms"]
                        row["forward_backward_vs_sdpa_flash"] = (
                            row["sdpa_flash_forward_backward_ms"] / row["colo_forward_backward_ms"]
                        )
                    row["colo_forward_tflops"] = flops / row["colo_forward_ms"] / 1e9
                    row["colo_forward_backward_tflops"] = 3.5 * flops / row["colo_forward_backward_ms"] / 1e9
                except Exception as error:  # noqa: BLE001
                    row["error"] = f"{type(error).__name__}: {error}"[:300]
                self.report["attention_sweep"].append(row)
                print("attention_sweep", json.dumps(row), flush=True)
        self.save()

    # ------------------------------------------------------------------------------------------------------------
    # rms_norm
    # ------------------------------------------------------------------------------------------------------------

    def tune_rms_norm(self) -> None:
        override: dict = {}
        default_lookup = rows_module.tuned_config

        def lookup(kernel, device, **properties):
            return dict(override) if override else default_lookup(kernel, device, **properties)

        rows_module.tuned_config = lookup
        try:
            for hidden in (100,) if self.args.quick else (2048, 4096):
                tokens = 32 if self.args.quick else 16384
                x = torch.randn(tokens, hidden, device=self.device, dtype=self.dtype)
                weight = torch.rand(hidden, device=self.device, dtype=self.dtype) + 0.5
                dy = torch.randn_like(x)
                reference = rms_module.rms_norm_reference(x.float(), weight.float(), eps=1e-6)
                _, _, rstd = rms_module._forward_triton(x, weight, None, 1e-6)
                block_n = 1 << (hidden - 1).bit_length()
                candidates = RMS_CANDIDATES.get(block_n, [(1, 4), (2, 4)])
                for kernel in ("forward", "backward"):
                    results = []
                    for values in [None] + candidates:
                        override.clear()
                        if values is not None:
                            override.update(ROWS=values[0], num_warps=values[1])
                        row = {"hidden": hidden, "kernel": kernel, "config": dict(override) or "default"}
                        try:
                            if kernel == "forward":
                                fn = functools.partial(rms_module._forward_triton, x, weight, None, 1e-6)
                                row["error_vs_reference"] = relative_error(fn()[0], reference)
                                size = 2 * x.numel() * x.element_size()
                            else:
                                fn = functools.partial(rms_module._backward_triton, dy, None, x, weight, rstd, True)
                                fn()
                                row["error_vs_reference"] = 0.0
                                size = 3 * x.numel() * x.element_size()
                            row["ok"] = row["error_vs_reference"] < 1e-2
                            row["ms"] = self.time(fn)
                            row["gb_per_s"] = size / row["ms"] / 1e6
                        except Exception as error:  # noqa: BLE001
                            row.update(ok=False, ms=None, error=f"{type(error).__name__}: {error}"[:300])
                        results.append(row)
                        self.report["rms_norm"].append(row)
                        print("rms_norm", json.dumps(row), flush=True)
                    good = [row for row in results if row["ok"]]
                    best = min(good, key=lambda row: row["ms"]) if good else None
                    if best is not None and best["config"] != "default":  # else the built-in tiling stays
                        measured = {"shape": [tokens, hidden], "ms": best["ms"], "default_ms": results[0]["ms"]}
                        self.add_entry(f"rms_norm.{kernel}", {"block_n": block_n}, best["config"], measured)
                self.save()
        finally:
            rows_module.tuned_config = default_lookup

    # ------------------------------------------------------------------------------------------------------------
    # adamw
    # ------------------------------------------------------------------------------------------------------------

    def tune_adamw(self) -> None:
        override: dict = {}
        default_lookup = adamw_module.tuned_config

        def lookup(kernel, device, **properties):
            return dict(override) if override else default_lookup(kernel, device, **properties)

        adamw_module.tuned_config = lookup
        shapes = [(37,), (64, 100), (4097,)] if self.args.quick else [(4096, 4096)] * 32 + [(4096,)] * 32
        check_shapes = [(4097,), (12345,), (4096,), (3, 5)]
        hyper = {"step": 10, "lr": 1e-4, "weight_decay": 0.1}

        def tensors(shape_list):
            made = [torch.randn(s, device=self.device) for s in shape_list]
            grads = [torch.randn(s, device=self.device) for s in shape_list]
            states = (
                [torch.rand(s, device=self.device) for s in shape_list],
                [torch.rand(s, device=self.device) for s in shape_list],
            )
            return made, grads, states

        params, grads, states = tensors(shapes)
        numel = sum(p.numel() for p in params)
        try:
            results = []
            for values in [None] + ADAMW_CANDIDATES:
                override.clear()
                if values is not None:
                    override.update(BLOCK=values[0], num_warps=values[1], aligned_hint=values[2])
                row = {"config": dict(override) or "default", "params_m": numel / 1e6}
                try:
                    small_p, small_g, small_s = tensors(check_shapes)
                    expected = (
                        [t.clone() for t in small_p],
                        [t.clone() for t in small_s[0]],
                        [t.clone() for t in small_s[1]],
                    )
                    adamw_module.adamw_reference(expected[0], small_g, expected[1], expected[2], **hyper)
                    adamw_module.fused_adamw(small_p, small_g, *small_s, backend="triton", **hyper)
                    row["error_vs_reference"] = max(relative_error(a, b) for a, b in zip(small_p, expected[0]))
                    row["ok"] = row["error_vs_reference"] < 1e-5
                    row["ms"] = self.time(
                        lambda: adamw_module.fused_adamw(params, grads, *states, backend="triton", **hyper)
                    )
                    row["gb_per_s"] = 7 * 4 * numel / row["ms"] / 1e6
                except Exception as error:  # noqa: BLE001
                    row.update(ok=False, ms=None, error=f"{type(error).__name__}: {error}"[:300])
                results.append(row)
                self.report["adamw"].append(row)
                print("adamw", json.dumps(row), flush=True)
            override.clear()
            twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for twin, grad in zip(twins, grads):
                twin.grad = grad
            optimizer = torch.optim.AdamW(twins, lr=1e-4, weight_decay=0.1, fused=True)
            torch_row = {"config": "torch fused=True", "ms": self.time(optimizer.step), "params_m": numel / 1e6}
            torch_row["gb_per_s"] = 7 * 4 * numel / torch_row["ms"] / 1e6
            self.report["adamw"].append(torch_row)
            print("adamw", json.dumps(torch_row), flush=True)
            good = [row for row in results if row["ok"]]
            best = min(good, key=lambda row: row["ms"]) if good else None
            if best is not None and best["config"] != "default":  # else the built-in chunking stays
                measured = {
                    "params_m": numel / 1e6,
                    "ms": best["ms"],
                    "default_ms": results[0]["ms"],
                    "torch_fused_ms": torch_row["ms"],
                }
                self.add_entry("adamw", {}, best["config"], measured)
            self.save()
        finally:
            adamw_module.tuned_config = default_lookup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the tuning file to write")
    parser.add_argument("--report", default=None, help="every measurement, as JSON")
    parser.add_argument("--kernels", default="attention,rms_norm,adamw")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a check of the script)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sdpa-margin", type=float, default=0.03)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu --quick with TRITON_INTERPRET=1 to check the script")
    tuner = Tuner(args)
    for kernel in args.kernels.split(","):
        started = time.perf_counter()
        try:
            {"attention": tuner.tune_attention, "rms_norm": tuner.tune_rms_norm, "adamw": tuner.tune_adamw}[kernel]()
        except Exception as error:  # noqa: BLE001 - one kernel's failure keeps the others' entries
            tuner.report["errors"].append(f"{kernel}: {type(error).__name__}: {error}"[:500])
            print(f"{kernel} failed: {error}", flush=True)
        print(f"== {kernel} took {time.perf_counter() - started:.1f}s", flush=True)
        tuner.save()


if __name__ == "__main__":
    main()
