#!/usr/bin/env python3
"""Diffusion-transformer training steps/s and peak memory on CPU: colo (DDP, ZeRO-2, ZeRO-3) training its native
PixArt-alpha DiT against diffusers' ``PixArtTransformer2DModel`` under accelerate, same weights, same flow-matching
objective, same data, 2 processes (issue 45).

The harness is `diffusion_train.py`'s (imported, not copied): its frozen 2-layer CLIP text encoder, caption
tokenizer and untrained ``AutoencoderKL`` [16, 32] (throughput only) built from configs with the same seeds on both
sides, its captioned shapes data (16 x 16 images, 8 x 8 x 4 latents; rank ``r`` takes rows ``r * B ...`` of the
step's global batch), its timed loop (``--warmup`` then ``--steps`` timed steps, peak RSS, the training-phase peak)
and its peer-process launcher. The denoiser: `colo.apps.models.dit.DiffusionTransformer` (``--heads`` x
``--head-dim`` wide, ``--layers`` blocks, 1 x 1 patches: 64 tokens, cross-attention on the 32-wide text states,
PixArt's initialization with seed 3); the diffusers side loads its state dict strictly into a
``PixArtTransformer2DModel(**config.diffusers_config())``. The objective: rectified flow, SD3's
``FlowMatchEulerDiscreteScheduler(shift=3.0)`` training schedule, logit-normal(0, 1) timestep density, no loss
weighting, no condition dropout (``x_t = (1 - sigma) x_0 + sigma * noise``, target ``noise - x_0``).
``torch.optim.AdamW(lr=2e-3, weight_decay=0, fused=True)``, fp32, no clipping, gloo, one thread per rank.

Rows (``--impls``), each in fresh processes, interleaved over ``--repeats`` with the order rotating, medians:

- ``colo_ddp`` / ``colo_zero2`` / ``colo_zero3``: ``Booster(DDP())`` / ``Booster(Zero(stage=2))`` /
  ``Booster(Zero(stage=3))`` over `DenoiserLoss(transformer=...)`, batches from `FlowMatchingBatchBuilder`, as
  `colo.apps.diffusion.task.DiffusionTask` trains ``diffusion.denoiser: dit``.
- ``diffusers_ddp``: ``train_dreambooth_sd3.py``'s step with diffusers' own calls (``vae.encode(...).latent_dist``,
  ``compute_density_for_timestep_sampling``, the scheduler's ``timesteps`` / ``sigmas``,
  ``compute_loss_weighting_for_sd3``, ``PixArtTransformer2DModel(...)`` as PixArt's pipeline calls it), under
  ``accelerate.Accelerator(cpu=True)`` in ``MULTI_CPU`` mode (torch DDP underneath). Both sides draw each step's
  random numbers from `colo.apps.diffusion.step_generator` in the same order (posterior sample, flow noise,
  timestep density, for the global batch), so the first losses agree.
- ``diffusers_ddp_view`` (not in the default rows): ``diffusers_ddp`` with colo DDP's gradient handling
  (``DistributedDataParallelKwargs(gradient_as_bucket_view=True)``, ``zero_grad(set_to_none=False)``), to separate
  that from the models' own speed.
- Compiled rows (not in the default rows), inductor on both sides, gcc's C++ codegen on CPU: ``colo_ddp_compiled``
  / ``colo_zero2_compiled`` (the plugin's ``compile_blocks=True``: one ``torch.compile`` per DiT block, after
  parallelization), ``diffusers_ddp_compiled`` (the same granularity for the peer: ``block.compile()`` on each of
  PixArt's ``transformer_blocks`` before ``accelerator.prepare``) and ``diffusers_ddp_dynamo`` (accelerate's own
  switch, ``Accelerator(dynamo_backend="inductor")``: the whole prepared model compiled). Compilation falls in the
  warm-up steps, reported apart (``warmup_s``, and ``warmup_excess_s`` over as many steady steps);
  ``--fresh-compile-cache`` starts the run on an empty inductor cache, so the first repeat of each compiled row
  compiles cold and later ones reuse what it wrote. Ratios are given against every peer row in the run.

``--profile`` runs torch.profiler on rank 0 of every row over the timed steps and prints (and stores) its table of
ops by self CPU time and the matmuls' share; the profiler slows the steps, so ratios come from a run without it.

Run::

    python benchmarks/diffusion_dit_train.py [--batch 8] [--heads 6] [--head-dim 64] [--layers 6] [--repeats 3]
    python benchmarks/diffusion_dit_train.py --impls colo_ddp colo_ddp_compiled diffusers_ddp diffusers_ddp_compiled \
        --fresh-compile-cache --out benchmarks/results/diffusion_dit_train_compiled_cpu.json

Writes ``benchmarks/results/diffusion_dit_train_cpu.json`` (``--out``).
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

import diffusion_train as harness
import torch
from _peer_processes import run_rank_processes

RESULTS = Path(__file__).resolve().parent / "results"
LR, SEED = 2e-3, 0
IMPLS = {
    "colo_ddp": "colo Booster(DDP), 2 processes",
    "colo_zero2": "colo Booster(Zero(stage=2)), 2 processes",
    "colo_zero3": "colo Booster(Zero(stage=3)), 2 processes",
    "diffusers_ddp": "diffusers PixArtTransformer2DModel + accelerate (MULTI_CPU, gloo), 2 processes",
    "diffusers_ddp_view": "the same, DDP gradient_as_bucket_view=True and zero_grad(set_to_none=False) as colo's DDP",
    "colo_ddp_compiled": "colo Booster(DDP(compile_blocks=True)): each DiT block compiled (inductor)",
    "colo_zero2_compiled": "colo Booster(Zero(stage=2, compile_blocks=True)): each DiT block compiled",
    "diffusers_ddp_compiled": "diffusers + accelerate DDP, each of PixArt's transformer_blocks compiled (inductor)",
    "diffusers_ddp_dynamo": "diffusers + accelerate DDP, Accelerator(dynamo_backend='inductor'): whole model compiled",
}
PEER_COMPILE = {"diffusers_ddp_compiled": "blocks", "diffusers_ddp_dynamo": "accelerate"}
"""The peer rows' compilation (``--peer-compile`` of their worker processes)."""
WORLD = 2


