#!/usr/bin/env python3
"""Packed SFT (``data.packing: documents``) against one conversation per padded row, on 2 CPU processes.

The same SFT conversations (synthetic chat records with a long-tailed length distribution, rendered by colo's
`ChatTemplate` with the byte tokenizer, ``seq_len`` 512) are trained once as one conversation per row, right-padded
to ``seq_len``, and once bin-packed several per row (`SFTDataset(..., packing="documents")`, ``position_ids``
restarting per conversation, attention masked per conversation). Both runs see every conversation of the set once,
in batches of ``--rows`` rows per rank, so the packed run takes fewer steps; what counts is real (non-padding)
tokens per second over both ranks: ``real tokens of the set / the slowest rank's wall time``.

Model: colo's ``tiny-llama`` preset (hidden 256, 4 layers, 8 heads, 4 kv heads; vocab 4096) in fp32,
``torch.optim.AdamW(lr=3e-4, fused=True)``, gloo on loopback, one thread per rank. Rows (``--impls``), each in
fresh processes, interleaved over ``--repeats`` (medians reported):

- ``colo_padded`` / ``colo_packed``: ``Booster(DDP(loss_weighting="token"))`` (the SFT default of run configs),
  ``booster.train_step(batch)``;
- ``hf_padded`` / ``hf_packed``: the peer a user would otherwise pick: a transformers ``LlamaForCausalLM`` of the
  same shape under torch DDP, the plain loop; its packed rows carry ``position_ids`` and run with
  ``use_cache=False``, so transformers 5 masks the conversations (its ``DataCollatorWithFlattening`` route, with
  fixed-size rows). Its loss is the per-rank mean (not token-weighted): only its throughput is compared.

Run::

    python benchmarks/packed_sft.py [--conversations 48] [--rows 4] [--repeats 2]

Writes ``benchmarks/results/packed_sft_cpu.json`` (``--out``).
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

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LEN, LR, NUM_RANKS = 512, 3e-4, 2
RANK_ENV = {"OMP_NUM_THREADS": "1", "LOCAL_SIZE": str(NUM_RANKS)}
IMPLS = {
    "colo_padded": "colo Booster(DDP), one conversation per padded row",
    "colo_packed": "colo Booster(DDP), packing: documents",
    "hf_padded": "transformers + torch DDP, one conversation per padded row",
    "hf_packed": "transformers + torch DDP, packed rows with position_ids",
}


def conversations(num: int, rank: int, seed: int) -> list[dict]:
    """``num`` prompt/response records for ``rank``: lengths long-tailed (most short, a few near ``SEQ_LEN``)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    words = ["alpha", "beta", "gamma", "delta", "loss", "token", "row", "rank", "mask", "tensor", "shard", "step"]

    def text(mean_words: float) -> str:
        count = 1 + int(torch.empty(()).exponential_(1.0 / mean_words, generator=generator))
        count = min(count, 60)
        picks = torch.randint(0, len(words), (count,), generator=generator)
        return " ".join(words[i] for i in picks.tolist())

    return [{"prompt": text(14), "response": text(10)} for _ in range(num)]


def dataset(num: int, rank: int, seed: int, packing: str):
    from colo.apps.data import ByteTokenizer, SFTDataset

    return SFTDataset(conversations(num, rank, seed), ByteTokenizer(), seq_len=SEQ_LEN, packing=packing)


def _colo_model():
    from colo.apps import Llama, get_preset

    torch.manual_seed(0)
    model = Llama(get_preset("tiny-llama", max_position_embeddings=SEQ_LEN))
    model.init_weights(0)
    return model


def _hf_model():
    import transformers

    from colo.apps import get_preset

    preset = get_preset("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _setup(impl: str):
    """``step(batch) -> loss`` for ``impl``."""
    if impl.startswith("colo"):
        from colo.apps import DDP, Booster

        model = _colo_model()
        booster = Booster(DDP(loss_weighting="token"))
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True))
        return lambda batch: booster.train_step(batch).loss
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_hf_model(), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step(batch):
        if "position_ids" in batch:
            batch = {**batch, "use_cache": False}  # transformers 5 masks packed rows only without a KV cache
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.item()

    return step


