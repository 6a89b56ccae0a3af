"""``data.task: diffusion`` as a `TrainTask` of the one training loop (`colo.apps.train.Trainer`): the text-to-image
denoiser, trained under the loop's resilience guard (SIGTERM checkpoints, the hang watchdog, timed checkpoints),
non-finite-loss check, background checkpoints, pruning and resume, with the run's shared optimizer builder.

What the task adds: the boosted module is `DenoiserLoss` around the UNet, while the frozen CLIP text encoder and VAE
(or the latent cache) run beside it on every rank (`DiffusionBatchBuilder`); a step's batch is a function of the
step alone (exact resume); the `ShardedEMA` of the trained weights is updated after every step and saved beside each
checkpoint (``<checkpoint dir>/ema/step-N``) before that checkpoint commits; every evaluation writes a sample grid
(EMA weights, fixed prompts and seeds), and so does the end of the run.
"""

from __future__ import annotations

import os
import shutil

import torch

from colo.comm import barrier

from ..train.state import committed_checkpoints, prune_checkpoints
from ..train.task import TaskContext, TrainTask
from .components import (
    build_dataset,
    check_cross_attention,
    frozen_components,
    initial_denoiser,
    initial_unet,
    load_vae,
)
from .data import collate, frames_as_images
from .ema import EMA_DIR, ShardedEMA, ema_checkpoint, full_weights
from .flow_matching import FlowMatchingBatchBuilder
from .latent_cache import CACHE_DIR, build_latent_cache
from .lora import add_unet_lora, lora_settings
from .objective import DenoiserLoss, DiffusionBatchBuilder


class UNetDepth:
    """The depth of a `DenoiserLoss` parameter for layer-wise LR decay (``optimizer.layerwise_lr_decay``), from the
    input side to the output side of the UNet: 0 for ``conv_in`` and the time (and class) embeddings, ``i + 1`` for
    ``down_blocks.i``, then ``mid_block``, then ``up_blocks.i``, and ``num_layers + 1`` (the full LR) for
    ``conv_norm_out`` / ``conv_out``. LoRA adapters take the depth of the layer they adapt.

    Args:
        unet: a diffusers ``UNet2DConditionModel``.
    """

    def __init__(self, unet: torch.nn.Module) -> None:
        self.num_down_blocks, self.num_up_blocks = len(unet.down_blocks), len(unet.up_blocks)
        self.num_layers = self.num_down_blocks + 1 + self.num_up_blocks
        """The down blocks, the mid block and the up blocks."""

    def __call__(self, name: str) -> int:
        block, _, rest = name.removeprefix("unet.").partition(".")
        if block == "down_blocks":
            return 1 + int(rest.split(".", 1)[0])
        if block == "mid_block":
            return self.num_down_blocks + 1
        if block == "up_blocks":
            return self.num_down_blocks + 2 + int(rest.split(".", 1)[0])
        if block in ("conv_norm_out", "conv_out"):
            return self.num_layers + 1
        return 0


class DiTDepth:
    """The depth of a `DenoiserLoss` parameter of colo's diffusion transformer for layer-wise LR decay: 0 for the
    patch embedding, adaLN-single and the caption projection, ``i + 1`` for ``transformer_blocks.i``, and
    ``num_layers + 1`` (the full LR) for the output's ``scale_shift_table`` and ``proj_out``.

    Args:
        transformer: a `colo.apps.models.dit.DiffusionTransformer`.
    """

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.num_layers = len(transformer.transformer_blocks)

    def __call__(self, name: str) -> int:
        block, _, rest = name.removeprefix("transformer.").partition(".")
        if block == "transformer_blocks":
            return 1 + int(rest.split(".", 1)[0])
        if block in ("scale_shift_table", "proj_out"):
            return self.num_layers + 1
        return 0


def denoiser_depth(model: DenoiserLoss):
    """`UNetDepth` or `DiTDepth` of the boosted module's denoiser."""
    if model.denoiser_name == "transformer":
        return DiTDepth(model.transformer)
    return UNetDepth(model.unet)