def dit_config(args):
    from colo.apps.models.dit import DiTConfig

    return DiTConfig(
        num_attention_heads=args.heads,
        attention_head_dim=args.head_dim,
        num_layers=args.layers,
        sample_size=8,
        patch_size=1,
        cross_attention_dim=args.heads * args.head_dim,
        caption_channels=32,
    )


def harness_args(args) -> argparse.Namespace:
    """What `diffusion_train`'s helpers read: the text encoder / VAE shapes (its defaults) and the data set."""
    return argparse.Namespace(channels=[32, 64], num_images=args.num_images, warmup=args.warmup, steps=args.steps)


def frozen_components(args):
    """``(tokenizer, text_encoder, vae)``: `diffusion_train`'s, the same seeds (no UNet built)."""
    from colo.apps.diffusion import build_text_encoder, build_vae, caption_vocabulary, save_caption_tokenizer

    config = harness.model_config(harness_args(args))
    with tempfile.TemporaryDirectory(prefix="colo-bench-dit-tokenizer-") as directory:
        tokenizer = save_caption_tokenizer(caption_vocabulary(), directory, max_length=config.max_caption_tokens)
    text_encoder = build_text_encoder(config, tokenizer, seed=SEED + 1).requires_grad_(False).eval()
    vae = build_vae(config, seed=SEED + 2).requires_grad_(False).eval()
    return tokenizer, text_encoder, vae


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def profiled(step_fn, args, rank: int):
    """``(step_fn, profile)``: with ``--profile`` on rank 0, ``step_fn`` wrapped so that torch.profiler records the
    timed steps (after the warm-up) and ``profile`` filled with the table of ops by self CPU time and the shares of
    the matmuls (self time) when the last step ends; else ``step_fn`` and an empty dict."""
    profile: dict = {}
    if not args.profile or rank != 0:
        return step_fn, profile
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    profiler = torch_profile(activities=[ProfilerActivity.CPU])

    def wrapped(step: int) -> float:
        if step == args.warmup:
            profiler.start()
        loss = step_fn(step)
        if step == args.warmup + args.steps - 1:
            profiler.stop()
            events = profiler.key_averages()
            total = sum(event.self_cpu_time_total for event in events)
            matmul = sum(event.self_cpu_time_total for event in events if event.key in MATMUL_OPS)
            profile["profile"] = {
                "self_cpu_s_per_step": total / 1e6 / args.steps,
                "matmul_share": matmul / total,
                "table": events.table(
                    sort_by="self_cpu_time_total", row_limit=args.profile_rows, max_name_column_width=60
                ),
            }
        return loss

    return wrapped, profile


