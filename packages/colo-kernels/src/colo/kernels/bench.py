"""Benchmark colo's kernels against torch eager, ``torch.compile``, SDPA and Liger-Kernel.

``python -m colo.kernels.bench [--device cuda] [--ops rms_norm,swiglu] [--json OUT] [--quick]``

For every op it times the forward and the forward + backward (the optimizer: one step) of each implementation:
``colo-triton`` (the op with ``backend="triton"``), ``torch`` (the op's ``*_reference``, eager), and on CUDA also
``torch.compile`` of the reference, ``sdpa`` for attention, Liger-Kernel's function where ``liger_kernel`` imports,
and torch's foreach/fused AdamW. Times are medians of repeated runs (CUDA events on a GPU, ``perf_counter`` on
CPU). Memory-bound ops report GB/s from their ideal traffic (each tensor read or written once) and the percentage
of the device's peak bandwidth when the device is known; attention and the fused linear cross-entropy report
TFLOP/s; every CUDA row reports the peak extra memory of one run. Each row also gives the largest absolute
difference of the forward output from the ``torch`` row, so a GPU run doubles as a bf16 correctness check.

``--quick`` uses tiny shapes; on a CPU it runs the reference and the Triton interpreter only, in a few seconds.
Ops whose module does not import are listed under ``skipped`` in the JSON.

On CPU the Triton kernels run in Triton's interpreter. ``TRITON_INTERPRET=1`` must be set before the kernels are
decorated, that is before ``colo.kernels`` is imported, and ``python -m colo.kernels.bench`` imports that package
before this module runs; so on CPU with the variable unset, the command re-runs itself with it set.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from colo.kernels.dispatch import triton_available

OPS = (
    "copy",
    "rms_norm",
    "layer_norm",
    "rotary",
    "swiglu",
    "softmax",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "flash_attention",
    "adamw",
)

# (substring of torch.cuda.get_device_name(), peak memory bandwidth in GB/s, dense bf16 TFLOP/s); first match wins,
# so the more specific names come first. None: not known.
DEVICE_PEAKS = (
    ("GH200", None, None),  # 96 GB HBM3 and 144 GB HBM3e variants differ
    ("H200", 4800.0, 989.0),
    ("H100 NVL", 3900.0, 835.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.0),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100 80GB PCIe", 1935.0, 312.0),
    ("A100", 1555.0, 312.0),
    ("B200", 8000.0, 2250.0),
)


@dataclass
class Impl:
    """One implementation of an op: ``run()`` is its forward; ``inputs`` the leaves its backward differentiates."""

    run: Callable[[], Any]
    inputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class OpBench:
    """The implementations of one op on one input, and the work one call does."""

    shape: str
    impls: dict[str, Impl]
    bytes_forward: float | None = None
    bytes_forward_backward: float | None = None
    flops_forward: float | None = None
    flops_forward_backward: float | None = None
    has_backward: bool = True
    mode_without_backward: str = "step"


def device_peaks(device_name: str) -> tuple[float | None, float | None]:
    """``(peak GB/s, peak dense bf16 TFLOP/s)`` of a device from its CUDA name, ``(None, None)`` when unknown."""
    for key, bandwidth, tflops in DEVICE_PEAKS:
        if key in device_name:
            return bandwidth, tflops
    return None, None


def _liger():
    """Liger-Kernel's functional API, or None when it is not installed (or does not import)."""
    try:
        return importlib.import_module("liger_kernel.transformers.functional")
    except Exception:  # noqa: BLE001 - any import failure just means no Liger column
        return None


def _standard_impls(op: Callable, reference: Callable, args: tuple, kwargs: dict, inputs: list, extras: bool) -> dict:
    impls = {
        "colo-triton": Impl(lambda: op(*args, backend="triton", **kwargs), inputs),
        "torch": Impl(lambda: reference(*args, **kwargs), inputs),
    }
    if extras:
        compiled = torch.compile(reference)
        impls["torch.compile"] = Impl(lambda: compiled(*args, **kwargs), inputs)
    return impls


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_()