def run_row(impl: str, num_conversations: int, rows: int, seed: int) -> dict:
    """One rank of one row: one warm-up step on other data, then every conversation of this rank's set once."""
    import resource

    import torch.distributed as dist

    from colo.apps.data import collate

    torch.set_num_threads(1)
    rank = dist.get_rank()
    packing = "documents" if impl.endswith("packed") else "none"
    data = dataset(num_conversations, rank, seed, packing)
    warmup = dataset(rows * 3, rank, seed + 1, packing)
    step = _setup(impl)
    step(collate([warmup[i] for i in range(min(rows, len(warmup)))]))
    batches = [collate([data[i] for i in range(s, min(s + rows, len(data)))]) for s in range(0, len(data), rows)]
    # every rank must run the same number of steps (DDP): pad the shorter schedule with nothing; equal here when
    # both ranks' sets pack into the same number of batches, checked by the driver
    dist.barrier()
    start = time.perf_counter()
    losses = [float(step(batch)) for batch in batches]
    elapsed = time.perf_counter() - start
    return {
        "rank": rank,
        "elapsed_s": elapsed,
        "steps": len(batches),
        "rows": len(data),
        "real_tokens": int(data.row_lengths.sum()),
        "slots": len(data) * SEQ_LEN,
        "losses": losses,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _steps_per_rank(num_conversations: int, rows: int, seed: int, packing: str) -> list[int]:
    return [-(-len(dataset(num_conversations, rank, seed, packing)) // rows) for rank in range(NUM_RANKS)]


def measure(impl: str, args) -> dict:
    from colo.comm import RankFailure, RankTimeout, launch

    try:
        per_rank = launch(
            run_row, NUM_RANKS, impl, args.conversations, args.rows, args.seed,
            backend="gloo", threads=1, env=RANK_ENV, timeout=args.row_timeout,
        )  # fmt: skip
    except (RankFailure, RankTimeout) as error:
        return {"impl": impl, "error": str(error)}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    real, slots = sum(r["real_tokens"] for r in per_rank), sum(r["slots"] for r in per_rank)
    return {
        "impl": impl,
        "tokens_per_s": real / elapsed,
        "slots_per_s": slots / elapsed,
        "elapsed_s": elapsed,
        "steps": per_rank[0]["steps"],
        "rows_per_rank": [r["rows"] for r in per_rank],
        "real_tokens": real,
        "slot_fill": real / slots,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "first_losses": [r["losses"][:3] for r in per_rank],
        "load_average": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--conversations", type=int, default=48, help="conversations per rank")
    parser.add_argument("--rows", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=str(RESULTS / "packed_sft_cpu.json"))
    args = parser.parse_args()
    for packing in ("none", "documents"):
        steps = _steps_per_rank(args.conversations, args.rows, args.seed, packing)
        if len(set(steps)) != 1:
            parser.error(f"the ranks' {packing} sets take {steps} steps; pick another --conversations or --seed")
    runs = []
    for repeat in range(args.repeats):
        order = list(args.impls)
        order = order[repeat % len(order) :] + order[: repeat % len(order)]  # rotate: no row always goes first
        for impl in order:
            result = measure(impl, args)
            runs.append(result)
            shown = f"{result['tokens_per_s']:.0f} real tokens/s" if "error" not in result else "failed"
            print(f"repeat {repeat} {impl}: {shown}", flush=True)
    summary = {}
    for impl in args.impls:
        ok = [r for r in runs if r["impl"] == impl and "error" not in r]
        if not ok:
            summary[impl] = {"error": next(r["error"] for r in runs if r["impl"] == impl)}
            continue
        summary[impl] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
            "tokens_per_s_repeats": [r["tokens_per_s"] for r in ok],
            "steps": ok[0]["steps"],
            "slot_fill": ok[0]["slot_fill"],
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ok),
        }
    ratios = {}
    for prefix in ("colo", "hf"):
        packed, padded = summary.get(f"{prefix}_packed", {}), summary.get(f"{prefix}_padded", {})
        if "tokens_per_s" in packed and "tokens_per_s" in padded:
            ratios[f"{prefix}_packed / {prefix}_padded"] = packed["tokens_per_s"] / padded["tokens_per_s"]
    if "tokens_per_s" in summary.get("colo_packed", {}) and "tokens_per_s" in summary.get("hf_packed", {}):
        ratios["colo_packed / hf_packed"] = (
            summary["colo_packed"]["tokens_per_s"] / summary["hf_packed"]["tokens_per_s"]
        )
    print("\n| row (2 processes) | real tokens/s (median) | steps | slots holding tokens | peak RSS (MB) |")
    print("|---|---|---|---|---|")
    for impl, row in summary.items():
        if "error" in row:
            print(f"| {IMPLS[impl]} | failed | | | |")
            continue
        print(
            f"| {IMPLS[impl]} | {row['tokens_per_s']:.0f} | {row['steps']} | {row['slot_fill']:.0%} | "
            f"{row['peak_rss_mb']:.0f} |"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    record = {
        "benchmark": "packed_sft",
        "device": "cpu",
        "config": {**vars(args), "seq_len": SEQ_LEN, "lr": LR, "num_ranks": NUM_RANKS, "model": "tiny-llama"},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }
    try:
        record["versions"]["transformers"] = __import__("transformers").__version__
    except ImportError:
        record["versions"]["transformers"] = None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
