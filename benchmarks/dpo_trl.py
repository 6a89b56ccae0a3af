#!/usr/bin/env python3
"""DPO training throughput and peak memory on CPU: colo (single, DDP, ZeRO-2) against TRL's ``DPOTrainer``.

Issue 21. The same work on both sides: a Hugging Face ``LlamaForCausalLM`` built from a config (hidden 256,
intermediate 688, 4 layers, 4 heads, 2 kv heads, a character-level vocabulary of printable ASCII: ~3.2M parameters),
fp32, the same initial weights; the same synthetic preference pairs (`colo.apps.rlhf.python_line_records`: a line of
the standard library's source against the same words shuffled, after the line before it; ~25-token prompts,
responses up to ~40 tokens + eos) through the same character-level Hugging Face tokenizer (written at run time, no
download, no bos); ``--pairs`` pairs per rank per step; sigmoid loss (DPO), beta 0.1; the Trainer's AdamW groups
(weight decay 0.01 on matrices), ``torch.optim.AdamW(fused=True)``, constant LR, gradient clipping at 1.0; gloo on
loopback, one thread per rank (``OMP_NUM_THREADS=1``). ``--warmup`` steps, then ``--steps`` timed ones.

Rows (``--impls``), each in fresh processes (so the peak RSS is its own), interleaved over ``--repeats`` with the
order rotating each repeat, medians reported:

- ``colo_single`` / ``colo_ddp`` / ``colo_zero2``: ``Booster(DDP(max_grad_norm=1.0))`` on 1 and 2 processes,
  ``Booster(Zero(stage=2, max_grad_norm=1.0))`` on 2; the model's forward replaced by
  `attach_pair_forward(head="logps")` (chosen and rejected rows in one forward, cut to the longest row of the
  batch), `PreferenceCriterion("sigmoid", beta=0.1)`, ``booster.train_step(collate(items))``. The reference
  log-probs are **precomputed once** before training with `precompute_reference_logps` (forwards of the initial
  policy over every pair the run trains on, shared between the ranks), timed separately: steps/s is reported both
  without it and with it amortized over the run's steps (``step time + precompute / (warmup + steps)``: the
  precompute covers exactly the pairs of those steps, as it covers one epoch in a real run).
- ``trl_single_precompute``: ``trl_single`` with ``precompute_ref_log_probs=True`` (the like-for-like row: TRL's
  reference pass over the dataset, run in ``DPOTrainer.__init__``, timed around its ``_precompute_ref_logps``) and
  amortized the same way as colo's.
- ``trl_single`` / ``trl_ddp``: ``trl.DPOTrainer`` with TRL's defaults for what a user passes here:
  ``precompute_ref_log_probs=False`` (TRL's default: the reference model runs forward on every step) and
  ``ref_model=`` a copy of the initial model (with a model built in memory there is no checkpoint path from which
  TRL could load its own copy). Settings as in ``packages/colo-apps/tests/test_rlhf_trl.py``: ``use_cpu=True``,
  ``bf16=False`` (TRL's default is bf16 autocast; this compares fp32), ``optim="adamw_torch_fused"``, weight decay
  0.01, ``max_grad_norm=1.0``, constant LR, ``report_to=[]``, no saving, logging at the default interval (no log
  step inside the run), ``disable_tqdm=True``. ``trl_ddp`` runs 2 processes through accelerate's ``MULTI_CPU``
  mode (gloo), started with the environment torchrun would give them. Timed with a `TrainerCallback` from the end
  of the last warm-up step to the end of the last step.

Reported: steps/s and pairs/s (over all ranks, the slowest rank's wall time), steps/s from the slowest rank's
median timed step (robust to a neighbour's bursts on a shared machine), peak RSS (``ru_maxrss``, max over
ranks; it includes each side's imports: TRL pulls in ``datasets`` and ``accelerate`` besides ``transformers``),
the first losses (both sides start at ln 2 = 0.6931: the policy equals its reference), and the load average.
What differs: TRL's sampler shuffles the pairs (colo takes them in order, rank ``r`` every other one), so the
batches are the same size but not the same pairs; TRL pads each batch to its longest row, colo's pair forward does
the same. No assertion on timings anywhere.

Run::

    python benchmarks/dpo_trl.py [--pairs 8] [--warmup 2] [--steps 8] [--repeats 2]

Writes ``benchmarks/results/dpo_trl_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _peer_processes import peak_rss_mb, run_rank_processes

RESULTS = Path(__file__).resolve().parent / "results"
LR, BETA, EPS, MAX_GRAD_NORM, WEIGHT_DECAY = 1e-4, 0.1, 1e-8, 1.0, 0.01
SEQ_LEN = 80  # longest prompt (25) + longest response (40) + eos, with room: no truncation on either side
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
MODEL_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
IMPLS = {
    "colo_single": ("colo Booster(DDP), 1 process", 1),
    "trl_single": ("TRL DPOTrainer, 1 process", 1),
    "trl_single_precompute": ("TRL DPOTrainer, precompute_ref_log_probs=True, 1 process", 1),
    "colo_ddp": ("colo Booster(DDP), 2 processes", 2),
    "colo_zero2": ("colo Booster(Zero(stage=2)), 2 processes", 2),
    "trl_ddp": ("TRL DPOTrainer + accelerate (MULTI_CPU, gloo), 2 processes", 2),
}
RANK_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


# --- shared by both sides ------------------------------------------------------------------------------------------


def write_tokenizer(directory: str) -> None:
    """A character-level Hugging Face tokenizer of printable ASCII (no download): <pad> 0, <eos> 1, <unk> 2, no bos."""
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)


def vocab_size() -> int:
    return 3 + len(CHARS)


def make_model(seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size(), pad_token_id=0, eos_token_id=1, bos_token_id=None, **MODEL_CONFIG
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).float()


def records(args, world: int) -> list[dict]:
    from colo.apps.rlhf import python_line_records

    return python_line_records((args.warmup + args.steps) * args.pairs * world, seed=args.seed)


def optimizer_groups(model) -> list[dict]:
    """The Trainer's AdamW groups for a Llama: weight decay on matrices, none on the norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