def _bench_copy(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    """``dst.copy_(src)`` of a large tensor: the bandwidth a memory-bound kernel can reach on this device, measured
    in the same run as the ops (the yardstick of the ``pct_of_copy`` column)."""
    numel = 1 << 12 if quick else 1 << 29  # 1 GiB of bf16
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    size = src.numel() * src.element_size()
    return OpBench(
        f"x=({numel},)",
        {"torch": Impl(lambda: dst.copy_(src))},
        bytes_forward=2 * size,
        has_backward=False,
        mode_without_backward="forward",
    )


def _bench_norm(name: str, quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    module = importlib.import_module(f"colo.kernels.{name}")
    tokens, hidden = (32, 100) if quick else (16384, 4096)
    x = _leaf(torch.randn(tokens, hidden, device=device, dtype=dtype))
    weight = _leaf(torch.rand(hidden, device=device, dtype=dtype) + 0.5)
    args: tuple = (x, weight) if name == "rms_norm" else (x, weight, _leaf(torch.randn_like(weight)))
    impls = _standard_impls(getattr(module, name), getattr(module, f"{name}_reference"), args, {}, list(args), extras)
    liger = _liger() if extras else None
    if liger is not None and name == "rms_norm":
        impls["liger"] = Impl(lambda: liger.liger_rms_norm(x, weight, 1e-6, in_place=False), list(args))
    elif liger is not None:
        impls["liger"] = Impl(lambda: liger.liger_layer_norm(*args, 1e-5), list(args))
    size = x.numel() * x.element_size()
    return OpBench(f"x=({tokens}, {hidden})", impls, bytes_forward=2 * size, bytes_forward_backward=5 * size)


def _bench_rotary(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    from colo.kernels.rotary import rotary, rotary_cos_sin, rotary_reference

    batch, seq, q_heads, kv_heads, head_dim = (1, 8, 4, 2, 32) if quick else (4, 4096, 32, 8, 128)
    q = _leaf(torch.randn(batch, seq, q_heads, head_dim, device=device, dtype=dtype))
    k = _leaf(torch.randn(batch, seq, kv_heads, head_dim, device=device, dtype=dtype))
    cos, sin = rotary_cos_sin(seq, head_dim, dtype=dtype, device=device)
    impls = _standard_impls(rotary, rotary_reference, (q, k, cos, sin), {}, [q, k], extras)
    liger = _liger() if extras else None
    if liger is not None:  # Liger takes (batch, heads, seq, head_dim)
        q_t, k_t = _leaf(q.transpose(1, 2).contiguous()), _leaf(k.transpose(1, 2).contiguous())
        impls["liger"] = Impl(
            lambda: tuple(t.transpose(1, 2) for t in liger.liger_rope(q_t, k_t, cos[None], sin[None])), [q_t, k_t]
        )
    size = (q.numel() + k.numel()) * q.element_size()
    shape = f"q=({batch}, {seq}, {q_heads}, {head_dim}), k=({batch}, {seq}, {kv_heads}, {head_dim})"
    return OpBench(shape, impls, bytes_forward=2 * size, bytes_forward_backward=4 * size)


def _bench_swiglu(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    from colo.kernels.swiglu import swiglu, swiglu_reference

    tokens, hidden = (32, 100) if quick else (8192, 14336)
    gate = _leaf(torch.randn(tokens, hidden, device=device, dtype=dtype))
    up = _leaf(torch.randn(tokens, hidden, device=device, dtype=dtype))
    impls = _standard_impls(swiglu, swiglu_reference, (gate, up), {}, [gate, up], extras)
    liger = _liger() if extras else None
    if liger is not None:
        impls["liger"] = Impl(lambda: liger.liger_swiglu(gate, up), [gate, up])
    size = gate.numel() * gate.element_size()
    return OpBench(f"gate=up=({tokens}, {hidden})", impls, bytes_forward=3 * size, bytes_forward_backward=8 * size)


def _bench_softmax(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    from colo.kernels.softmax import softmax, softmax_reference

    shape = (1, 2, 8, 24) if quick else (4, 32, 1024, 1024)
    x = _leaf(torch.randn(shape, device=device, dtype=dtype))
    kwargs = {"causal": True, "scale": 0.125}
    impls = _standard_impls(softmax, softmax_reference, (x,), kwargs, [x], extras)
    size = x.numel() * x.element_size()
    return OpBench(f"x={shape}, causal", impls, bytes_forward=2 * size, bytes_forward_backward=5 * size)


def _bench_cross_entropy(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    module = importlib.import_module("colo.kernels.cross_entropy")
    tokens, vocab = (16, 256) if quick else (8192, 128256)
    logits = _leaf(torch.randn(tokens, vocab, device=device, dtype=dtype))
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[::10] = -100
    impls = _standard_impls(
        module.cross_entropy, module.cross_entropy_reference, (logits, target), {}, [logits], extras
    )
    liger = _liger() if extras else None
    if liger is not None:
        impls["liger"] = Impl(lambda: liger.liger_cross_entropy(logits, target, ignore_index=-100), [logits])
    size = logits.numel() * logits.element_size()
    return OpBench(f"logits=({tokens}, {vocab})", impls, bytes_forward=size, bytes_forward_backward=2 * size)


def _bench_fused_linear_cross_entropy(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    module = importlib.import_module("colo.kernels.fused_linear_cross_entropy")
    tokens, hidden_size, vocab = (16, 32, 256) if quick else (8192, 4096, 128256)
    hidden = _leaf(torch.randn(tokens, hidden_size, device=device, dtype=dtype))
    weight = _leaf(torch.randn(vocab, hidden_size, device=device, dtype=dtype) / math.sqrt(hidden_size))
    target = torch.randint(0, vocab, (tokens,), device=device)
    args = (hidden, weight, target)
    impls = _standard_impls(
        module.fused_linear_cross_entropy, module.fused_linear_cross_entropy_reference, args, {}, [hidden, weight],
        extras,
    )  # fmt: skip
    liger = _liger() if extras else None
    if liger is not None:
        impls["liger"] = Impl(lambda: liger.liger_fused_linear_cross_entropy(hidden, weight, target), [hidden, weight])
    flops = 2.0 * tokens * hidden_size * vocab
    return OpBench(
        f"hidden=({tokens}, {hidden_size}), vocab={vocab}", impls, flops_forward=flops, flops_forward_backward=3 * flops
    )


ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384)
"""Sequence lengths of the attention sweep (head dim 128, 32 heads, batch * seq = 16k tokens), causal and not."""
ATTENTION_REFERENCE_MAX_SEQ = 4096
"""Longest sequence the dense torch reference (and its compiled form) runs at: it materializes the score matrix."""


def _bench_flash_attention(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> list[OpBench]:
    """One bench per (sequence length, causal): colo's kernel, the dense reference up to
    `ATTENTION_REFERENCE_MAX_SEQ`, and on CUDA ``scaled_dot_product_attention`` pinned to the flash backend."""
    module = importlib.import_module("colo.kernels.flash_attention")
    heads, head_dim = (2, 16) if quick else (32, 128)
    seqs = (16,) if quick else ATTENTION_SEQS
    benches = []
    for seq in seqs:
        for causal in (True, False):
            batch = 1 if quick else max(1, 16384 // seq)
            q, k, v = (_leaf(torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype)) for _ in range(3))
            kwargs = {"causal": causal}
            impls = {
                "colo-triton": Impl(
                    functools.partial(module.flash_attention, q, k, v, backend="triton", **kwargs), [q, k, v]
                )
            }
            if seq <= ATTENTION_REFERENCE_MAX_SEQ:
                impls.update(
                    _standard_impls(
                        module.flash_attention, module.flash_attention_reference, (q, k, v), kwargs, [q, k, v], extras
                    )
                )
            if extras:  # SDPA takes (batch, heads, seq, head_dim)
                q_t, k_t, v_t = (_leaf(t.transpose(1, 2).contiguous()) for t in (q, k, v))
                impls["sdpa-flash"] = Impl(functools.partial(_sdpa_flash, q_t, k_t, v_t, causal), [q_t, k_t, v_t])
            flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
            shape = f"q=k=v=({batch}, {seq}, {heads}, {head_dim}), {'causal' if causal else 'full'}"
            benches.append(OpBench(shape, impls, flops_forward=flops, flops_forward_backward=3.5 * flops))
    return benches


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """``scaled_dot_product_attention`` restricted to its flash backend (an error if it cannot run), as (b, s, h, d)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def _bench_adamw(quick: bool, device: torch.device, dtype: torch.dtype, extras: bool) -> OpBench:
    from colo.kernels.adamw import adamw_reference, fused_adamw

    shapes = [(37,), (64, 100), (100,), (3, 50)] if quick else [(4096, 4096)] * 32 + [(4096,)] * 32
    params = [torch.randn(s, device=device) for s in shapes]  # fp32 master weights
    grads = [torch.randn(s, device=device) for s in shapes]
    states = ([torch.zeros(s, device=device) for s in shapes], [torch.zeros(s, device=device) for s in shapes])
    hyper = {"step": 10, "lr": 1e-4, "weight_decay": 0.1}
    impls = {
        "colo-triton": Impl(lambda: fused_adamw(params, grads, *states, backend="triton", **hyper)),
        "torch": Impl(lambda: adamw_reference(params, grads, *states, **hyper)),
    }
    if extras:
        for flavour in ("foreach", "fused"):
            twins = [torch.nn.Parameter(p.clone()) for p in params]
            for twin, grad in zip(twins, grads):
                twin.grad = grad
            optimizer = torch.optim.AdamW(twins, lr=1e-4, weight_decay=0.1, **{flavour: True})
            impls[f"torch-{flavour}"] = Impl(optimizer.step)
    numel = sum(p.numel() for p in params)
    shape = f"{len(shapes)} fp32 tensors, {numel / 1e6:.1f}M params"
    # param read and written, grad read, both moments read and written: 7 fp32 accesses per element
    return OpBench(shape, impls, bytes_forward=7 * 4 * numel, has_backward=False)


_BUILDERS: dict[str, Callable[..., OpBench | list[OpBench]]] = {
    "copy": _bench_copy,
    "rms_norm": functools.partial(_bench_norm, "rms_norm"),
    "layer_norm": functools.partial(_bench_norm, "layer_norm"),
    "rotary": _bench_rotary,
    "swiglu": _bench_swiglu,
    "softmax": _bench_softmax,
    "cross_entropy": _bench_cross_entropy,
    "fused_linear_cross_entropy": _bench_fused_linear_cross_entropy,
    "flash_attention": _bench_flash_attention,
    "adamw": _bench_adamw,
}


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [t for t in output if isinstance(t, torch.Tensor)]


def _median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` in milliseconds: CUDA events on a GPU, ``perf_counter`` otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_time = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_time) * 1e3)
    return statistics.median(times)


def _peak_extra_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak memory one call of ``fn`` allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _run_op(name: str, bench: OpBench, device, warmup: int, repeats: int, peaks) -> list[dict]:
    bandwidth_peak, tflops_peak = peaks
    rows = []
    reference_output = None
    reference = bench.impls.get("torch") or bench.impls.get("sdpa-flash")
    if bench.has_backward and reference is not None:
        with torch.no_grad():
            reference_output = _tensors(reference.run())[0].float()
    modes = ("forward", "forward+backward") if bench.has_backward else (bench.mode_without_backward,)
    for impl_name, impl in bench.impls.items():
        for mode in modes:
            row: dict[str, Any] = {"op": name, "impl": impl_name, "mode": mode, "shape": bench.shape}
            try:
                if mode == "forward+backward":
                    outputs = _tensors(impl.run())
                    upstream = [torch.randn_like(t) for t in outputs]

                    def fn(impl=impl, upstream=upstream):
                        torch.autograd.grad(_tensors(impl.run()), impl.inputs, upstream)

                else:
                    fn = impl.run
                if mode == "forward":
                    with torch.no_grad():
                        output = _tensors(impl.run())[0].float()
                    if reference_output is not None and output.shape == reference_output.shape:
                        row["max_abs_diff_vs_torch"] = (output - reference_output).abs().max().item()
                row["median_ms"] = _median_ms(fn, device, warmup, repeats)
                row["peak_memory_mib"] = _peak_extra_mib(fn, device)
            except Exception as error:  # noqa: BLE001 - one failing implementation must not end the run
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
                rows.append(row)
                continue
            seconds = row["median_ms"] / 1e3
            moved = bench.bytes_forward_backward if mode == "forward+backward" else bench.bytes_forward
            if moved is not None:
                row["gb_per_s"] = moved / seconds / 1e9
                row["bandwidth_pct"] = 100 * row["gb_per_s"] / bandwidth_peak if bandwidth_peak else None
            flops = bench.flops_forward_backward if mode == "forward+backward" else bench.flops_forward
            if flops is not None:
                row["tflops"] = flops / seconds / 1e12
                row["tflops_pct"] = 100 * row["tflops"] / tflops_peak if tflops_peak else None
            rows.append(row)
    return rows


def _format_table(rows: list[dict]) -> str:
    columns = [
        ("op", "op", "{}"),
        ("impl", "impl", "{}"),
        ("mode", "mode", "{}"),
        ("shape", "shape", "{}"),
        ("median_ms", "ms", "{:.3f}"),
        ("gb_per_s", "GB/s", "{:.1f}"),
        ("bandwidth_pct", "%BW", "{:.0f}"),
        ("tflops", "TFLOP/s", "{:.1f}"),
        ("peak_memory_mib", "peak MiB", "{:.0f}"),
        ("pct_of_copy", "%copy", "{:.0f}"),
        ("vs_compile", "x compile", "{:.2f}"),
        ("max_abs_diff_vs_torch", "max|diff|", "{:.2e}"),
    ]
    table = [[title for _, title, _ in columns]]
    for row in rows:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "" for key, _, fmt in columns]
        if "error" in row:
            cells[4] = row["error"]
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(columns) - 1)] + [0]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table)


def run(
    *,
    device: str | None = None,
    ops: list[str] | None = None,
    quick: bool = False,
    dtype: str | None = None,
    warmup: int | None = None,
    repeats: int | None = None,
) -> dict:
    """Benchmark the given ops and return the report (what ``--json`` writes).

    Args:
        device (str | None): ``"cuda"`` or ``"cpu"``. Default: ``None`` (CUDA when available).
        ops (list[str] | None): op names from `OPS`. Default: ``None`` (all).
        quick (bool): tiny shapes and few repetitions. Default: ``False``.
        dtype (str | None): ``"bfloat16"``, ``"float16"`` or ``"float32"``. Default: ``None`` (bf16 on CUDA, fp32 on
            CPU, where the interpreter's bf16 arithmetic is unreliable).
        warmup (int | None): untimed calls first. Default: ``None`` (1 quick, 5 otherwise).
        repeats (int | None): timed calls. Default: ``None`` (3 quick, 20 otherwise).

    Returns:
        dict: ``device``, versions, peaks, ``rows`` (one per op, implementation and mode) and ``skipped`` ops.
    """
    torch_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    unknown = sorted(set(ops or ()) - set(OPS))
    if unknown:
        raise ValueError(f"unknown ops {unknown}; choose from {', '.join(OPS)}")
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if torch_device.type == "cuda" else torch.float32)
    warmup = warmup if warmup is not None else (1 if quick else 5)
    repeats = repeats if repeats is not None else (3 if quick else 20)
    extras = torch_device.type == "cuda"  # torch.compile, SDPA, Liger, torch's foreach/fused AdamW
    device_name = torch.cuda.get_device_name(torch_device) if torch_device.type == "cuda" else "cpu"
    peaks = device_peaks(device_name)
    try:
        triton_version = importlib.import_module("triton").__version__
    except ImportError:
        triton_version = None
    report: dict[str, Any] = {
        "device": device_name,
        "device_type": torch_device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "liger_kernel": _liger() is not None,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "quick": quick,
        "warmup": warmup,
        "repeats": repeats,
        "peak_bandwidth_gb_per_s": peaks[0],
        "peak_bf16_tflops": peaks[1],
        "rows": [],
        "skipped": {},
    }
    for name in ops or OPS:
        torch.manual_seed(0)
        try:
            built = _BUILDERS[name](quick, torch_device, torch_dtype, extras)
        except (ImportError, AttributeError) as error:  # an op another change has not landed yet
            report["skipped"][name] = f"not importable: {error}"
            continue
        for bench in built if isinstance(built, list) else [built]:
            report["rows"].extend(_run_op(name, bench, torch_device, warmup, repeats, peaks))
        del built, bench
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()
    report["goals"] = goals(report["rows"])
    return report


MEMORY_BOUND_OPS = ("rms_norm", "layer_norm", "rotary", "swiglu", "softmax", "cross_entropy", "adamw")


def goals(rows: list[dict]) -> dict:
    """The issue's targets read off the rows (reported, not enforced), and ``pct_of_copy`` / ``vs_compile`` added to
    the rows they concern:

    - memory-bound ops: colo-triton's GB/s as a percentage of ``copy`` in the same run (target >= 85) and its speed
      relative to ``torch.compile`` of the reference (time ratio, target >= 1.0);
    - attention: colo-triton's forward+backward speed relative to SDPA's flash backend per shape (target >= 0.9);
    - fused linear cross-entropy: colo-triton's peak memory over the naive (torch) version (target <= 0.25).
    """
    by_key = {(row["op"], row["shape"], row["impl"], row["mode"]): row for row in rows if "error" not in row}
    copy = next((row["gb_per_s"] for row in rows if row["op"] == "copy" and "gb_per_s" in row), None)
    result: dict[str, list[dict]] = {"memory_bound": [], "attention": [], "fused_linear_cross_entropy": []}
    for (op, shape, impl, mode), row in by_key.items():
        if impl != "colo-triton":
            continue
        if op in MEMORY_BOUND_OPS and row.get("gb_per_s") is not None:
            compiled = by_key.get((op, shape, "torch.compile", mode))
            row["pct_of_copy"] = 100 * row["gb_per_s"] / copy if copy else None
            row["vs_compile"] = compiled["median_ms"] / row["median_ms"] if compiled else None
            result["memory_bound"].append(
                {"op": op, "mode": mode, "pct_of_copy": row["pct_of_copy"], "vs_compile": row["vs_compile"]}
            )
        elif op == "flash_attention":
            sdpa = by_key.get((op, shape, "sdpa-flash", mode))
            if sdpa is not None:
                result["attention"].append(
                    {"shape": shape, "mode": mode, "vs_sdpa_flash": sdpa["median_ms"] / row["median_ms"]}
                )
        elif op == "fused_linear_cross_entropy" and mode == "forward+backward":
            naive = by_key.get((op, shape, "torch", mode))
            if naive is not None and naive.get("peak_memory_mib") and row.get("peak_memory_mib") is not None:
                result["fused_linear_cross_entropy"].append(
                    {"shape": shape, "peak_memory_vs_naive": row["peak_memory_mib"] / naive["peak_memory_mib"]}
                )
    return result


def _relaunch_in_interpreter_on_cpu(device: str | None) -> None:
    """Replace this process with the same command under ``TRITON_INTERPRET=1`` when it benchmarks on CPU and the
    variable is unset: the kernels were decorated when ``colo.kernels`` was imported, before this module ran, so
    setting the variable now would be too late (every Triton row would fail with "0 active drivers")."""
    on_cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
    if not on_cpu or "TRITON_INTERPRET" in os.environ or not triton_available():
        return
    print("colo.kernels.bench: on CPU: re-running with TRITON_INTERPRET=1 (Triton's interpreter)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, dict(os.environ, TRITON_INTERPRET="1"))


def main(argv: list[str] | None = None, *, relaunch: bool = False) -> int:
    """Command-line entry point: run the benchmark, print a table, optionally write the JSON report.

    Args:
        argv: the command-line arguments. Default: ``None`` (``sys.argv[1:]``).
        relaunch: on CPU with ``TRITON_INTERPRET`` unset, re-run the command in a process that has it (what
            ``python -m colo.kernels.bench`` does); in-process callers set the variable before importing
            ``colo.kernels`` instead, or the Triton rows report that it is missing. Default: ``False``.
    """
    parser = argparse.ArgumentParser(prog="python -m colo.kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--ops", default=None, help=f"comma-separated subset of: {','.join(OPS)}")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report to this file")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    if relaunch:
        _relaunch_in_interpreter_on_cpu(args.device)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()] if args.ops else None
    try:
        report = run(
            device=args.device, ops=ops, quick=args.quick, dtype=args.dtype, warmup=args.warmup, repeats=args.repeats
        )
    except ValueError as error:
        parser.error(str(error))
    print(
        f"device: {report['device']}  torch {report['torch']}  triton {report['triton']}  dtype {report['dtype']}  "
        f"peak {report['peak_bandwidth_gb_per_s'] or 'unknown'} GB/s"
    )
    print(_format_table(report["rows"]))
    for name, reason in report["skipped"].items():
        print(f"skipped {name}: {reason}")
    for entry in report["goals"]["attention"] + report["goals"]["fused_linear_cross_entropy"]:
        print(
            "goal:",
            ", ".join(
                f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}" for key, value in entry.items()
            ),
        )
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump(report, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(relaunch=True))
