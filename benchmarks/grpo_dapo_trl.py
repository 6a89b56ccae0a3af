#!/usr/bin/env python3
"""GRPO with DAPO's settings: colo against TRL's ``GRPOTrainer`` at ``--world`` processes on CPU (issue 46).

The same work on both sides, at DAPO's settings: the Hugging Face ``LlamaForCausalLM`` and character-level tokenizer of
``benchmarks/dpo_trl.py`` (~3.2M parameters, fp32, the same initial weights); each rank takes ``--prompts`` ``a+b=``
prompts per iteration (`colo.apps.rlhf.arithmetic_prompts`), ``--group`` completions each, at most ``--max-new`` new
tokens at temperature 1; rewards: 1 for the exact answer plus DAPO's soft overlong punishment over the last
``--overlong-buffer`` tokens (TRL: ``trl.rewards.get_soft_overlong_punishment``; colo: ``grpo.overlong_buffer``'s
`soft_overlong_punishment`); GRPO advantages; the clipped loss with clip-higher (0.2 / 0.28), token-mean aggregation
(TRL's ``loss_type="dapo"``), completions without an eos masked out of the loss (TRL's ``mask_truncated_completions``,
colo's ``grpo.mask_truncated``), beta 0 (DAPO drops the KL term, so neither side runs a reference); AdamW lr 1e-6 fused,
no weight decay, gradient clipping at 1.0, one optimizer update per rollout. ``--warmup`` iterations, then ``--steps``
timed; the rows run ``--repeats`` times, interleaved with the order rotating each repeat; medians reported.

Rows (each a fresh set of ``--world`` processes, gloo, one thread each):

- ``colo``: ``Booster(DDP(max_grad_norm=1.0))`` with `attach_rollout_forward` + `GRPOCriterion`; per iteration
  `RolloutEngine.generate` (static KV cache, in place on the trained weights), rewards, `truncated_rows`,
  advantages, ``booster.train_step`` (on-policy: the old log-probs are the update forward's own, detached; TRL does
  the same with one update per generation). As ``data.task: grpo`` does, the rows whose loss is identically zero
  (truncated, so masked; or a zero advantage at beta 0) leave the update's forward and backward
  (`rows_with_gradient`), the token count still taken over the whole batch: the same update, less compute. TRL runs
  every row. The share skipped is reported (it follows the truncation rate: high for an untrained model).
- ``trl``: ``trl.GRPOTrainer`` with the settings above, generation through ``transformers`` ``generate`` (no vLLM),
  TRL's defaults otherwise (gradient checkpointing on), timed by a ``TrainerCallback`` from the end of the last
  warm-up step.
- ``trl_no_ckpt``: the same with ``gradient_checkpointing=False`` (the like-for-like compute: colo does not
  checkpoint here).
- ``colo_all_rows``: ``colo`` with every row through the update (no skipping): what colo gains apart from the skip.
- ``colo_dynamic``: ``colo`` plus DAPO's dynamic sampling (`fill_informative_groups`, ``--max-rounds`` extra rounds at
  most): groups whose rewards are all equal (here mostly: all eight completions truncated, each scored -1) are
  dropped and refilled from the next prompts. TRL has no dynamic sampling, so this row is reported apart; its
  samples/s counts the samples trained on (the extra generation is its cost), and its drops and rounds are reported.

Both sides record the completions' lengths (through the overlong reward, which both compute from the token ids), so
the JSON shows that they generated alike: mean length, the share truncated, the mean task reward.

Reported: samples/s (completions trained on per second over every rank; the slowest rank's clock), the median
iteration, peak RSS (max over ranks, imports included), colo / TRL ratios (of the medians, per repeat, of the median
iterations), the load average around each repeat. No assertion on timings.

Run::

    python benchmarks/grpo_dapo_trl.py [--world 2] [--prompts 4] [--group 8] [--max-new 16] [--overlong-buffer 8]
        [--steps 5] [--repeats 3] [--rows colo trl trl_no_ckpt colo_all_rows colo_dynamic]

Writes ``benchmarks/results/grpo_dapo_trl_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _peer_processes import peak_rss_mb, run_rank_processes
from dpo_trl import make_model, write_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
LR, MAX_GRAD_NORM, EPS_LOW, EPS_HIGH, TEMPERATURE, EOS = 1e-6, 1.0, 0.2, 0.28, 1.0, 1
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
ROWS = ("colo", "trl", "trl_no_ckpt", "colo_all_rows", "colo_dynamic")


def prompts_of(args, world: int) -> list[dict]:
    """Enough distinct prompts for every rank's iterations (and colo_dynamic's refill rounds)."""
    from colo.apps.rlhf import arithmetic_prompts

    count = args.prompts * world * (args.warmup + args.steps) * (1 + args.max_rounds)
    return arithmetic_prompts(count, seed=args.seed, max_operand=60)


def exact(completions, answer, **_) -> list[float]:
    return [float(str(c).strip() == str(a)) for c, a in zip(completions, answer, strict=True)]


class LengthLog:
    """Wraps the overlong reward (both sides call it with ``completion_ids``) to record the completions' lengths."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, function) -> None:
        self.function, self.lengths, self.ended = function, [], []

    def __call__(self, completion_ids, **kwargs):
        self.lengths += [len(ids) for ids in completion_ids]
        self.ended += [bool(ids) and ids[-1] == EOS for ids in completion_ids]
        return self.function(completion_ids=completion_ids, **kwargs)