class DiffusionTask(TrainTask):
    """Trains the denoiser of ``config`` (``data.task: diffusion``); see the module docstring.

    Args:
        config: the run config.

    Raises:
        ValueError: an image folder of mixed sizes without ``diffusion.resize`` (before any collective).
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        self.section = config.diffusion
        self.objective = self.section.training_objective()
        self.dataset = build_dataset(self.section)
        self.tokenizer = self.text_encoder = self.vae = self.latents = self.builder = None
        self.ema: ShardedEMA | None = None
        self._num_parameters = self._num_trainable = 0
        self._grid: tuple[int, str | None] | None = None  # (step, rank 0's path) of the last sample grid

    # --- setup ----------------------------------------------------------------------------------------------------

    def build_model(self, ctx: TaskContext, *, init_from: str | None = None) -> DenoiserLoss:
        """`DenoiserLoss` around the UNet (``diffusion.unet_from`` or the sizes; LoRA adapters when asked). The first
        call also builds the frozen side on every rank: the tokenizer and a pre-trained VAE (written by rank 0,
        then a barrier), the text encoder, and the latent cache when ``diffusion.cache_latents``."""
        if init_from is not None:
            raise ValueError("data.task='diffusion' starts its UNet from diffusion.unet_from, not model.init_from")
        config = self.config
        if self.builder is None:
            self._check_batch(ctx)  # before the VAE pre-training and the first collective
            self._build_frozen(ctx)
        denoiser = initial_denoiser(config)
        check_cross_attention(denoiser, self.text_encoder)
        denoiser.to(ctx.device)
        if config.lora.enabled:
            torch.manual_seed(config.seed)  # the same adapters on every rank (boost also broadcasts rank 0's)
            add_unet_lora(denoiser, **lora_settings(config.lora))
        self._num_parameters = sum(p.numel() for p in denoiser.parameters())
        self._num_trainable = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
        compute = ctx.plugin.compute_dtype
        compute = compute if compute != torch.float32 else None
        if self.section.denoiser == "dit":
            return DenoiserLoss(transformer=denoiser, compute_dtype=compute)
        return DenoiserLoss(denoiser, compute_dtype=compute)

    def _check_batch(self, ctx: TaskContext) -> None:
        data_ranks = ctx.plugin.mesh_shape(ctx.world_size).get("dp", 1)
        batch, microbatches = self.config.data.global_batch_size, self.config.schedule.num_microbatches
        if batch % (data_ranks * microbatches):
            raise ValueError(
                f"data.global_batch_size={batch} must divide by dp={data_ranks} x schedule.num_microbatches="
                f"{microbatches}; choose a multiple of {data_ranks * microbatches}"
            )

    def _build_frozen(self, ctx: TaskContext) -> None:
        config = self.config
        self.tokenizer, text_encoder, vae = frozen_components(
            config, self.dataset, rank=ctx.rank, world_size=ctx.world_size
        )
        # the frozen encoders run where the denoiser does, in fp32 (they are not boosted; the VAE's fingerprint and
        # the cached latents stay those of its fp32 weights)
        self.text_encoder, vae = text_encoder.to(ctx.device), vae.to(ctx.device)
        if self.section.cache_latents:  # encode once; training then holds no VAE (the sample grids load it)
            root = os.path.join(config.output_dir, CACHE_DIR)
            self.latents = build_latent_cache(root, self.dataset, vae, rank=ctx.rank, world_size=ctx.world_size)
            vae = None
        self.vae = vae
        builder_class = FlowMatchingBatchBuilder if self.section.objective == "flow_matching" else DiffusionBatchBuilder
        self.builder = builder_class(
            self.objective,
            tokenizer=self.tokenizer,
            text_encoder=self.text_encoder,
            vae=self.vae,
            seed=config.seed,
            scaling_factor=self.latents.scaling_factor if self.latents is not None else None,
            caption_mask=self.section.denoiser == "dit",
        )

    def num_layers(self, model: DenoiserLoss) -> int:
        return denoiser_depth(model).num_layers

    def build_optimizer(self, ctx: TaskContext, model: DenoiserLoss) -> torch.optim.Optimizer:
        """The run's AdamW (`colo.apps.train.optim.build_optimizer`: ``optimizer.fused``, decay / no-decay groups,
        layer-wise LR decay over the UNet's blocks by `UNetDepth`, the DiT's by `DiTDepth`)."""
        from ..train.optim import build_optimizer

        depth = denoiser_depth(model)
        return build_optimizer(
            model, self.config.optimizer, num_layers=depth.num_layers, depth=depth, device=ctx.device
        )

    def example_batch(self, ctx: TaskContext) -> dict:
        """Step 0's rows of the first data rank: chunk-packing plugins (Zero, Gemini) pack in the order the UNet
        runs (diffusers registers blocks in another order)."""
        data_ranks = ctx.plugin.mesh_shape(ctx.world_size).get("dp", 1)
        return self._batch(ctx, 0, rank=0, num_ranks=data_ranks)

    def build_data(self, ctx: TaskContext):
        """The captioned images (every rank holds them all; a step's batch picks this rank's rows), and the EMA of
        the boosted weights (this is the first hook after boosting)."""
        section = self.section
        if section.ema_decay is not None:
            self.ema = ShardedEMA(
                ctx.booster, decay=section.ema_decay, use_ema_warmup=section.ema_warmup, power=section.ema_power
            )
        return self.dataset

    def describe(self, ctx: TaskContext) -> list[str]:
        config, section = self.config, self.section
        unet = "UNet (" + (section.unet_from or f"channels {section.unet_channels}") + ")"
        if section.denoiser == "dit":
            dit = section.dit_config_object()
            tokens = (dit.sample_size // dit.patch_size) ** 2
            frames = (
                f"{section.num_frames} frames x {tokens} = {section.num_frames * tokens}"
                if section.num_frames > 1
                else tokens
            )
            unet = (
                f"DiT ({dit.num_layers} x {dit.hidden_size}, {dit.num_attention_heads} heads, patch {dit.patch_size}, "
                f"{frames} tokens)"
            )
        lora = f", LoRA r={config.lora.r}" if config.lora.enabled else ""
        cached = ", latents cached" if self.latents is not None else ""
        snr = f", Min-SNR {section.snr_gamma:g}" if section.snr_gamma else ""
        ema = f"EMA decay {section.ema_decay:g}" if section.ema_decay is not None else "no EMA"
        objective = section.prediction_type
        if section.objective == "flow_matching":
            objective = (
                f"flow matching ({section.timestep_sampling} timesteps, {section.loss_weighting} weighting, "
                f"shift {section.flow_shift:g})"
            )
        return [
            f"model: {unet}, {self._num_parameters / 1e6:.3f}M parameters ({self._num_trainable / 1e6:.3f}M "
            f"trainable{lora}) | data: {len(self.dataset)} {'clips' if section.num_frames > 1 else 'images'} of "
            f"{section.image_size} px, "
            f"{config.data.global_batch_size} per step{cached}",
            f"objective: {objective}{snr} | {ema}",
        ]

    # --- the step -------------------------------------------------------------------------------------------------

    def _batch(self, ctx: TaskContext, step: int, *, rank: int, num_ranks: int) -> dict:
        """Data rank ``rank``'s rows (of ``num_ranks``) of the global batch of ``step``: a function of the step alone
        (exact resume)."""
        size, n, seed = self.config.data.global_batch_size, len(self.dataset), self.config.seed
        epoch, first = divmod(step * size, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        order += torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch + 1)).tolist()
        indices = order[first : first + size]
        per_rank = size // num_ranks
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        if self.latents is not None:  # cached posterior statistics; the builder draws the latent sample
            mean, std = self.latents.rows(indices[rows])
            captions = [self.dataset.caption(i) for i in indices[rows]]
            mean, std = mean.to(ctx.device), std.to(ctx.device)
            return self.builder(
                step=step, captions=captions, latent_mean=mean, latent_std=std, rows=rows, global_rows=size
            )
        images = collate([self.dataset[i] for i in indices[rows]])
        pixels = images["pixel_values"].to(ctx.device)
        return self.builder(step=step, captions=images["caption"], pixel_values=pixels, rows=rows, global_rows=size)

    def step_batch(self, ctx: TaskContext, step: int) -> dict:
        """This rank's rows of the global batch of ``step``."""
        group = ctx.sample_group
        return self._batch(ctx, step, rank=group.rank, num_ranks=group.size)

    def train_step(self, ctx: TaskContext, step: int):
        """One step on `step_batch`, then the EMA update; counts this rank's images."""
        outcome = ctx.booster.train_step(self.step_batch(ctx, step))
        if self.ema is not None:
            self.ema.step()
        return outcome, self.config.data.global_batch_size // ctx.sample_group.size

    def throughput(self, ctx: TaskContext, *, units: int, seconds: float) -> dict[str, float]:
        """``images_per_s`` over all data ranks."""
        return {"images_per_s": units * ctx.sample_group.size / seconds}

    # --- samples --------------------------------------------------------------------------------------------------

    def evaluate(self, ctx: TaskContext, step: int) -> None:
        """A sample grid (`sample_grid`); there is no held-out loss."""
        self._write_grid(ctx, step)
        return None

    def finish(self, ctx: TaskContext, *, final_checkpoint: str | None) -> str | None:
        """The sample grid of the last step (rank 0's path; ``None`` on the others): evaluation's at that step, else
        a new one when the run evaluates at all (``eval.every_steps``)."""
        last = self.config.schedule.total_steps
        if ctx.rank == 0 and self.ema is not None:
            self._prune_emas()
        if self._grid is None or self._grid[0] != last:
            if not self.config.eval.every_steps:
                return None
            self._write_grid(ctx, last)
        return self._grid[1]

    def _write_grid(self, ctx: TaskContext, step: int) -> None:
        path = self.sample_grid(ctx, step)
        self._grid = (step, path)
        if path:
            ctx.log.print(f"samples at step {step}: {path}")
            ctx.log.log_sample_image("samples", path, step)

    def sample_grid(self, ctx: TaskContext, step: int) -> str | None:
        """Every rank gathers the EMA (or, without one, the weights; a collective); rank 0 samples the fixed prompts
        and seeds and writes ``output_dir/samples/step-N.png`` (and the grid to TensorBoard). Returns its path on rank
        0, ``None`` elsewhere."""
        from .sampling import build_pipeline, sample_flow_images, sample_images

        if self.ema is not None:
            averaged = self.ema.full(to_rank=0)
        elif ctx.plugin.mesh_shape(ctx.world_size).get("tp", 1) > 1:  # tensor-parallel shards: gathered by name
            averaged = full_weights(ctx.booster.engine, to_rank=0)
        else:
            averaged = ctx.booster.full_state_dict(to_rank=0)
        if ctx.rank != 0:
            return None
        config, section = self.config, self.section
        seeds = list(range(section.samples_per_prompt))
        if section.denoiser == "dit" and section.num_frames > 1:  # one clip a row, its frames left to right
            clips = self._sample_video(ctx, averaged, seeds)
            return self._save_grid(ctx, step, frames_as_images(clips), columns=section.num_frames)
        if section.denoiser == "dit":
            return self._save_grid(ctx, step, self._sample_dit(ctx, averaged, seeds), columns=len(seeds))
        unet = initial_unet(config)  # a LoRA run's frozen base is still this one
        if config.lora.enabled:
            add_unet_lora(unet, **lora_settings(config.lora))
        state = {name.removeprefix("unet."): value for name, value in averaged.items()}
        missing = set(state) - set(unet.state_dict())
        if missing:
            raise KeyError(f"the averaged weights name parameters the UNet does not have: {sorted(missing)[:3]}")
        unet.load_state_dict(state, strict=not config.lora.enabled)
        if section.objective == "flow_matching":
            images = sample_flow_images(
                unet=unet.eval().to(ctx.device),
                vae=self.vae if self.vae is not None else load_vae(config).to(ctx.device),
                text_encoder=self.text_encoder,
                tokenizer=self.tokenizer,
                objective=self.objective,
                prompts=section.sample_prompts,
                seeds=seeds,
                steps=section.sample_steps,
                guidance_scale=section.guidance_scale,
                size=section.image_size,
            )
            return self._save_grid(ctx, step, images, columns=len(seeds))
        pipeline = build_pipeline(
            unet=unet.eval().to(ctx.device),
            vae=self.vae if self.vae is not None else load_vae(config).to(ctx.device),  # cached latents: loaded
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            objective=self.objective,
        )
        pipeline.set_progress_bar_config(disable=True)
        images = sample_images(
            pipeline,
            section.sample_prompts,
            seeds=seeds,
            steps=section.sample_steps,
            guidance_scale=section.guidance_scale,
            size=section.image_size,
        )
        return self._save_grid(ctx, step, images, columns=len(seeds))

    def _sample_dit(self, ctx: TaskContext, averaged: dict, seeds: list[int]) -> torch.Tensor:
        """The grid's images from the averaged DiT weights: diffusers' ``PixArtTransformer2DModel`` holding them, in
        the ``PixArtAlphaPipeline`` the export writes (`pixart_pipeline`), so the grid shows what the export samples."""
        from .sampling import pixart_pipeline, pixart_transformer, sample_images

        section = self.section
        state = {name.removeprefix("transformer."): value for name, value in averaged.items()}
        pipeline = pixart_pipeline(
            transformer=pixart_transformer(section.dit_config_object(), state).to(ctx.device),
            vae=self.vae if self.vae is not None else load_vae(self.config).to(ctx.device),
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            objective=self.objective,
        )
        pipeline.set_progress_bar_config(disable=True)
        return sample_images(
            pipeline,
            section.sample_prompts,
            seeds=seeds,
            steps=section.sample_steps,
            guidance_scale=section.guidance_scale,
            size=section.image_size,
        )

    def _sample_video(self, ctx: TaskContext, averaged: dict, seeds: list[int]) -> torch.Tensor:
        """Clips from the averaged DiT weights (no diffusers pipeline samples video): colo's transformer holding them,
        Euler flow steps (`sample_flow_video`)."""
        from ..models.dit import DiffusionTransformer
        from .sampling import sample_flow_video

        section = self.section
        transformer = DiffusionTransformer(section.dit_config_object())
        transformer.load_state_dict({name.removeprefix("transformer."): value for name, value in averaged.items()})
        return sample_flow_video(
            transformer=transformer.eval().to(ctx.device),
            vae=self.vae if self.vae is not None else load_vae(self.config).to(ctx.device),
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            objective=self.objective,
            prompts=section.sample_prompts,
            seeds=seeds,
            steps=section.sample_steps,
            guidance_scale=section.guidance_scale,
            size=section.image_size,
            num_frames=section.num_frames,
        )

    def _save_grid(self, ctx: TaskContext, step: int, images: torch.Tensor, *, columns: int) -> str:
        """Rank 0: ``output_dir/samples/step-N.png`` of ``images`` (and the grid to TensorBoard); its path."""
        from .sampling import grid_tensor, save_grid

        path = save_grid(
            images, os.path.join(self.config.output_dir, "samples", f"step-{step:08d}.png"), columns=columns
        )
        if ctx.log.writer is not None:
            ctx.log.writer.add_image("samples", grid_tensor(images, columns=columns), step)
        return path

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def run_metadata(self, ctx: TaskContext) -> dict:
        """Where the run's VAE and caption tokenizer are (`colo.apps.diffusion.export` and sampling read them)."""
        out = self.config.output_dir
        return {
            "vae_dir": os.path.abspath(os.path.join(out, "vae")),
            "tokenizer_dir": os.path.abspath(os.path.join(out, "tokenizer")),
        }

    def save_beside(self, ctx: TaskContext, step: int, path: str) -> None:
        """The EMA of the checkpoint ``path`` (``<checkpoint dir>/step-N``) to ``<checkpoint dir>/ema/step-N``, saved
        (every rank; committed by its own rename) before the checkpoint starts, so every committed checkpoint has
        its EMA, however the run ends. Rank 0 then drops the averages of checkpoints the trainer pruned."""
        if self.ema is None:
            return
        target = ema_checkpoint(path)
        if ctx.rank == 0:
            prune_checkpoints(os.path.dirname(target), None)  # partial EMA saves of a run killed while writing
            if os.path.isdir(target):  # written by a run that died before this step's checkpoint committed
                shutil.rmtree(target)
        barrier()
        self.ema.save(target)
        if ctx.rank == 0:
            self._prune_emas()

    def _prune_emas(self) -> None:
        """Rank 0: delete the averages older than the oldest committed checkpoint (those the trainer pruned); the
        newer ones belong to a committed checkpoint or to the one being written."""
        root = self.config.checkpoint_dir
        kept = committed_checkpoints(root)
        if not kept:
            return
        for step, path in committed_checkpoints(os.path.join(root, EMA_DIR)):
            if step < kept[0][0]:
                shutil.rmtree(path, ignore_errors=True)

    def after_resume(self, ctx: TaskContext, path: str, step: int) -> None:
        """The EMA of the checkpoint resumed from (`save_beside`)."""
        if self.ema is None:
            return
        averaged = ema_checkpoint(path)
        if not os.path.isfile(os.path.join(averaged, "index.json")):
            raise ValueError(
                f"{path} has no EMA ({averaged}); resume without one (diffusion.ema_decay=null) or from a checkpoint "
                "of a run that kept it"
            )
        self.ema.load(averaged)