# --- colo: one rank, under colo.comm.launch ------------------------------------------------------------------------


def colo_rank(impl: str, args, tokenizer_dir: str) -> dict:
    import torch.distributed as dist

    from colo.apps import DDP, Booster, Zero
    from colo.apps.data import collate, load_tokenizer
    from colo.apps.rlhf import (
        PreferenceCriterion,
        PreferenceDataset,
        WithReferenceLogps,
        attach_pair_forward,
        precompute_reference_logps,
    )

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = load_tokenizer(tokenizer_dir)
    dataset = PreferenceDataset(records(args, world), tokenizer, seq_len=SEQ_LEN, add_bos=False)
    assert dataset.num_prompts_truncated == 0 and dataset.num_responses_truncated == 0
    model = make_model(args.seed)
    attach_pair_forward(model, head="logps", pad_id=tokenizer.pad_id)
    optimizer = torch.optim.AdamW(optimizer_groups(model), lr=LR, eps=EPS, fused=True)
    plugin = Zero(stage=2, max_grad_norm=MAX_GRAD_NORM) if impl == "colo_zero2" else DDP(max_grad_norm=MAX_GRAD_NORM)
    booster = Booster(plugin)
    booster.boost(model, optimizer, criterion=PreferenceCriterion("sigmoid", beta=BETA))

    dist.barrier()
    start = time.perf_counter()
    table = precompute_reference_logps(
        booster.engine.forward, dataset, batch_size=args.pairs, num_replicas=world, rank=rank
    )
    precompute_s = time.perf_counter() - start
    dataset = WithReferenceLogps(dataset, table)

    mine = list(range(rank, len(dataset), world))  # rank r trains on every world-th pair, in order
    step_times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        begin = time.perf_counter()
        batch = collate([dataset[i] for i in mine[step * args.pairs : (step + 1) * args.pairs]])
        losses.append(float(booster.train_step(batch).loss))
        step_times.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - start
    return {
        "rank": rank,
        "elapsed_s": elapsed,
        "precompute_s": precompute_s,
        "step_times_s": step_times,
        "losses": losses,
        "peak_rss_mb": peak_rss_mb(),
    }


def measure_colo(impl: str, args, tokenizer_dir: str) -> list[dict]:
    from colo.comm import launch

    return launch(
        colo_rank, IMPLS[impl][1], impl, args, tokenizer_dir,
        backend="gloo", threads=1, env=RANK_ENV, timeout=args.row_timeout,
    )  # fmt: skip


# --- TRL: one rank, a fresh interpreter running this file with --trl-worker -------------------------------------


