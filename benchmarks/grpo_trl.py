#!/usr/bin/env python3
"""GRPO iteration throughput and peak memory: colo against TRL's ``GRPOTrainer``; rollout tokens/s of colo's
generation engine against ``transformers`` ``generate``. One process each (issue 24).

The same work on both sides: the Hugging Face ``LlamaForCausalLM`` of ``benchmarks/dpo_trl.py`` (hidden 256, 4
layers, 4 heads, 2 kv heads, character-level vocabulary of printable ASCII: ~3.2M parameters), fp32, the same
initial weights and character-level tokenizer (written at run time, no bos); ``--prompts`` ``a+b=`` prompts per
step (`colo.apps.rlhf.arithmetic_prompts`), ``--group`` completions each, at most ``--max-new`` new tokens,
temperature 1, reward 1 for the exact answer; GRPO advantages, beta 0.04 (k3 KL to a frozen reference, so both
sides run a reference forward every step), token-mean aggregation (TRL's ``dapo``), clip 0.2, AdamW lr 1e-6,
gradient clipping at 1.0 (``torch.optim.AdamW(fused=True)``, no weight decay: TRL's defaults), one optimizer update per
rollout. ``--warmup`` iterations, then ``--steps`` timed ones; the rows run ``--repeats`` times, interleaved with the
order rotating each repeat, medians reported.

Rows, each in a fresh process (its own peak memory):

- ``colo``: ``Booster(DDP(max_grad_norm=1.0))`` with `attach_rollout_forward` + `GRPOCriterion`; per iteration
  `RolloutEngine.generate` (static KV cache, in place on the trained weights, each prompt prefilled once for its
  G rows), rewards, advantages, the reference's log-probs, ``booster.train_step``; the reference and training
  forwards compute each prompt once for its group (`attach_rollout_forward`'s shared-prompt forward, the same
  log-probs as the full forward). One update per rollout, so the old log-probs are the update's own training
  forward's, detached (`GRPOCriterion`'s on-policy path, as ``data.task: grpo`` takes with ``epochs * minibatches
  = 1``; TRL does the same), and the rollout-vs-trainer log-prob mismatch is computed from them as the trainer logs
  it (its maximum is reported).
- ``trl``: ``trl.GRPOTrainer`` (``loss_type="dapo"``, ``beta=0.04``, ``use_bias_correction_kl=False``,
  ``num_generations=--group``, ``per_device_train_batch_size = prompts x group``, generation through
  ``transformers`` ``generate``, no vLLM), timed with a ``TrainerCallback`` from the end of the last warm-up step;
  TRL's defaults otherwise, gradient checkpointing included (``GRPOConfig.gradient_checkpointing`` defaults to
  ``True``: its update recomputes the forward in the backward, for less memory).
- ``trl_no_ckpt``: the same with ``gradient_checkpointing=False``, the like-for-like compute (colo does not
  checkpoint here).
- ``generation`` (``engine`` / ``hf_generate``): generation alone on the initial weights:
  `colo.apps.generation.generate` against ``model.generate(do_sample=True, num_return_sequences=group)`` on the same
  left-padded prompts; tokens counted up to and including each row's eos.

Reported: samples/s (completions per second; the median over repeats and each repeat's), the median iteration,
peak memory (CPU: ``ru_maxrss``, imports included; CUDA: ``torch.cuda.max_memory_allocated``), the colo / TRL ratios
(of the median samples/s, per repeat, and of the median iterations), colo's largest rollout-vs-trainer log-prob
mismatch and its iteration split (rollout with rewards / reference forward / update), tokens/s of generation, the
load average before and after each repeat. No assertion on timings.

Run::

    python benchmarks/grpo_trl.py [--device cpu|cuda] [--prompts 8] [--group 8] [--max-new 8] [--steps 6] [--repeats 3]
        [--rows colo trl trl_no_ckpt generation]

Writes ``benchmarks/results/grpo_trl_<device>.json`` (``--out``).
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
LR, BETA, MAX_GRAD_NORM, EPS_CLIP, TEMPERATURE = 1e-6, 0.04, 1.0, 0.2, 1.0
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ROWS = ("colo", "trl", "trl_no_ckpt", "generation")


def prompts_of(args) -> list[dict]:
    from colo.apps.rlhf import arithmetic_prompts

    return arithmetic_prompts(args.prompts * (args.warmup + args.steps), seed=args.seed, max_operand=50)


def exact(completions, answer, **_) -> list[float]:
    return [float(str(c).strip() == str(a)) for c, a in zip(completions, answer, strict=True)]


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


def colo_worker(args) -> dict:
    from colo.apps import DDP, Booster
    from colo.apps.data import load_tokenizer
    from colo.apps.generation import RolloutEngine, SamplingParams, rollout_model_inputs
    from colo.apps.rlhf import GRPOCriterion, attach_rollout_forward, compute_rewards, global_counts, group_advantages

    torch.set_num_threads(1)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    tokenizer = load_tokenizer(args.tokenizer_dir)
    model = make_model(args.seed).to(device)
    reference = make_model(args.seed).to(device).requires_grad_(False).eval()
    attach_rollout_forward(model, temperature=TEMPERATURE)
    attach_rollout_forward(reference, temperature=TEMPERATURE)
    criterion = GRPOCriterion(loss_aggregation="token-mean", beta=BETA, eps_low=EPS_CLIP)
    booster = Booster(DDP(max_grad_norm=MAX_GRAD_NORM))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    boosted, *_ = booster.boost(model, optimizer, criterion=criterion)
    engine = RolloutEngine(booster, boosted)
    params = SamplingParams(
        max_new_tokens=args.max_new, temperature=TEMPERATURE, n=args.group, eos_token_id=1, pad_token_id=0
    )
    records = prompts_of(args)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    times, tokens, mismatches = [], 0, []
    phases: dict[str, list[float]] = {"rollout_s": [], "reference_s": [], "update_s": []}

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for step in range(args.warmup + args.steps):
        begin = clock()
        batch_records = records[step * args.prompts : (step + 1) * args.prompts]
        rollout = engine.generate([tokenizer.encode(r["prompt"]) for r in batch_records], params, generator=generator)
        completions = [tokenizer.decode([t for t in ids if t != 1]) for ids in rollout.responses()]
        owners = rollout.prompt_index.tolist()
        rewards = compute_rewards(
            {"exact": exact},
            [batch_records[i]["prompt"] for i in owners],
            completions,
            {"answer": [batch_records[i]["answer"] for i in owners]},
        )
        mask = rollout.response_mask
        batch = {
            **rollout_model_inputs(rollout, hf=True),
            "response_mask": mask,
            "advantages": group_advantages(rewards, args.group).to(device),
        }
        rolled = clock()  # generation, rewards, advantages
        with torch.no_grad():
            batch["ref_logps"] = reference(**batch)["logps"] * mask
        scored = clock()
        criterion.prepare(global_counts(mask, max_new_tokens=args.max_new), num_microbatches=1, num_data_ranks=1)
        booster.train_step(batch)  # on-policy: no old_logps in the batch, the update's forward gives them
        mismatch = (criterion.take_forward_logps() - rollout.logprobs).abs() * mask  # as data.task: grpo logs it
        mismatches.append(float(mismatch.max()))
        end = clock()
        times.append(end - begin)
        if step >= args.warmup:
            tokens += rollout.num_generated_tokens
            for name, seconds in zip(phases, (rolled - begin, scored - rolled, end - scored), strict=True):
                phases[name].append(seconds)
    timed = times[args.warmup :]
    return {
        "elapsed_s": sum(timed),
        "step_times_s": timed,
        "tokens": tokens,
        "peak_mb": _peak_memory_mb(device),
        "logprob_mismatch_max": max(mismatches),
        **{name: statistics.median(values) for name, values in phases.items()},
    }


def trl_worker(args) -> dict:
    import datasets
    import transformers
    import trl

    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir)
    model_dir = os.path.join(args.scratch, "model")  # with beta > 0 TRL loads its reference from the model's path
    make_model(args.seed).save_pretrained(model_dir)
    config = trl.GRPOConfig(
        output_dir=os.path.join(args.scratch, "trl"),
        loss_type="dapo",
        beta=BETA,
        use_bias_correction_kl=False,
        epsilon=EPS_CLIP,
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
        use_cpu=args.device == "cpu",
        bf16=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        logging_steps=10_000,
    )
    marks: dict[str, list[float]] = {"begin": [], "end": []}
    cuda = args.device == "cuda"

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            marks["begin"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            marks["end"].append(time.perf_counter())

    trainer = trl.GRPOTrainer(
        model=model_dir,
        reward_funcs=exact,
        args=config,
        train_dataset=datasets.Dataset.from_list(prompts_of(args)),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    ends = marks["end"]
    steps = [e - b for b, e in zip(marks["begin"], ends, strict=True)][args.warmup :]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return {"elapsed_s": ends[-1] - ends[args.warmup - 1], "step_times_s": steps, "peak_mb": _peak_memory_mb(device)}


@torch.no_grad()
def generation_worker(args) -> dict:
    """Generation alone: colo's engine and transformers' generate, the same prompts, alternating, medians."""
    import transformers

    from colo.apps.generation import SamplingParams, generate

    torch.set_num_threads(1)
    device = torch.device(args.device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir)
    tokenizer.padding_side = "left"
    model = make_model(args.seed).to(device).eval()
    records = prompts_of(args)[: args.prompts]
    ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    params = SamplingParams(
        max_new_tokens=args.max_new, temperature=TEMPERATURE, n=args.group, eos_token_id=1, pad_token_id=0
    )
    encoded = tokenizer([r["prompt"] for r in records], return_tensors="pt", padding=True, add_special_tokens=False)
    encoded = {k: v.to(device) for k, v in encoded.items()}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rates: dict[str, list[float]] = {"engine": [], "hf_generate": []}
    for repeat in range(args.warmup + args.steps):
        sync()
        begin = time.perf_counter()
        rollout = generate(model, ids, params)
        sync()
        engine_s = time.perf_counter() - begin
        begin = time.perf_counter()
        out = model.generate(
            **encoded, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=args.max_new,
            num_return_sequences=args.group, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        sync()
        hf_s = time.perf_counter() - begin
        new = out[:, encoded["input_ids"].shape[1] :]
        ended = (new == 1).int().cumsum(dim=1)
        hf_tokens = int(((ended == 0) | ((ended == 1) & (new == 1))).sum())
        if repeat >= args.warmup:
            rates["engine"].append(rollout.num_generated_tokens / engine_s)
            rates["hf_generate"].append(hf_tokens / hf_s)
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument("--out")
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=ROWS,
        default=list(ROWS),
        help="rows to run (colo and trl are required for the ratio)",
    )
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "colo":
            from colo.comm import init_distributed

            init_distributed()
        worker = {"colo": colo_worker, "trl": trl_worker, "trl_no_ckpt": trl_worker}.get(args.worker)
        worker = worker or generation_worker
        Path(args.result).write_text(json.dumps(worker(args)))
        return 0
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (TRL's clock starts at the end of a step)")

    def run(worker: str, tokenizer_dir: str) -> dict:
        def command(rank: int, scratch: str) -> list[str]:
            return [
                sys.executable, __file__, "--worker", worker, "--device", args.device,
                "--prompts", str(args.prompts), "--group", str(args.group), "--max-new", str(args.max_new),
                "--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed),
                "--tokenizer-dir", tokenizer_dir, "--scratch", scratch,
                "--result", os.path.join(scratch, f"rank{rank}.json"),
            ]  # fmt: skip

        return run_rank_processes(worker, 1, command, env=ENV, timeout=args.row_timeout)[0]

    if not {"colo", "trl"} <= set(args.rows):
        parser.error("--rows must include colo and trl")
    samples = args.prompts * args.group
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = os.path.join(scratch, "tokenizer")
        write_tokenizer(tokenizer_dir)
        runs: dict[str, list[dict]] = {name: [] for name in ROWS if name in args.rows}
        for repeat in range(args.repeats):
            shift = repeat % len(runs)
            order = list(runs)[shift:] + list(runs)[:shift]  # rotate: no row always goes first
            for name in order:
                runs[name].append(run(name, tokenizer_dir))
                print(f"repeat {repeat} {name}: done (load {os.getloadavg()[0]:.1f})", flush=True)
            loads.append(os.getloadavg()[0])
    table = {}
    for name in (n for n in runs if n != "generation"):
        rates = [samples * args.steps / row["elapsed_s"] for row in runs[name]]
        steps = [statistics.median(row["step_times_s"]) for row in runs[name]]
        table[name] = {
            "samples_per_s": statistics.median(rates),
            "samples_per_s_repeats": rates,
            "median_step_s": statistics.median(steps),
            "median_step_s_repeats": steps,
            "peak_mb": max(row["peak_mb"] for row in runs[name]),
        }
    table["colo"]["logprob_mismatch_max"] = max(row["logprob_mismatch_max"] for row in runs["colo"])
    for phase in ("rollout_s", "reference_s", "update_s"):  # medians over iterations, then over repeats
        table["colo"][f"median_{phase}"] = statistics.median(row[phase] for row in runs["colo"])
    colo = table["colo"]

    def per_repeat(other: str) -> list[float]:  # the rows of one repeat ran back to back, under similar load
        pairs = zip(colo["samples_per_s_repeats"], table[other]["samples_per_s_repeats"], strict=True)
        return [c / t for c, t in pairs]

    result = {
        "device": args.device,
        "cuda_device": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "tokenizer_dir", "scratch", "result")},
        "grpo": table,
        "colo_over_trl_samples_per_s": colo["samples_per_s"] / table["trl"]["samples_per_s"],
        # per repeat (rows of one repeat ran back to back): the spread of the ratio on a noisy machine
        "colo_over_trl_samples_per_s_repeats": per_repeat("trl"),
        "colo_over_trl_samples_per_s_median_of_repeats": statistics.median(per_repeat("trl")),
        # the ratio of the median iterations: less sensitive to a load burst inside one row's run
        "colo_over_trl_median_step": table["trl"]["median_step_s"] / colo["median_step_s"],
        "load_average": loads[-1],
        "load_averages": loads,
    }
    if "trl_no_ckpt" in table:
        result["colo_over_trl_no_ckpt_samples_per_s"] = colo["samples_per_s"] / table["trl_no_ckpt"]["samples_per_s"]
        result["colo_over_trl_no_ckpt_median_step"] = table["trl_no_ckpt"]["median_step_s"] / colo["median_step_s"]
        result["colo_over_trl_no_ckpt_samples_per_s_repeats"] = per_repeat("trl_no_ckpt")
        result["colo_over_trl_no_ckpt_samples_per_s_median_of_repeats"] = statistics.median(per_repeat("trl_no_ckpt"))
    memory = "peak GPU memory allocated (MB)" if args.device == "cuda" else "peak RSS (MB)"
    print(f"\n| row | samples/s (median; repeats) | median iteration (s) | {memory} |\n|---|---|---|---|")
    for name, row in table.items():
        spread = ", ".join(f"{rate:.0f}" for rate in row["samples_per_s_repeats"])
        print(f"| {name} | {row['samples_per_s']:.1f} ({spread}) | {row['median_step_s']:.3f} | {row['peak_mb']:.0f} |")
    spread = ", ".join(f"{ratio:.2f}" for ratio in result["colo_over_trl_samples_per_s_repeats"])
    print(
        f"colo / trl samples/s: {result['colo_over_trl_samples_per_s']:.2f}x (per repeat {spread}: median "
        f"{result['colo_over_trl_samples_per_s_median_of_repeats']:.2f}x); median iteration "
        f"{result['colo_over_trl_median_step']:.2f}x"
    )
    if "trl_no_ckpt" in table:
        spread = ", ".join(f"{ratio:.2f}" for ratio in result["colo_over_trl_no_ckpt_samples_per_s_repeats"])
        print(
            f"colo / trl without gradient checkpointing: {result['colo_over_trl_no_ckpt_samples_per_s']:.2f}x "
            f"samples/s (per repeat {spread}: median "
            f"{result['colo_over_trl_no_ckpt_samples_per_s_median_of_repeats']:.2f}x), "
            f"{result['colo_over_trl_no_ckpt_median_step']:.2f}x median iteration"
        )
    print(f"colo rollout-vs-trainer log-prob mismatch (max): {colo['logprob_mismatch_max']:.2e}")
    split = ", ".join(
        f"{phase} {colo[f'median_{phase}_s'] * 1e3:.0f} ms" for phase in ("rollout", "reference", "update")
    )
    print(f"colo iteration split (medians): {split}")
    if "generation" in runs:
        keys = ("engine", "hf_generate")
        generation = {key: statistics.median(row[key] for row in runs["generation"]) for key in keys}
        result["generation_tokens_per_s"] = generation
        result["engine_over_hf_generate"] = generation["engine"] / generation["hf_generate"]
        print(
            f"generation tokens/s: engine {generation['engine']:.0f}, transformers generate "
            f"{generation['hf_generate']:.0f} ({result['engine_over_hf_generate']:.2f}x)"
        )
    print(f"load average (1 min) before / after each repeat: {', '.join(f'{x:.1f}' for x in loads)}")
    out = Path(args.out or RESULTS / f"grpo_trl_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
