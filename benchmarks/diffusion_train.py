#!/usr/bin/env python3
"""Text-to-image denoiser training steps/s and peak memory on CPU: colo (single, DDP, ZeRO-2/3, Gemini) against a
diffusers + accelerate loop (``train_text_to_image.py``'s step).

Issue 22. The same work on both sides: the ``tiny-diffusion`` preset's models built from configs with
`colo.apps.diffusion` (no download): a diffusers ``UNet2DConditionModel`` (``block_out_channels`` ``--channels``,
default [32, 64], one layer per block, cross-attention on a 32-wide CLIP text encoder: ~1.0M trainable parameters)
on 8 x 8 x 4 latents of 16 x 16 images; a frozen 2-layer ``CLIPTextModel`` with the caption-vocabulary
``CLIPTokenizer``, and a frozen (randomly initialised, untrained: throughput only) ``AutoencoderKL`` [16, 32], the
same seeds on both sides; the procedurally generated captioned shapes (`colo.apps.diffusion.ShapesDataset`), the
step's global batch being images ``G * step ...`` and rank ``r`` taking rows ``r * B ...`` of it; the epsilon
objective with Stable Diffusion's ``DDPMScheduler`` (scaled_linear, 1000 steps), no Min-SNR, no noise offset, no
condition dropout; ``torch.optim.AdamW(lr=2e-3, weight_decay=0, fused=True)`` over the UNet, fp32, no clipping;
``--batch`` images per rank per step; gloo on loopback, one thread per rank (``OMP_NUM_THREADS=1``).
``--warmup`` steps, then ``--steps`` timed ones. Both sides draw each step's random numbers the same way (the
posterior sample's normal noise, the diffusion noise, the timesteps, for the global batch, from
`colo.apps.diffusion.step_generator`; each rank keeps its rows), so their losses agree.

Rows (``--impls``), each in fresh processes (so the peak RSS is its own), interleaved over ``--repeats`` with the
order rotating each repeat, medians reported:

- ``colo_single`` / ``colo_ddp``: ``Booster(DDP())`` on 1 and 2 processes; ``colo_zero2`` / ``colo_zero3``:
  ``Booster(Zero(stage=2))`` / ``Booster(Zero(stage=3))`` on 2; ``colo_gemini``: ``Booster(Gemini(placement=
  "auto", device_capacity=--gemini-budget))`` on 2 (without a GPU Gemini's device tier is a preallocated arena of
  host memory, so the budget is host memory here too). The boosted module is `DenoiserLoss` (the UNet and its MSE);
  `DiffusionBatchBuilder` runs the frozen VAE and text encoder on each rank for its own rows, then
  ``booster.train_step(batch)``, as `colo.apps.diffusion.task.DiffusionTask` does. Step time covers both.
- ``diffusers_single`` / ``diffusers_ddp``: the loop of ``packages/colo-apps/tests/test_diffusion_recipe.py``
  (``train_text_to_image.py``'s step with diffusers' own calls: ``vae.encode(...).latent_dist``, scaling factor,
  ``noise_scheduler.add_noise``, ``text_encoder(input_ids)``, ``unet(...)``, ``F.mse_loss``), under an
  ``accelerate.Accelerator(cpu=True)``: ``accelerator.prepare(unet, optimizer)``, ``accelerator.backward(loss)``,
  ``optimizer.step()``, ``optimizer.zero_grad()``. ``diffusers_ddp`` runs 2 processes in accelerate's ``MULTI_CPU``
  mode (gloo, torch DDP underneath), started with the environment torchrun would give them. The one change from
  the script: the latent is ``mean + std * eps`` with ``eps`` drawn for the global batch (what
  ``latent_dist.sample(generator)`` computes, with the draw shared with colo's side so the losses agree).
- ``colo_ddp_copy`` / ``diffusers_ddp_view``: the two 2-process DDP rows with each other's gradient handling, to
  explain the gap between them. colo's `DDP` wraps the model in torch's DDP with ``gradient_as_bucket_view=True``
  and zeroes gradients in place (``set_to_none=False``); accelerate's default is ``gradient_as_bucket_view=False``
  and ``optimizer.zero_grad()`` sets them to None. ``colo_ddp_copy`` is colo with ``DDP(gradient_as_bucket_view=
  False)`` (then colo sets gradients to None too); ``diffusers_ddp_view`` is the diffusers loop with
  ``DistributedDataParallelKwargs(gradient_as_bucket_view=True)`` and ``zero_grad(set_to_none=False)``.

Reported: steps/s and images/s (over all ranks, from the slowest rank's wall time over the timed steps), steps/s from
the slowest rank's median timed step (robust to a neighbour's bursts on a shared machine), peak RSS (``ru_maxrss``,
max over ranks; each side's imports included: accelerate on one side, colo's packages on the other, diffusers and
transformers on both), the training RSS (the peak minus the resident set once the models and data were built, just
before the optimizer and the wrapping: what training itself added, max over ranks), the first losses (the same on
both sides, to ~1e-6), and the load average. No assertion on timings anywhere. Also the RSS once set up (after the
wrapping, before the first step), the peak RSS of the steps alone (the high-water mark reset just before the first
step: construction and ZeRO-3 / Gemini's one-time copy into chunks excluded) and the RSS after the last step. Every
rank of every row runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed (``--mmap-threshold``, default 64 KiB), so
freed tensors go back to the OS and the RSS follows live memory rather than glibc's retained heap. colo's rows boost
with ``example_batch`` (chunks packed in the order the forward uses the parameters, as the diffusion trainer does);
``--chunk-mib`` sets ZeRO-3 / Gemini's chunk size.

Run::

    python benchmarks/diffusion_train.py [--batch 16] [--warmup 2] [--steps 8] [--repeats 2]
    # a 64.5M-parameter UNet, where model states outweigh activations (the memory comparison):
    python benchmarks/diffusion_train.py --channels 128 256 512 --batch 2 --warmup 1 --steps 3 --chunk-mib 16 \
        --impls colo_ddp colo_zero2 colo_zero3 colo_gemini diffusers_ddp --gemini-budget 160MiB \
        --out benchmarks/results/diffusion_train_unet64m_cpu.json

Writes ``benchmarks/results/diffusion_train_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
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
LR, SEED = 2e-3, 0
IMPLS = {
    "colo_single": ("colo Booster(DDP), 1 process", 1),
    "diffusers_single": ("diffusers loop + accelerate, 1 process", 1),
    "colo_ddp": ("colo Booster(DDP), 2 processes", 2),
    "colo_zero2": ("colo Booster(Zero(stage=2)), 2 processes", 2),
    "colo_zero3": ("colo Booster(Zero(stage=3)), 2 processes", 2),
    "colo_gemini": ("colo Booster(Gemini(auto)), 2 processes", 2),
    "diffusers_ddp": ("diffusers loop + accelerate (MULTI_CPU, gloo), 2 processes", 2),
    # the rows that explain colo_ddp / diffusers_ddp: each side with the other's gradient handling
    "colo_ddp_copy": ("colo Booster(DDP(gradient_as_bucket_view=False)), 2 processes", 2),
    "diffusers_ddp_view": ("diffusers + accelerate, DDP gradient_as_bucket_view=True, zero_grad(set_to_none=False)", 2),
}
RANK_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


# --- shared by both sides ------------------------------------------------------------------------------------------


def model_config(args):
    from colo.apps.diffusion import DiffusionModelConfig

    return DiffusionModelConfig(
        image_size=16,
        unet_channels=tuple(args.channels),
        unet_layers_per_block=1,
        attention_head_dim=8,
        norm_num_groups=8,
        text_hidden_size=32,
        text_layers=2,
        text_heads=2,
        max_caption_tokens=16,
        vae_channels=(16, 32),
    )


def components(args):
    """``(tokenizer, text_encoder, vae, unet)``: the same in every process (seeded; the tokenizer written here)."""
    from colo.apps.diffusion import (
        build_text_encoder,
        build_unet,
        build_vae,
        caption_vocabulary,
        save_caption_tokenizer,
    )

    config = model_config(args)
    with tempfile.TemporaryDirectory(prefix="colo-bench-diffusion-tokenizer-") as directory:
        tokenizer = save_caption_tokenizer(caption_vocabulary(), directory, max_length=config.max_caption_tokens)
    text_encoder = build_text_encoder(config, tokenizer, seed=SEED + 1).requires_grad_(False).eval()
    vae = build_vae(config, seed=SEED + 2).requires_grad_(False).eval()
    unet = build_unet(config, seed=SEED + 3).train()
    return tokenizer, text_encoder, vae, unet


def local_images(dataset, step: int, rank: int, batch: int, world: int) -> dict:
    """This rank's rows of step ``step``'s global batch (images ``world * batch * step ...`` of the set)."""
    from colo.apps.diffusion import collate

    first = world * batch * step + rank * batch
    return collate([dataset[(first + i) % len(dataset)] for i in range(batch)])


def images(args):
    from colo.apps.diffusion import ShapesDataset

    return ShapesDataset(args.num_images, image_size=16, seed=SEED)


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux: ``clear_refs`` 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def timed_loop(args, step_fn, barrier, rss_before_mb: float) -> dict:
    step_times, losses = [], []
    # the training phase's own peak: model construction and boosting (ZeRO-3 / Gemini copy the full model into
    # chunks once) are excluded by resetting the high-water mark here, after setup and before the first step
    steady_before = current_rss_mb()
    reset = reset_peak_rss()
    start = time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            barrier()
            start = time.perf_counter()
        begin = time.perf_counter()
        losses.append(step_fn(step))
        step_times.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - start
    peak = peak_rss_mb()
    return {
        "elapsed_s": elapsed,
        "step_times_s": step_times,
        "losses": losses,
        "peak_rss_mb": peak,
        "training_rss_mb": peak - rss_before_mb,
        "setup_rss_mb": steady_before,
        "step_peak_rss_mb": peak_rss_since_reset_mb() if reset else float("nan"),
        "end_rss_mb": current_rss_mb(),
    }


# --- colo: one rank, under colo.comm.launch ------------------------------------------------------------------------


def colo_rank(impl: str, args) -> dict:
    import torch.distributed as dist

    from colo.apps import DDP, Booster, Gemini, Zero
    from colo.apps.diffusion import DenoiserLoss, DiffusionBatchBuilder, DiffusionObjective

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer, text_encoder, vae, unet = components(args)
    dataset = images(args)
    rss_before = current_rss_mb()
    builder = DiffusionBatchBuilder(
        DiffusionObjective(prediction_type="epsilon"),
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        seed=SEED,
    )
    model = DenoiserLoss(unet)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    chunk_numel = args.chunk_mib * 2**20 // 4 if args.chunk_mib else None
    plugin = {
        "colo_zero2": lambda: Zero(stage=2),
        "colo_zero3": lambda: Zero(stage=3, chunk_numel=chunk_numel),
        "colo_gemini": lambda: Gemini(placement="auto", device_capacity=args.gemini_budget, chunk_numel=chunk_numel),
        "colo_ddp_copy": lambda: DDP(gradient_as_bucket_view=False),
    }.get(impl, DDP)()
    booster = Booster(plugin)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)

    def batch_of(step: int) -> dict:
        data = local_images(dataset, step, rank, args.batch, world)
        return builder(
            step=step,
            captions=data["caption"],
            pixel_values=data["pixel_values"],
            rows=rows,
            global_rows=args.batch * world,
        )

    # chunks packed in the order the UNet's forward uses its parameters, as colo's diffusion trainer packs them
    booster.boost(model, optimizer, example_batch=batch_of(0))

    def step_fn(step: int) -> float:
        return float(booster.train_step(batch_of(step)).loss)

    result = timed_loop(args, step_fn, dist.barrier, rss_before)
    result["rank"] = rank
    return result


def measure_colo(impl: str, args) -> list[dict]:
    from colo.comm import launch

    return launch(
        colo_rank, IMPLS[impl][1], impl, args, backend="gloo", threads=1, env=RANK_ENV, timeout=args.row_timeout
    )


# --- diffusers + accelerate: one rank, a fresh interpreter running this file with --baseline-worker ---------------


def make_accelerator(args):
    """accelerate's CPU ``Accelerator`` of a diffusers row (the ``diffusers_ddp_view`` row: with colo DDP's
    gradient handling, ``gradient_as_bucket_view=True``)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)] if args.bucket_view else []
    return Accelerator(cpu=True, kwargs_handlers=handlers)