def trl_rank(args) -> dict:
    """One process of a TRL row; accelerate reads the torchrun-style environment the driver set (WORLD_SIZE...)."""
    import datasets
    import transformers
    import trl

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir)
    model = make_model(args.seed)
    ref_model = copy.deepcopy(model)
    config = trl.DPOConfig(
        output_dir=args.trl_output_dir,
        per_device_train_batch_size=args.pairs,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.warmup + args.steps,
        weight_decay=WEIGHT_DECAY,
        adam_epsilon=EPS,
        max_grad_norm=MAX_GRAD_NORM,
        optim="adamw_torch_fused",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; the comparison is in fp32
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        max_length=128,
        loss_type=["sigmoid"],
        beta=BETA,
        # TRL's default False: the reference model runs forward every step; True (the trl_*_precompute rows): one
        # pass over the dataset before the first step, as colo's rows do
        precompute_ref_log_probs=args.trl_precompute,
    )
    marks = {"begin": [], "end": [], "precompute": []}
    losses = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks["begin"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks["end"].append(time.perf_counter())

    class Recording(trl.DPOTrainer):
        def _precompute_ref_logps(self, *a, **k):  # TRL runs it in __init__ (precompute_ref_log_probs=True)
            begin = time.perf_counter()
            dataset = super()._precompute_ref_logps(*a, **k)
            marks["precompute"].append(time.perf_counter() - begin)
            return dataset

        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    trainer = Recording(
        model=model,
        ref_model=ref_model,
        args=config,
        train_dataset=datasets.Dataset.from_list(records(args, world)),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    ends = marks["end"]
    if args.trl_precompute and not marks["precompute"]:
        raise RuntimeError("TRL did not precompute the reference log-probs (DPOTrainer._precompute_ref_logps unused)")
    extra = {"precompute_s": sum(marks["precompute"])} if args.trl_precompute else {}
    return {
        **extra,
        "rank": int(os.environ.get("RANK", "0")),
        "world": world,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "elapsed_s": ends[-1] - ends[args.warmup - 1] if args.warmup else ends[-1] - marks["begin"][0],
        "step_times_s": [e - b for b, e in zip(marks["begin"], ends)],
        "losses": losses,
        "peak_rss_mb": peak_rss_mb(),
    }


def measure_trl(impl: str, args, tokenizer_dir: str) -> list[dict]:
    def command(rank: int, scratch: str) -> list[str]:
        return [
            sys.executable, __file__, "--trl-worker",
            "--pairs", str(args.pairs), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--seed", str(args.seed), "--tokenizer-dir", tokenizer_dir,
            "--trl-output-dir", os.path.join(scratch, "trl"), "--out", os.path.join(scratch, f"rank{rank}.json"),
            *(["--trl-precompute"] if impl.endswith("_precompute") else []),
        ]  # fmt: skip

    return run_rank_processes(impl, IMPLS[impl][1], command, env=RANK_ENV, timeout=args.row_timeout)


# --- the driver ----------------------------------------------------------------------------------------------------


def measure(impl: str, args, tokenizer_dir: str) -> dict:
    world = IMPLS[impl][1]
    try:
        per_rank = (measure_trl if impl.startswith("trl") else measure_colo)(impl, args, tokenizer_dir)
    except Exception as error:  # noqa: BLE001 - a failed row is reported, not fatal
        return {"impl": impl, "error": f"{type(error).__name__}: {error}"[-4000:]}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    steps_per_s = args.steps / elapsed
    result = {
        "impl": impl,
        "processes": world,
        "steps_per_s": steps_per_s,
        "pairs_per_s": steps_per_s * args.pairs * world,
        "elapsed_s": elapsed,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "first_losses": [r["losses"][:3] for r in per_rank],
        "median_step_s": [statistics.median(r["step_times_s"][args.warmup :]) for r in per_rank],
        "load_average": os.getloadavg()[0],
    }
    # robust to a neighbour's bursts on a shared machine: the slowest rank's median timed step
    result["steps_per_s_median_step"] = 1 / max(result["median_step_s"])
    if "precompute_s" in per_rank[0]:
        precompute = max(r["precompute_s"] for r in per_rank)
        amortized_step = elapsed / args.steps + precompute / (args.warmup + args.steps)
        result.update(
            precompute_s=precompute,
            steps_per_s_amortized=1 / amortized_step,
            pairs_per_s_amortized=args.pairs * world / amortized_step,
        )
    if "distributed_type" in per_rank[0]:
        result["distributed_type"] = per_rank[0]["distributed_type"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. the machine's load)")
    parser.add_argument("--out", default=str(RESULTS / "dpo_trl_cpu.json"))
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    parser.add_argument("--trl-output-dir", help=argparse.SUPPRESS)
    parser.add_argument("--trl-precompute", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        Path(args.out).write_text(json.dumps(trl_rank(args)))
        return 0
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (TRL's clock starts at the end of a step)")

    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = os.path.join(scratch, "tokenizer")
        write_tokenizer(tokenizer_dir)
        for repeat in range(args.repeats):
            order = list(args.impls)
            order = order[repeat % len(order) :] + order[: repeat % len(order)]  # rotate: no row always goes first
            for impl in order:
                result = measure(impl, args, tokenizer_dir)
                result["repeat"] = repeat
                runs.append(result)
                shown = f"{result['steps_per_s']:.2f} steps/s" if "error" not in result else result["error"][:300]
                print(f"repeat {repeat} {impl}: {shown}", flush=True)

    summary = {}
    for impl in args.impls:
        ok = [r for r in runs if r["impl"] == impl and "error" not in r]
        if not ok:
            summary[impl] = {"error": next(r["error"] for r in runs if r["impl"] == impl)}
            continue
        row = {"processes": IMPLS[impl][1]}
        for key in ("steps_per_s", "pairs_per_s", "peak_rss_mb", "precompute_s", "steps_per_s_amortized",
                    "pairs_per_s_amortized", "steps_per_s_median_step"):  # fmt: skip
            if key in ok[0]:
                row[key] = statistics.median(r[key] for r in ok)
        row["steps_per_s_repeats"] = [r["steps_per_s"] for r in ok]
        row["first_losses"] = ok[0]["first_losses"][0]
        summary[impl] = row

    def ratio(a: str, b: str, key: str, key_b: str | None = None) -> float | None:
        if key in summary.get(a, {}) and (key_b or key) in summary.get(b, {}):
            return summary[a][key] / summary[b][key_b or key]
        return None

    ratios = {}
    for colo, trl in (("colo_single", "trl_single"), ("colo_ddp", "trl_ddp"), ("colo_zero2", "trl_ddp"),
                      ("colo_ddp", "trl_single"), ("colo_zero2", "trl_single"),
                      ("colo_single", "trl_single_precompute")):  # fmt: skip
        for label, key in (("throughput", "pairs_per_s"), ("throughput_amortized", "pairs_per_s_amortized")):
            # like for like: amortized against amortized where both precompute, else against TRL's step rate
            key_b = key if key in summary.get(trl, {}) else "pairs_per_s"
            value = ratio(colo, trl, key, key_b)
            if value is not None:
                ratios[f"{colo} / {trl} {label}"] = value
        value = ratio(colo, trl, "steps_per_s_median_step")
        if value is not None:  # per-rank step rate; times the ratio of ranks for pairs
            ratios[f"{colo} / {trl} throughput_median_step"] = value * IMPLS[colo][1] / IMPLS[trl][1]
        value = ratio(colo, trl, "peak_rss_mb")
        if value is not None:
            ratios[f"{colo} / {trl} peak_rss"] = value

    print(
        "\n| row | procs | steps/s | pairs/s | steps/s, precompute amortized | precompute (s) | steps/s from median "
        "step | peak RSS/rank (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for impl, row in summary.items():
        if "error" in row:
            print(f"| {IMPLS[impl][0]} | {IMPLS[impl][1]} | failed | | | | | |")
            continue
        amortized = (
            f"{row['steps_per_s_amortized']:.2f}" if "steps_per_s_amortized" in row else "— (ref forward each step)"
        )
        precompute = f"{row['precompute_s']:.2f}" if "precompute_s" in row else "—"
        print(
            f"| {IMPLS[impl][0]} | {row['processes']} | {row['steps_per_s']:.2f} | {row['pairs_per_s']:.1f} | "
            f"{amortized} | {precompute} | {row['steps_per_s_median_step']:.2f} | {row['peak_rss_mb']:.0f} |"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")

    import transformers
    import trl

    record = {
        "benchmark": "DPO steps/s and peak RSS: colo (single, DDP, ZeRO-2) vs TRL DPOTrainer, CPU (gloo)",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "note": args.note,
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("trl_worker", "tokenizer_dir", "trl_output_dir")},
            "model": {**MODEL_CONFIG, "vocab_size": vocab_size(), "class": "transformers.LlamaForCausalLM"},
            "data": "colo.apps.rlhf.python_line_records, character-level HF tokenizer (printable ASCII, no bos)",
            "seq_len_colo": SEQ_LEN,
            "lr": LR,
            "beta": BETA,
            "loss": "sigmoid",
            "max_grad_norm": MAX_GRAD_NORM,
            "weight_decay": WEIGHT_DECAY,
            "optimizer": "torch.optim.AdamW(fused=True), Trainer's groups",
            "reference": {
                "colo": "precompute_reference_logps once before training (timed as precompute_s)",
                "trl": "precompute_ref_log_probs=False (TRL's default), ref_model= a copy of the initial model",
            },
            "threads_per_rank": 1,
        },
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "accelerate": __import__("accelerate").__version__,
        },
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