def colo_rank(impl: str, args) -> dict:
    import torch.distributed as dist

    from colo.apps import DDP, Booster, Zero
    from colo.apps.diffusion import DenoiserLoss, FlowMatchingBatchBuilder, FlowMatchingObjective
    from colo.apps.diffusion.models import build_dit

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer, text_encoder, vae = frozen_components(args)
    dataset = harness.images(harness_args(args))
    transformer = build_dit(dit_config(args), seed=SEED + 3).train()
    rss_before = harness.current_rss_mb()
    objective = FlowMatchingObjective(timestep_sampling="logit_normal", loss_weighting="none", shift=3.0)
    builder = FlowMatchingBatchBuilder(objective, tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, seed=SEED)
    model = DenoiserLoss(transformer=transformer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    compiled = impl.endswith("_compiled")
    plugin = {
        "colo_zero2": lambda: Zero(stage=2, compile_blocks=compiled),
        "colo_zero3": lambda: Zero(stage=3),
    }.get(impl.removesuffix("_compiled"), lambda: DDP(compile_blocks=compiled))()
    booster = Booster(plugin)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)

    def batch_of(step: int) -> dict:
        data = harness.local_images(dataset, step, rank, args.batch, world)
        return builder(
            step=step, captions=data["caption"], pixel_values=data["pixel_values"], rows=rows,
            global_rows=args.batch * world,
        )  # fmt: skip

    booster.boost(model, optimizer, example_batch=batch_of(0))

    def step_fn(step: int) -> float:
        return float(booster.train_step(batch_of(step)).loss)

    step_fn, profile = profiled(step_fn, args, rank)
    result = harness.timed_loop(harness_args(args), step_fn, dist.barrier, rss_before)
    result.update(rank=rank, **profile)
    return result


def baseline_rank(args) -> dict:
    """One process of the diffusers row; accelerate reads the torchrun-style environment the driver set."""
    from diffusers import FlowMatchEulerDiscreteScheduler, PixArtTransformer2DModel
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from colo.apps.diffusion import step_generator
    from colo.apps.diffusion.models import build_dit

    torch.set_num_threads(1)
    if args.peer_compile == "accelerate":  # accelerate compiles the prepared model (torch.compile of the DDP module)
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, dynamo_backend="inductor")
    else:
        accelerator = harness.make_accelerator(args)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer, text_encoder, vae = frozen_components(args)
    dataset = harness.images(harness_args(args))
    config = dit_config(args)
    transformer = PixArtTransformer2DModel(**config.diffusers_config())
    transformer.load_state_dict(build_dit(config, seed=SEED + 3).state_dict(), strict=True)
    transformer.train()
    if args.peer_compile == "blocks":  # the equivalent of colo's compile_blocks: one torch.compile per block, in place
        for block in transformer.transformer_blocks:
            block.compile()
    rss_before = harness.current_rss_mb()
    noise_scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=LR, weight_decay=0.0, fused=True)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    global_rows = args.batch * world

    def step_fn(step: int) -> float:
        data = harness.local_images(dataset, step, rank, args.batch, world)
        generator = step_generator(SEED, step)
        with torch.no_grad():
            latent_dist = vae.encode(data["pixel_values"]).latent_dist
            shape = (global_rows, *latent_dist.mean.shape[1:])
            eps = torch.randn(shape, generator=generator)[rows]  # latent_dist.sample(generator), drawn globally
            latents = (latent_dist.mean + latent_dist.std * eps) * vae.config.scaling_factor
        noise = torch.randn(shape, generator=generator)[rows]
        u = compute_density_for_timestep_sampling(
            weighting_scheme="logit_normal", batch_size=global_rows, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
            generator=generator,
        )[rows]  # fmt: skip
        indices = (u * noise_scheduler.config.num_train_timesteps).long()
        timesteps = noise_scheduler.timesteps[indices]
        sigmas = noise_scheduler.sigmas[indices].reshape(-1, 1, 1, 1)
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        input_ids = tokenizer(
            data["caption"], max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        with torch.no_grad():
            encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
        model_pred = transformer(
            noisy, encoder_hidden_states=encoder_hidden_states, timestep=timesteps,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False,
        )[0]  # fmt: skip
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
        target = noise - latents
        loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(len(target), -1), 1)
        loss = loss.mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not args.bucket_view)
        return accelerator.gather(loss.detach().reshape(1)).mean().item()

    step_fn, profile = profiled(step_fn, args, rank)
    result = harness.timed_loop(harness_args(args), step_fn, accelerator.wait_for_everyone, rss_before)
    result.update(rank=rank, world=world, distributed_type=str(accelerator.distributed_type), **profile)
    return result