def baseline_rank(args) -> dict:
    """One process of a diffusers row; accelerate reads the torchrun-style environment the driver set."""
    import torch.nn.functional as F
    from diffusers import DDPMScheduler

    from colo.apps.diffusion import step_generator

    torch.set_num_threads(1)
    accelerator = make_accelerator(args)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer, text_encoder, vae, unet = components(args)
    dataset = images(args)
    rss_before = current_rss_mb()
    noise_scheduler = DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
        prediction_type="epsilon",
    )  # fmt: skip
    optimizer = torch.optim.AdamW(unet.parameters(), lr=LR, weight_decay=0.0, fused=True)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    global_rows = args.batch * world

    def step_fn(step: int) -> float:
        data = local_images(dataset, step, rank, args.batch, world)
        generator = step_generator(SEED, step)
        latent_dist = vae.encode(data["pixel_values"]).latent_dist
        shape = (global_rows, *latent_dist.mean.shape[1:])
        eps = torch.randn(shape, generator=generator)[rows]  # latent_dist.sample(generator), drawn globally
        latents = (latent_dist.mean + latent_dist.std * eps) * vae.config.scaling_factor
        noise = torch.randn(shape, generator=generator)[rows]
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (global_rows,), generator=generator)
        timesteps = timesteps[rows].long()
        input_ids = tokenizer(
            data["caption"], max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not args.bucket_view)
        # the reported loss: the mean over ranks, as train_text_to_image.py gathers it for logging
        return accelerator.gather(loss.detach().reshape(1)).mean().item()

    result = timed_loop(args, step_fn, accelerator.wait_for_everyone, rss_before)
    result.update(rank=rank, world=world, distributed_type=str(accelerator.distributed_type))
    return result