def _generation_stats(log: LengthLog, task_rewards: list[float], warmup_rows: int) -> dict:
    lengths, ended = log.lengths[warmup_rows:], log.ended[warmup_rows:]
    return {
        "mean_completion_length": statistics.fmean(lengths),
        "truncated_fraction": 1.0 - statistics.fmean(ended),
        "task_reward_mean": statistics.fmean(task_rewards[warmup_rows:]) if task_rewards else None,
    }


def colo_worker(args) -> dict:
    import torch.distributed as dist

    from colo.apps import DDP, Booster
    from colo.apps.data import load_tokenizer
    from colo.apps.generation import RolloutEngine, SamplingParams, rollout_model_inputs
    from colo.apps.rlhf import GRPOCriterion, attach_rollout_forward, compute_rewards, global_counts, group_advantages
    from colo.apps.rlhf.dapo import fill_informative_groups, soft_overlong_punishment, truncated_rows
    from colo.apps.rlhf.policy_loss import keep_whole_microbatches, rows_with_gradient

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = load_tokenizer(args.tokenizer_dir)
    model = make_model(args.seed)
    attach_rollout_forward(model, temperature=TEMPERATURE)
    criterion = GRPOCriterion(loss_aggregation="token-mean", beta=0.0, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    booster = Booster(DDP(max_grad_norm=MAX_GRAD_NORM))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    boosted, *_ = booster.boost(model, optimizer, criterion=criterion)
    group = booster.mesh.group("dp")
    engine = RolloutEngine(booster, boosted)
    params = SamplingParams(
        max_new_tokens=args.max_new, temperature=TEMPERATURE, n=args.group, eos_token_id=EOS, pad_token_id=0
    )
    mine = prompts_of(args, world)[rank::world]  # this rank's prompt stream, drawn args.prompts at a time
    batches = (mine[i : i + args.prompts] for i in range(0, len(mine), args.prompts))
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    overlong = LengthLog(
        lambda completion_ids, **_: soft_overlong_punishment(
            [len(ids) for ids in completion_ids], max_length=args.max_new, buffer=args.overlong_buffer
        ).tolist()
    )
    task_rewards: list[float] = []

    def generate(records):
        return engine.generate([tokenizer.encode(r["prompt"]) for r in records], params, generator=generator)

    def score(records, rollout):
        ids = rollout.responses()
        completions = [tokenizer.decode([t for t in row if t != EOS]) for row in ids]
        owners = rollout.prompt_index.tolist()
        prompts = [records[i]["prompt"] for i in owners]
        answers = {"answer": [records[i]["answer"] for i in owners]}
        task = compute_rewards({"exact": exact}, prompts, completions, answers, completion_ids=ids)
        task_rewards.extend(task.tolist())
        return task + compute_rewards({"overlong": overlong}, prompts, completions, completion_ids=ids)

    times, rollout_times, dropped, rounds, shortfall, first_rounds_rows, skipped = [], [], 0, 0, 0, 0, 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            first_rounds_rows = len(overlong.lengths)
        begin = time.perf_counter()
        records = next(batches)
        rollout = generate(records)
        rewards = score(records, rollout)
        if args.worker == "colo_dynamic":
            sample = fill_informative_groups(
                records, rollout, rewards, group_size=args.group, max_extra_rounds=args.max_rounds,
                generate=generate, score=score, next_records=lambda: next(batches), pad_token_id=0, group=group,
            )  # fmt: skip
            rollout, rewards = sample.rollout, sample.rewards
            if step >= args.warmup:
                dropped, rounds, shortfall = (
                    dropped + sample.dropped_groups,
                    rounds + sample.extra_rounds,
                    shortfall + sample.shortfall_groups,
                )
        rolled = time.perf_counter()  # generation (every round) and rewards
        mask = rollout.response_mask * (~truncated_rows(rollout, EOS)).long().unsqueeze(1)
        advantages = group_advantages(rewards, args.group)
        batch = {**rollout_model_inputs(rollout, hf=True), "response_mask": mask, "advantages": advantages}
        counts = global_counts(mask, max_new_tokens=args.max_new, group=group)  # over the whole batch
        keep = keep_whole_microbatches(rows_with_gradient(advantages, mask, beta=0.0), 1)
        if args.worker == "colo_all_rows":  # every row through the update, as TRL runs them
            keep = torch.ones_like(keep)
        batch = {key: value[keep] for key, value in batch.items()}  # as data.task: grpo: zero-loss rows leave
        skipped += int((~keep).sum()) if step >= args.warmup else 0
        criterion.prepare(counts, num_microbatches=1, num_data_ranks=world)
        booster.train_step(batch)
        times.append(time.perf_counter() - begin)
        rollout_times.append(rolled - begin)
    timed = times[args.warmup :]
    result = {
        "rank": rank,
        "world": world,
        "elapsed_s": sum(timed),
        "step_times_s": timed,
        "rollout_times_s": rollout_times[args.warmup :],
        "skipped_fraction": skipped / (args.steps * args.prompts * args.group),
        "peak_mb": peak_rss_mb(),
        **_generation_stats(overlong, task_rewards, first_rounds_rows),
    }
    if args.worker == "colo_dynamic":
        result.update(dropped_groups=dropped, extra_rounds=rounds, shortfall_groups=shortfall)
    return result


def trl_worker(args) -> dict:
    import datasets
    import transformers
    import trl
    from trl.rewards import get_soft_overlong_punishment

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir)
    config = trl.GRPOConfig(
        output_dir=os.path.join(args.scratch, "trl"),
        loss_type="dapo",
        beta=0.0,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        mask_truncated_completions=True,
        temperature=TEMPERATURE,
        num_generations=args.group,
        max_completion_length=args.max_new,
        per_device_train_batch_size=args.prompts * args.group,
        learning_rate=LR,
        optim="adamw_torch_fused",
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_GRAD_NORM,
        gradient_checkpointing=args.worker == "trl",  # TRL's GRPOConfig default (True); trl_no_ckpt: off
        max_steps=args.warmup + args.steps,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        logging_steps=10_000,
    )
    marks: dict[str, list[float]] = {"begin": [], "end": []}
    overlong = LengthLog(get_soft_overlong_punishment(args.max_new, args.overlong_buffer))
    task_rewards: list[float] = []

    def exact_logged(completions, answer, **_):
        values = exact(completions, answer)
        task_rewards.extend(values)
        return values

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks["begin"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks["end"].append(time.perf_counter())

    trainer = trl.GRPOTrainer(
        model=make_model(args.seed),
        reward_funcs=[exact_logged, overlong],
        args=config,
        train_dataset=datasets.Dataset.from_list(prompts_of(args, world)[: args.prompts * world * 64]),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    ends = marks["end"]
    steps = [e - b for b, e in zip(marks["begin"], ends, strict=True)][args.warmup :]
    warmup_rows = args.warmup * args.prompts * args.group
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "world": world,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "elapsed_s": ends[-1] - ends[args.warmup - 1],
        "step_times_s": steps,
        "peak_mb": peak_rss_mb(),
        **_generation_stats(overlong, task_rewards, warmup_rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes per row")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rank per iteration")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--overlong-buffer", type=int, default=8)
    parser.add_argument("--max-rounds", type=int, default=3, help="colo_dynamic: extra generation rounds at most")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument("--out")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="colo and trl are required")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker.startswith("colo"):
            from colo.comm import init_distributed

            init_distributed()
        worker = colo_worker if args.worker.startswith("colo") else trl_worker
        Path(args.result).write_text(json.dumps(worker(args)))
        return 0
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (TRL's clock starts at the end of a step)")
    if not {"colo", "trl"} <= set(args.rows):
        parser.error("--rows must include colo and trl")

    def run(worker: str, tokenizer_dir: str) -> list[dict]:
        def command(rank: int, scratch: str) -> list[str]:
            return [
                sys.executable, __file__, "--worker", worker,
                "--prompts", str(args.prompts), "--group", str(args.group), "--max-new", str(args.max_new),
                "--overlong-buffer", str(args.overlong_buffer), "--max-rounds", str(args.max_rounds),
                "--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed),
                "--tokenizer-dir", tokenizer_dir, "--scratch", scratch,
                "--result", os.path.join(scratch, f"rank{rank}.json"),
            ]  # fmt: skip

        return run_rank_processes(worker, args.world, command, env=ENV, timeout=args.row_timeout)

    samples = args.prompts * args.group * args.world * args.steps  # trained on, over every rank
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = os.path.join(scratch, "tokenizer")
        write_tokenizer(tokenizer_dir)
        runs: dict[str, list[list[dict]]] = {name: [] for name in ROWS if name in args.rows}
        for repeat in range(args.repeats):
            shift = repeat % len(runs)
            order = list(runs)[shift:] + list(runs)[:shift]  # rotate: no row always goes first
            for name in order:
                runs[name].append(run(name, tokenizer_dir))
                print(f"repeat {repeat} {name}: done (load {os.getloadavg()[0]:.1f})", flush=True)
            loads.append(os.getloadavg()[0])
    table = {}
    for name, repeats in runs.items():
        rates = [samples / max(rank["elapsed_s"] for rank in ranks) for ranks in repeats]
        steps = [statistics.median(max(rank["step_times_s"][i] for rank in ranks) for i in range(args.steps))
                 for ranks in repeats]  # fmt: skip
        ranks = [rank for ranks in repeats for rank in ranks]
        row = {
            "samples_per_s": statistics.median(rates),
            "samples_per_s_repeats": rates,
            "median_step_s": statistics.median(steps),
            "median_step_s_repeats": steps,
            "peak_mb": max(rank["peak_mb"] for rank in ranks),
        }
        for key in ("mean_completion_length", "truncated_fraction", "task_reward_mean"):
            row[key] = statistics.fmean(rank[key] for rank in ranks)
        if name.startswith("colo"):  # the median iteration's split: rollout with rewards, then the update
            rollout_s = statistics.median(t for rank in ranks for t in rank["rollout_times_s"])
            row["median_rollout_s"] = rollout_s
            row["skipped_fraction"] = statistics.fmean(rank["skipped_fraction"] for rank in ranks)
            row["median_update_s"] = statistics.median(
                t - r for rank in ranks for t, r in zip(rank["step_times_s"], rank["rollout_times_s"], strict=True)
            )
        if name == "colo_dynamic":
            per_step = args.repeats * args.steps
            for key in ("dropped_groups", "extra_rounds", "shortfall_groups"):  # per step; groups over all ranks
                total = sum(rank[key] for rank in ranks)
                row[f"{key}_per_step"] = total / per_step / (args.world if key == "extra_rounds" else 1)
        if name == "trl" or name == "trl_no_ckpt":
            row["distributed_type"] = ranks[0]["distributed_type"]
        table[name] = row
    colo = table["colo"]

    def per_repeat(first: str, other: str) -> list[float]:  # the rows of one repeat ran back to back
        pairs = zip(table[first]["samples_per_s_repeats"], table[other]["samples_per_s_repeats"], strict=True)
        return [c / t for c, t in pairs]

    result = {
        "device": "cpu",
        "world": args.world,
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "tokenizer_dir", "scratch", "result")},
        "rows": table,
        "load_averages": loads,
    }
    for peer in ("trl", "trl_no_ckpt"):
        if peer in table:
            result[f"colo_over_{peer}_samples_per_s"] = colo["samples_per_s"] / table[peer]["samples_per_s"]
            result[f"colo_over_{peer}_samples_per_s_repeats"] = per_repeat("colo", peer)
            result[f"colo_over_{peer}_median_step"] = table[peer]["median_step_s"] / colo["median_step_s"]
            result[f"colo_over_{peer}_peak_rss"] = colo["peak_mb"] / table[peer]["peak_mb"]
    if "colo_dynamic" in table:
        result["colo_dynamic_over_trl_samples_per_s"] = (
            table["colo_dynamic"]["samples_per_s"] / table["trl"]["samples_per_s"]
        )
    print(
        f"\n| row ({args.world} processes) | samples/s (median; repeats) | median iteration (s) | peak RSS (MB) | "
        "mean length | truncated |\n|---|---|---|---|---|---|"
    )
    for name, row in table.items():
        spread = ", ".join(f"{rate:.0f}" for rate in row["samples_per_s_repeats"])
        print(
            f"| {name} | {row['samples_per_s']:.1f} ({spread}) | {row['median_step_s']:.3f} | {row['peak_mb']:.0f} | "
            f"{row['mean_completion_length']:.1f} | {row['truncated_fraction']:.2f} |"
        )
    for peer in ("trl", "trl_no_ckpt"):
        if peer in table:
            spread = ", ".join(f"{r:.2f}" for r in result[f"colo_over_{peer}_samples_per_s_repeats"])
            print(
                f"colo / {peer}: {result[f'colo_over_{peer}_samples_per_s']:.2f}x samples/s (per repeat {spread}), "
                f"{result[f'colo_over_{peer}_median_step']:.2f}x median iteration, "
                f"{result[f'colo_over_{peer}_peak_rss']:.2f}x peak RSS"
            )
    if "colo_dynamic" in table:
        dynamic = table["colo_dynamic"]
        dropped, rounds = dynamic["dropped_groups_per_step"], dynamic["extra_rounds_per_step"]
        print(
            f"colo_dynamic: {dynamic['samples_per_s']:.1f} samples/s trained; per step {dropped:.1f} groups dropped, "
            f"{rounds:.2f} extra rounds, {dynamic['shortfall_groups_per_step']:.1f} groups short"
        )
    for name in (n for n in table if n.startswith("colo")):
        row = table[name]
        print(f"{name} iteration split (medians): rollout + rewards {row['median_rollout_s'] * 1e3:.0f} ms, "
              f"update {row['median_update_s'] * 1e3:.0f} ms")  # fmt: skip
    print(f"load average (1 min) before / after each repeat: {', '.join(f'{x:.1f}' for x in loads)}")
    out = Path(args.out or RESULTS / "grpo_dapo_trl_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