def measure_rows(impl: str, args) -> list[dict]:
    if impl.startswith("colo"):
        from colo.comm import launch

        return launch(
            colo_rank, WORLD, impl, args, backend="gloo", threads=1, env=harness.RANK_ENV, timeout=args.row_timeout
        )

    def command(rank: int, scratch: str) -> list[str]:
        return [
            sys.executable, __file__, "--baseline-worker", "--batch", str(args.batch), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--num-images", str(args.num_images), "--heads", str(args.heads),
            "--head-dim", str(args.head_dim), "--layers", str(args.layers),
            "--out", os.path.join(scratch, f"rank{rank}.json"), "--profile-rows", str(args.profile_rows),
        ] + (["--profile"] if args.profile else []) + (["--bucket-view"] if impl == "diffusers_ddp_view" else []) + (
            ["--peer-compile", PEER_COMPILE[impl]] if impl in PEER_COMPILE else []
        )  # fmt: skip

    return run_rank_processes(impl, WORLD, command, env=harness.RANK_ENV, timeout=args.row_timeout)


def measure(impl: str, args) -> dict:
    try:
        per_rank = measure_rows(impl, args)
    except Exception as error:  # noqa: BLE001 - a failed row is reported, not fatal
        return {"impl": impl, "error": f"{type(error).__name__}: {error}"[-4000:]}
    elapsed = max(r["elapsed_s"] for r in per_rank)
    median_steps = [statistics.median(r["step_times_s"][args.warmup :]) for r in per_rank]
    # compilation (and the first step's allocations) fall in the warm-up steps: reported apart from the timed steps,
    # as the warm-up's excess over as many steady steps (the slowest rank's)
    warmup_s = max(sum(r["step_times_s"][: args.warmup]) for r in per_rank)
    return {
        "impl": impl,
        "steps_per_s": args.steps / elapsed,
        "steps_per_s_median_step": 1 / max(median_steps),
        "images_per_s": args.steps / elapsed * args.batch * WORLD,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "training_rss_mb": max(r["training_rss_mb"] for r in per_rank),
        "step_peak_rss_mb": max(r["step_peak_rss_mb"] for r in per_rank),
        "first_losses": per_rank[0]["losses"][:3],
        "warmup_s": warmup_s,
        "warmup_excess_s": warmup_s - args.warmup * max(median_steps),
        "load_average": os.getloadavg()[0],
        **({"profile_rank0": per_rank[0]["profile"]} if "profile" in per_rank[0] else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS)[:4])
    parser.add_argument("--batch", type=int, default=8, help="images per rank per step")
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--num-images", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mmap-threshold", type=int, default=65536, help="as diffusion_train.py's")
    parser.add_argument("--row-timeout", type=float, default=600.0)
    parser.add_argument("--note", default="")
    parser.add_argument(
        "--profile", action="store_true",
        help="torch.profiler on rank 0 of each row over the timed steps (its table in the JSON; the profiler slows "
        "the steps: read the ratios from a run without it)",
    )  # fmt: skip
    parser.add_argument("--profile-rows", type=int, default=25, help="ops in each profile table")
    parser.add_argument("--out", default=str(RESULTS / "diffusion_dit_train_cpu.json"))
    parser.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-view", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--peer-compile", choices=["none", "blocks", "accelerate"], default="none", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--fresh-compile-cache", action="store_true",
        help="point TORCHINDUCTOR_CACHE_DIR at a new empty directory for this run: the first repeat of a compiled row "
        "compiles cold, later repeats hit the cache its first wrote",
    )  # fmt: skip
    args = parser.parse_args()
    if args.baseline_worker:
        Path(args.out).write_text(json.dumps(baseline_rank(args)))
        return 0
    if args.mmap_threshold:
        harness.set_mmap_threshold(args.mmap_threshold)  # both sides' ranks, at exec
    if args.fresh_compile_cache:  # inherited by both sides' rank processes
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="colo-bench-dit-inductor-")

    runs, began = [], time.perf_counter()
    for repeat in range(args.repeats):
        order = args.impls[repeat % len(args.impls) :] + args.impls[: repeat % len(args.impls)]
        for impl in order:
            result = measure(impl, args)
            result["repeat"] = repeat
            runs.append(result)
            error = result.get("error", "")[:600]
            shown = error or f"{result['steps_per_s']:.2f} steps/s, {result['peak_rss_mb']:.0f} MB"
            print(f"repeat {repeat} {impl}: {shown}", flush=True)
            if "profile_rank0" in result:
                profile = result["profile_rank0"]
                print(
                    f"rank 0 profile of {impl}: {profile['self_cpu_s_per_step']:.3f} s self CPU per step, matmuls "
                    f"{profile['matmul_share']:.0%}\n{profile['table']}",
                    flush=True,
                )
    wall = time.perf_counter() - began

    summary = {}
    for impl in args.impls:
        ok = [r for r in runs if r["impl"] == impl and "error" not in r]
        if not ok:
            summary[impl] = {"error": next(r["error"] for r in runs if r["impl"] == impl)}
            continue
        row = {key: statistics.median(r[key] for r in ok) for key in (
            "steps_per_s", "steps_per_s_median_step", "images_per_s", "peak_rss_mb", "training_rss_mb",
            "step_peak_rss_mb", "warmup_s", "warmup_excess_s",
        )}  # fmt: skip
        row["warmup_s_repeats"] = [r["warmup_s"] for r in ok]
        row["steps_per_s_repeats"] = [r["steps_per_s"] for r in ok]
        row["first_losses"] = ok[0]["first_losses"]
        summary[impl] = row
    ratios = {}
    for peer in ("diffusers_ddp", "diffusers_ddp_compiled", "diffusers_ddp_dynamo"):
        base = summary.get(peer, {})
        for colo in [impl for impl in IMPLS if impl.startswith("colo")] + ["diffusers_ddp_view"]:
            row = summary.get(colo, {})
            if "steps_per_s" not in row or "steps_per_s" not in base:
                continue
            ratios[f"{colo} / {peer} throughput"] = row["steps_per_s"] / base["steps_per_s"]
            ratios[f"{colo} / {peer} throughput_median_step"] = (
                row["steps_per_s_median_step"] / base["steps_per_s_median_step"]
            )
            ratios[f"{colo} / {peer} peak_rss"] = row["peak_rss_mb"] / base["peak_rss_mb"]
            ratios[f"{colo} / {peer} training_rss"] = row["training_rss_mb"] / base["training_rss_mb"]

    print(
        "\n| row | steps/s | steps/s from median step | peak RSS/rank (MB) | training RSS/rank (MB) | warm-up s "
        "(excess) | first losses |"
    )
    print("|---|---|---|---|---|---|---|")
    for impl, row in summary.items():
        if "error" in row:
            print(f"| {IMPLS[impl]} | failed | | | | | |")
            continue
        losses = ", ".join(f"{x:.4f}" for x in row["first_losses"])
        print(
            f"| {IMPLS[impl]} | {row['steps_per_s']:.2f} | {row['steps_per_s_median_step']:.2f} | "
            f"{row['peak_rss_mb']:.0f} | {row['training_rss_mb']:.0f} | {row['warmup_s']:.1f} "
            f"({row['warmup_excess_s']:.1f}) | {losses} |"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    print(f"wall time: {wall:.0f} s, load average now: {os.getloadavg()}")

    import accelerate
    import diffusers

    from colo.apps.diffusion.models import build_dit

    record = {
        "benchmark": "diffusion transformer training steps/s and peak RSS: colo DDP / ZeRO-2 / ZeRO-3 (native DiT) vs "
        "diffusers PixArtTransformer2DModel + accelerate DDP, flow matching, CPU (gloo), 2 processes",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "note": args.note,
        "load_average_end": os.getloadavg(),
        "wall_s": wall,
        "config": {
            **{k: v for k, v in vars(args).items() if k != "baseline_worker"},
            "dit_params": sum(p.numel() for p in build_dit(dit_config(args)).parameters()),
            "dit": dit_config(args).diffusers_config(),
            "objective": "rectified flow, FlowMatchEulerDiscreteScheduler(shift=3.0), logit-normal(0, 1), no weighting",
            "optimizer": f"torch.optim.AdamW(lr={LR}, weight_decay=0, fused=True), fp32, no clipping",
            "data": "diffusion_train.py's: ShapesDataset 16 x 16, frozen CLIP text encoder and VAE, 8x8x4 latents",
        },
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "diffusers": diffusers.__version__,
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