def measure_baseline(impl: str, args) -> list[dict]:
    def command(rank: int, scratch: str) -> list[str]:
        return [
            sys.executable, __file__, "--baseline-worker",
            "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--num-images", str(args.num_images), "--channels", *map(str, args.channels),
            "--out", os.path.join(scratch, f"rank{rank}.json"),
        ] + (["--bucket-view"] if impl == "diffusers_ddp_view" else [])  # fmt: skip

    return run_rank_processes(impl, IMPLS[impl][1], command, env=RANK_ENV, timeout=args.row_timeout)


# --- the driver ----------------------------------------------------------------------------------------------------


def measure(impl: str, args) -> dict:
    world = IMPLS[impl][1]
    try:
        per_rank = (measure_baseline if impl.startswith("diffusers") else measure_colo)(impl, args)
    except Exception as error:  # noqa: BLE001 - a failed row is reported, not fatal
        return {"impl": impl, "error": f"{type(error).__name__}: {error}"[-4000:]}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    steps_per_s = args.steps / elapsed
    result = {
        "impl": impl,
        "processes": world,
        "steps_per_s": steps_per_s,
        "images_per_s": steps_per_s * args.batch * world,
        "elapsed_s": elapsed,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in per_rank],
        "training_rss_mb": max(r["training_rss_mb"] for r in per_rank),
        "setup_rss_mb": max(r["setup_rss_mb"] for r in per_rank),
        "step_peak_rss_mb": max(r["step_peak_rss_mb"] for r in per_rank),
        "end_rss_mb": max(r["end_rss_mb"] for r in per_rank),
        "first_losses": per_rank[0]["losses"][:3],
        "median_step_s": [statistics.median(r["step_times_s"][args.warmup :]) for r in per_rank],
        "load_average": os.getloadavg()[0],
    }
    result["steps_per_s_median_step"] = 1 / max(result["median_step_s"])
    if "distributed_type" in per_rank[0]:
        result["distributed_type"] = per_rank[0]["distributed_type"]
    return result


