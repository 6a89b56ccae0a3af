#!/usr/bin/env python3
"""Greedy generation with weight-only quantized Llamas (colo.apps.quant) against the float model, on CPU.

Rows (compute dtype, format, `QuantizedLinear` backend):

- ``fp32``: the float model; ``int8`` / ``int4-g32`` / ``int4-g128``: fp32 activations, the ``reference`` backend
  (the weight dequantized on the fly for every matmul); ``int8-torchao``: torchao's ``Int8Tensor`` over the same
  codes (only when torchao, the ``quant`` extra, is installed);
- ``bf16``: the float model in bf16; ``int8-aten-bf16`` / ``int4-g32-aten-bf16``: bf16 activations through torch's
  packed weight-only matmuls (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``).

Models: ``bench-25m`` (BENCHMARKS.md's 25.8M-parameter shape, weights from ``init_weights(seed)``) and, with
``--checkpoint``, a trained trainer checkpoint (e.g. the tiny-llama demo's), for which the held-out perplexity of
each row on the run's own eval split is reported too. Each row generates ``--new-tokens`` (64) greedy tokens after
a random ``--prompt-len`` (64) token prompt, batch 1, through `colo.apps.generation.generate` (static KV cache);
one untimed warm-up, then ``--repeats`` timed runs with the row order rotated per repeat; one thread.

Reported per row: tokens/s (median over repeats; prefill included), the bytes of the model's stored tensors
(parameters and buffers), the bytes of its linear weights as stored and the ratio to the same weights in bf16,
the fraction of generated tokens equal to the fp32 row's, and the held-out perplexity (``--checkpoint`` only).

Run::

    OMP_NUM_THREADS=1 python benchmarks/quantized_generate.py [--checkpoint runs/tiny-llama/checkpoints/step-00000300]
        [--keep-float down_proj] [--label NAME]

(the tiny-llama preset's MLP width 688 is divisible by no int4 group size: train it with
``--set model.intermediate_size=768``, or pass ``--keep-float down_proj``.)

Writes ``benchmarks/results/quantized_generate_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_dp import RESULTS  # noqa: E402

from colo.apps.generation import SamplingParams, generate  # noqa: E402
from colo.apps.models.llama import Llama, get_preset  # noqa: E402
from colo.apps.quant import QuantizedLinear, quantize_model, storage_report  # noqa: E402

ROWS = {
    "fp32": (torch.float32, None, None, None),
    "int8": (torch.float32, "int8", None, "reference"),
    "int8-torchao": (torch.float32, "int8", None, "torchao"),
    "int4-g32": (torch.float32, "int4", 32, "reference"),
    "int4-g128": (torch.float32, "int4", 128, "reference"),
    "bf16": (torch.bfloat16, None, None, None),
    "int8-aten-bf16": (torch.bfloat16, "int8", None, "aten"),
    "int4-g32-aten-bf16": (torch.bfloat16, "int4", 32, "aten"),
}
"""Row -> (compute dtype, mode, int4 group size, backend). ``int4-g128`` is skipped for models whose linear
inputs 128 does not divide (bench-25m's 1376-wide MLP)."""


def has_torchao() -> bool:
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        return False
    return True


def base_model(name: str, checkpoint: str | None, seed: int) -> tuple[Llama, dict | None]:
    if checkpoint is not None:
        from colo.apps.runs import load_llama

        return load_llama(checkpoint)
    model = Llama(get_preset(name))
    model.init_weights(seed)
    return model.eval(), None


def build_row(base: Llama, row: str, keep_float: tuple[str, ...] = ()) -> Llama:
    dtype, mode, group_size, backend = ROWS[row]
    model = Llama(base.config)
    model.load_state_dict(base.state_dict())
    model = model.to(dtype).eval()
    if mode is not None:
        quantize_model(model, mode, group_size=group_size, backend=backend, skip=("lm_head", *keep_float))
    return model


def fits(base: Llama, row: str, keep_float: tuple[str, ...] = ()) -> bool:
    group_size = ROWS[row][2]
    config = base.config
    widths = [config.hidden_size] + ([] if "down_proj" in keep_float else [config.intermediate_size])
    return group_size is None or not any(width % group_size for width in widths)


def stored_bytes(model: Llama) -> int:
    """Bytes of the state dict's tensors (a tied weight once; the rotary tables, not saved, left out)."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def linear_bytes(model: Llama) -> tuple[int, int]:
    """(stored bytes of the decoder linear weights, the same weights in bf16)."""
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        report = storage_report(model)
        return report["quantized_bytes"], report["bf16_bytes"]
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    return sum(m.weight.numel() * m.weight.element_size() for m in linears), sum(2 * m.weight.numel() for m in linears)


def held_out_perplexity(model: Llama, run: dict) -> float:
    from colo.apps.data import collate, load_tokenizer
    from colo.apps.train.config import RunConfig
    from colo.apps.train.data_setup import build_data

    config = RunConfig.model_validate(run["config"])
    data = build_data(config, load_tokenizer(config.data.tokenizer), num_replicas=1, rank=0)
    losses = []
    with torch.no_grad():
        for first in range(0, len(data.eval), config.eval.batch_size):
            batch = collate([data.eval[i] for i in range(first, min(first + config.eval.batch_size, len(data.eval)))])
            losses.append(model(batch["input_ids"], labels=batch["labels"]).loss.double().item())
    return math.exp(statistics.fmean(losses))


def time_generate(model: Llama, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    rollout = generate(model, [prompt], params)
    seconds = time.perf_counter() - start
    return new_tokens / seconds, rollout.response_ids[0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-25m")
    parser.add_argument("--checkpoint", default=None, help="a trainer checkpoint instead of --model")
    parser.add_argument("--rows", nargs="+", default=list(ROWS))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-float", nargs="*", default=[], help="linear layers left in float (e.g. down_proj)")
    parser.add_argument("--label", default=None, help="key of this run in the JSON (default: --model or 'checkpoint')")
    parser.add_argument("--out", default=str(RESULTS / "quantized_generate_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [r for r in args.rows if r != "int8-torchao" or has_torchao()]
    base, run = base_model(args.model, args.checkpoint, args.seed)
    keep_float = tuple(args.keep_float)
    rows = [row for row in rows if fits(base, row, keep_float)]
    models = {row: build_row(base, row, keep_float) for row in rows}
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, base.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    speeds: dict[str, list[float]] = {row: [] for row in rows}
    tokens: dict[str, list[int]] = {}
    for row in rows:  # warm-up
        time_generate(models[row], prompt, 4)
    for repeat in range(args.repeats):
        order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
        for row in order:
            speed, generated = time_generate(models[row], prompt, args.new_tokens)
            speeds[row].append(speed)
            tokens[row] = generated
    results = []
    for row in rows:
        quantized, bf16 = linear_bytes(models[row])
        entry = {
            "row": row,
            "dtype": str(ROWS[row][0]).removeprefix("torch."),
            "mode": ROWS[row][1] or "float",
            "group_size": ROWS[row][2],
            "backend": ROWS[row][3],
            "tokens_per_s": statistics.median(speeds[row]),
            "tokens_per_s_all": speeds[row],
            "model_bytes": stored_bytes(models[row]),
            "linear_bytes": quantized,
            "linear_ratio_vs_bf16": quantized / bf16,
            "tokens_equal_to_fp32": sum(a == b for a, b in zip(tokens[row], tokens["fp32"])) / args.new_tokens
            if "fp32" in tokens
            else None,
        }
        if run is not None:
            entry["held_out_perplexity"] = held_out_perplexity(models[row], run)
        results.append(entry)
        print(
            f"{row:>20}: {entry['tokens_per_s']:8.1f} tok/s  model {entry['model_bytes'] / 2**20:7.2f} MiB  "
            f"linear x{entry['linear_ratio_vs_bf16']:.3f} of bf16  same tokens as fp32 {entry['tokens_equal_to_fp32']}"
            + (f"  ppl {entry['held_out_perplexity']:.4f}" if run is not None else "")
        )
    if run is not None and "fp32" in rows:
        base_ppl = next(e["held_out_perplexity"] for e in results if e["row"] == "fp32")
        for entry in results:
            entry["perplexity_change_vs_fp32"] = entry["held_out_perplexity"] / base_ppl - 1
    payload = {
        "benchmark": "quantized_generate",
        "model": args.checkpoint or args.model,
        "config": vars(args),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "rows": results,
    }
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    runs = previous.get("runs", {}) if isinstance(previous, dict) else {}
    runs[args.label or (args.checkpoint and "checkpoint") or args.model] = payload
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "quantized_generate", "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