def set_mmap_threshold(threshold: int) -> None:
    """Give every rank of every row glibc's ``MALLOC_MMAP_THRESHOLD_`` at exec. glibc reads it once, when the
    process starts: the peer rows get it in their command's environment; colo's ranks are spawned by
    `colo.comm.launch`, which applies its ``env`` inside the already started worker (too late for glibc), so it is
    set in this driver's environment too, which spawned workers inherit. Before this (until 2026-11-28) only the
    peer rows ran with the threshold and colo's with glibc's dynamic one: see the README's diffusion section."""
    RANK_ENV["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    parser.add_argument("--batch", type=int, default=16, help="images per rank per step")
    parser.add_argument("--channels", type=int, nargs="+", default=[32, 64], help="the UNet's block_out_channels")
    parser.add_argument("--num-images", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--gemini-budget", default="64MiB", help="Gemini's device_capacity per rank (a host arena without a GPU)"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="glibc's MALLOC_MMAP_THRESHOLD_ in every rank of every row (0: leave glibc's dynamic threshold): "
        "tensors above it are mmapped and given back to the OS when freed, so the RSS follows live memory",
    )
    parser.add_argument(
        "--chunk-mib", type=int, default=0, help="ZeRO-3 / Gemini chunk size in MiB of fp32 (0: colo's search)"
    )
    parser.add_argument("--row-timeout", type=float, default=600.0)
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. the machine's load)")
    parser.add_argument("--out", default=str(RESULTS / "diffusion_train_cpu.json"))
    parser.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-view", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_worker:
        Path(args.out).write_text(json.dumps(baseline_rank(args)))
        return 0

    if args.mmap_threshold:
        set_mmap_threshold(args.mmap_threshold)
    runs = []
    began = time.perf_counter()
    for repeat in range(args.repeats):
        order = list(args.impls)
        order = order[repeat % len(order) :] + order[: repeat % len(order)]  # rotate: no row always goes first
        for impl in order:
            result = measure(impl, args)
            result["repeat"] = repeat
            runs.append(result)
            shown = (
                f"{result['steps_per_s']:.2f} steps/s, {result['peak_rss_mb']:.0f} MB"
                if "error" not in result
                else result["error"][:600]
            )
            print(f"repeat {repeat} {impl}: {shown}", flush=True)
    wall = time.perf_counter() - began

    summary = {}
    for impl in args.impls:
        ok = [r for r in runs if r["impl"] == impl and "error" not in r]
        if not ok:
            summary[impl] = {"error": next(r["error"] for r in runs if r["impl"] == impl)}
            continue
        row = {"processes": IMPLS[impl][1]}
        keys = ("steps_per_s", "images_per_s", "peak_rss_mb", "training_rss_mb", "steps_per_s_median_step")
        for key in (*keys, "setup_rss_mb", "step_peak_rss_mb", "end_rss_mb"):
            row[key] = statistics.median(r[key] for r in ok)
        row["steps_per_s_repeats"] = [r["steps_per_s"] for r in ok]
        row["first_losses"] = ok[0]["first_losses"]
        summary[impl] = row

    ratios = {}
    pairs = (
        [("colo_single", "diffusers_single")]
        + [(colo, "diffusers_ddp") for colo in ("colo_ddp", "colo_zero2", "colo_zero3", "colo_gemini", "colo_ddp_copy")]
        + [
            ("colo_ddp", "diffusers_ddp_view"),
            ("colo_ddp_copy", "diffusers_ddp_view"),
            ("diffusers_ddp_view", "diffusers_ddp"),
        ]
    )
    for colo, base in pairs:
        if "error" in summary.get(colo, {"error": 1}) or "error" in summary.get(base, {"error": 1}):
            continue
        a, b = summary[colo], summary[base]
        ratios[f"{colo} / {base} throughput"] = a["images_per_s"] / b["images_per_s"]
        ratios[f"{colo} / {base} throughput_median_step"] = a["steps_per_s_median_step"] / b["steps_per_s_median_step"]
        ratios[f"{colo} / {base} peak_rss"] = a["peak_rss_mb"] / b["peak_rss_mb"]
        ratios[f"{colo} / {base} training_rss"] = a["training_rss_mb"] / b["training_rss_mb"]
        ratios[f"{colo} / {base} step_peak_rss"] = a["step_peak_rss_mb"] / b["step_peak_rss_mb"]
    for impl, single in (("colo_ddp", "colo_single"), ("diffusers_ddp", "diffusers_single")):
        if "images_per_s" in summary.get(impl, {}) and "images_per_s" in summary.get(single, {}):
            ratios[f"{impl} scaling (images/s over 2 x {single})"] = summary[impl]["images_per_s"] / (
                2 * summary[single]["images_per_s"]
            )

    print(
        "\n| row | procs | steps/s | images/s | steps/s from median step | peak RSS/rank (MB) | training RSS/rank (MB) "
        "| RSS after setup (MB) | peak RSS of the steps (MB) | first losses |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for impl, row in summary.items():
        if "error" in row:
            print(f"| {IMPLS[impl][0]} | {IMPLS[impl][1]} | failed | | | | | | | |")
            continue
        losses = ", ".join(f"{x:.4f}" for x in row["first_losses"])
        print(
            f"| {IMPLS[impl][0]} | {row['processes']} | {row['steps_per_s']:.2f} | {row['images_per_s']:.1f} | "
            f"{row['steps_per_s_median_step']:.2f} | {row['peak_rss_mb']:.0f} | {row['training_rss_mb']:.0f} | "
            f"{row['setup_rss_mb']:.0f} | {row['step_peak_rss_mb']:.0f} | {losses} |"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    print(f"wall time: {wall:.0f} s, load average now: {os.getloadavg()}")

    import accelerate
    import diffusers
    import transformers

    from colo.apps.diffusion import build_unet

    unet_params = sum(p.numel() for p in build_unet(model_config(args)).parameters())
    record = {
        "benchmark": "diffusion denoiser training steps/s and peak RSS: colo (single, DDP, ZeRO-2/3, Gemini) vs "
        "diffusers + accelerate, CPU (gloo)",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "note": args.note,
        "load_average_end": os.getloadavg(),
        "wall_s": wall,
        "config": {
            **{k: v for k, v in vars(args).items() if k != "baseline_worker"},
            "unet_params": unet_params,
            "models": {
                "unet": model_config(args).unet_config(),
                "vae": model_config(args).vae_config(),
                "text_encoder": "CLIPTextModel, hidden 32, 2 layers, 2 heads, 16 tokens (frozen)",
            },
            "data": "colo.apps.diffusion.ShapesDataset, 16 x 16 images; rank r takes rows r*B.. of the global batch",
            "objective": "epsilon, DDPMScheduler scaled_linear 0.00085..0.012, 1000 steps; no SNR/offset/dropout",
            "optimizer": f"torch.optim.AdamW(lr={LR}, weight_decay=0, fused=True), fp32, no clipping",
            "gemini": f"placement='auto', device_capacity={args.gemini_budget} per rank (host arena on CPU)",
            "threads_per_rank": 1,
        },
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
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
