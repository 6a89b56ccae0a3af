"""``data.task: diffusion``: the trainer loop of the text-to-image recipe, with colo's checkpoints, resume, metrics,
the sharded EMA, and a sample grid (EMA weights, fixed prompts and seeds) at every eval."""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist

from colo.comm import init_distributed

from ..booster import Booster
from ..train.metrics import MetricsLogger, format_bytes, memory_bytes, step_line
from ..train.optim import build_scheduler
from ..train.state import checkpoint_path, pick_device, prune_checkpoints, resolve_resume
from .data import ImageCaptionFolder, ShapesDataset, caption_vocabulary, collate
from .ema import ShardedEMA
from .latent_cache import CACHE_DIR, build_latent_cache
from .lora import add_unet_lora, lora_settings
from .models import build_text_encoder, build_unet, build_vae, require_diffusers, save_caption_tokenizer
from .objective import DenoiserLoss, DiffusionBatchBuilder

RUN_KEY = "diffusion_run"
EMA_DIR = "ema"


def build_dataset(section):
    """The run's captioned images: an image folder (``diffusion.image_dir``) or the procedural shapes."""
    if section.image_dir is not None:
        return ImageCaptionFolder(section.image_dir, resize=section.resize)
    return ShapesDataset(section.num_images, image_size=section.image_size)


def captions_vocabulary(dataset) -> list[str]:
    if isinstance(dataset, ShapesDataset):
        return caption_vocabulary()
    return sorted({w for _, text in dataset.records for w in text.lower().split()})


def load_vae(config):
    """The run's frozen VAE: ``diffusion.vae_from``, the one pre-trained into ``output_dir/vae``, or the seeded one."""
    section, vae_dir = config.diffusion, os.path.join(config.output_dir, "vae")
    if section.vae_from is not None or os.path.isdir(vae_dir):
        vae = require_diffusers().AutoencoderKL.from_pretrained(section.vae_from or vae_dir)
    else:
        vae = build_vae(section.model_config_object(), seed=config.seed + 2)
    return vae.requires_grad_(False).eval()


def initial_unet(config):
    """The denoiser before training: ``diffusion.unet_from`` or built from the sizes (seeded); without adapters;
    with gradient checkpointing when ``diffusion.gradient_checkpointing`` (active only in training with grads)."""
    section = config.diffusion
    if section.unet_from is not None:
        unet = require_diffusers().UNet2DConditionModel.from_pretrained(section.unet_from)
    else:
        unet = build_unet(section.model_config_object(), seed=config.seed + 3)
    if section.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return unet


def frozen_components(config, *, rank: int, world_size: int):
    """``(tokenizer, text_encoder, vae, dataset)``: the tokenizer and a pre-trained VAE are written to
    ``output_dir`` by rank 0 (reused on resume) and read by every rank."""
    section, out = config.diffusion, config.output_dir
    model_config = section.model_config_object()
    dataset = build_dataset(section)
    tokenizer_dir, vae_dir = os.path.join(out, "tokenizer"), os.path.join(out, "vae")
    if rank == 0:  # the run's tokenizer lives in output_dir/tokenizer (the export and the grids read it there)
        if section.tokenizer_from is not None:
            from transformers import CLIPTokenizer

            CLIPTokenizer.from_pretrained(section.tokenizer_from).save_pretrained(tokenizer_dir)
        else:
            save_caption_tokenizer(captions_vocabulary(dataset), tokenizer_dir, max_length=section.max_caption_tokens)
        if section.vae_from is None and section.vae_pretrain_steps and not os.path.isdir(vae_dir):
            from .vae_pretrain import pretrain_vae

            vae = build_vae(model_config, seed=config.seed + 2)
            pretrain_vae(vae, dataset, steps=section.vae_pretrain_steps, lr=section.vae_lr, seed=config.seed)
            vae.save_pretrained(vae_dir + ".tmp")
            os.replace(vae_dir + ".tmp", vae_dir)
    if world_size > 1:
        dist.barrier()
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_dir)
    text_encoder = build_text_encoder(
        model_config, tokenizer, seed=config.seed + 1, pretrained=section.text_encoder_from
    )
    check_text_side(tokenizer, text_encoder, section)
    return tokenizer, text_encoder, load_vae(config), dataset


def check_text_side(tokenizer, text_encoder, section) -> None:
    """A pretrained text encoder needs its own tokenizer (vocabulary, maximum length): refuse a mismatch."""
    text = text_encoder.config
    if len(tokenizer) > text.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the text encoder ({section.text_encoder_from or 'built'}) "
            f"embeds {text.vocab_size}; set diffusion.tokenizer_from to the CLIPTokenizer directory the encoder was "
            "trained with (e.g. the tokenizer/ beside a pipeline's text_encoder/)"
        )
    if tokenizer.model_max_length > text.max_position_embeddings:
        raise ValueError(
            f"the tokenizer pads captions to {tokenizer.model_max_length} tokens but the text encoder has "
            f"{text.max_position_embeddings} positions; use the encoder's own tokenizer (diffusion.tokenizer_from)"
        )


def check_cross_attention(unet, text_encoder) -> None:
    """The UNet attends to the text encoder's hidden states: their widths must agree."""
    width, expected = text_encoder.config.hidden_size, unet.config.cross_attention_dim
    if width != expected:
        raise ValueError(
            f"the text encoder's hidden_size is {width} but the UNet's cross_attention_dim is {expected}; set "
            "diffusion.text_hidden_size (or diffusion.unet_config.cross_attention_dim) to the encoder's width"
        )


class DiffusionTrainer:
    """Trains the denoiser of ``config`` (``data.task: diffusion``) under ``config.plugin``; see the README."""

    def __init__(self, config) -> None:
        self.config = config
        section = config.diffusion
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        plugin = config.plugin.build(num_microbatches=config.schedule.num_microbatches, seed=config.seed)
        self.booster = Booster(plugin)
        mesh = plugin.build_mesh()
        self.dp_size = mesh.size("dp")
        self.dp_rank = mesh.rank("dp")
        batch = config.data.global_batch_size
        if batch % (self.dp_size * config.schedule.num_microbatches):
            raise ValueError(
                f"data.global_batch_size={batch} must divide by dp={self.dp_size} x schedule.num_microbatches="
                f"{config.schedule.num_microbatches}"
            )
        self.objective = section.objective()
        self.device = pick_device(config.device)
        self.tokenizer, self.text_encoder, vae, self.dataset = frozen_components(
            config, rank=self.rank, world_size=self.world_size
        )
        # the frozen encoders run where the denoiser does, in fp32 (they are not boosted; the VAE's fingerprint and
        # the cached latents stay those of its fp32 weights)
        self.text_encoder, vae = self.text_encoder.to(self.device), vae.to(self.device)
        self.latents = None
        if section.cache_latents:  # encode once; training then holds no VAE (sample_grid loads it)
            self.latents = build_latent_cache(
                os.path.join(config.output_dir, CACHE_DIR),
                self.dataset,
                vae,
                rank=self.rank,
                world_size=self.world_size,
            )
            vae = None
        self.vae = vae
        self.builder = DiffusionBatchBuilder(
            self.objective,
            tokenizer=self.tokenizer,
            text_encoder=self.text_encoder,
            vae=self.vae,
            seed=config.seed,
            scaling_factor=self.latents.scaling_factor if self.latents is not None else None,
        )
        self.unet = initial_unet(config)
        check_cross_attention(self.unet, self.text_encoder)
        self.unet.to(self.device)
        if config.lora.enabled:
            torch.manual_seed(config.seed)  # the same adapters on every rank (boost also broadcasts rank 0's)
            add_unet_lora(self.unet, **lora_settings(config.lora))
        mixed = plugin.compute_dtype if plugin.compute_dtype != torch.float32 else None
        model = DenoiserLoss(self.unet, compute_dtype=mixed)
        opt = config.optimizer
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        scheduler = build_scheduler(optimizer, config.schedule, peak_lr=opt.lr)
        # chunk-packing plugins (Zero, Gemini) pack in the order the UNet runs, learnt from step 0's batch (a pure
        # function of the step): diffusers registers blocks in another order
        example = self.step_batch(0) if plugin.packs_chunks else None
        self.booster.boost(model, optimizer, lr_scheduler=scheduler, example_batch=example)
        self.ema = None
        if section.ema_decay is not None:
            self.ema = ShardedEMA(
                self.booster, decay=section.ema_decay, use_ema_warmup=section.ema_warmup, power=section.ema_power
            )
        self.root = config.checkpoint.dir or os.path.join(config.output_dir, "checkpoints")

    # --- data -----------------------------------------------------------------------------------------------

    def step_batch(self, step: int) -> dict:
        """This rank's rows of the global batch of ``step``: a function of the step alone (exact resume)."""
        size, n = self.config.data.global_batch_size, len(self.dataset)
        epoch, first = divmod(step * size, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed + epoch)).tolist()
        order += torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed + epoch + 1)).tolist()
        indices = order[first : first + size]
        per_rank = size // self.dp_size
        rows = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        if self.latents is not None:  # cached posterior statistics; the builder draws the latent sample
            mean, std = self.latents.rows(indices[rows])
            captions = [self.dataset.caption(i) for i in indices[rows]]
            mean, std = mean.to(self.device), std.to(self.device)
            return self.builder(
                step=step, captions=captions, latent_mean=mean, latent_std=std, rows=rows, global_rows=size
            )
        images = collate([self.dataset[i] for i in indices[rows]])
        pixels = images["pixel_values"].to(self.device)
        return self.builder(step=step, captions=images["caption"], pixel_values=pixels, rows=rows, global_rows=size)

    # --- checkpoints ------------------------------------------------------------------------------------------

    def save(self, step: int) -> str:
        """The Booster's checkpoint of ``step`` with the EMA inside it (``<checkpoint>/ema``, the common format).

        The EMA is written first beside it and moved in once the checkpoint committed, so a run killed in between
        finds it on resume."""
        path = checkpoint_path(self.root, step)
        staged = os.path.join(self.root, f".ema-step-{step:08d}")
        if self.ema is not None:
            if self.rank == 0 and os.path.exists(staged):
                shutil.rmtree(staged)
            if self.world_size > 1:
                dist.barrier()
            self.ema.save(staged)
        run = {
            "step": step,
            "config": self.config.model_dump(mode="json"),
            "vae_dir": os.path.abspath(os.path.join(self.config.output_dir, "vae")),
            "tokenizer_dir": os.path.abspath(os.path.join(self.config.output_dir, "tokenizer")),
        }
        self.booster.save(path, metadata={"step": step, RUN_KEY: run})
        if self.rank == 0:
            if self.ema is not None:
                os.replace(staged, os.path.join(path, EMA_DIR))
            prune_checkpoints(self.root, self.config.checkpoint.keep_last)
        if self.world_size > 1:
            dist.barrier()
        return path

    def resume(self) -> int:
        if self.config.checkpoint.resume == "auto" and self.rank == 0:  # partial saves an earlier run left
            prune_checkpoints(self.root, None)
        path = resolve_resume(self.config.checkpoint.resume, self.root)
        if path is None:
            return 0
        metadata = self.booster.load(path)
        step = int(metadata.get("step", self.booster.step_count))
        if self.ema is not None:
            ema_path = os.path.join(path, EMA_DIR)
            staged = os.path.join(self.root, f".ema-step-{step:08d}")
            if self.rank == 0 and not os.path.isdir(ema_path) and os.path.isdir(staged):
                os.replace(staged, ema_path)  # killed between the commit and the move
            if self.world_size > 1:
                dist.barrier()
            if not os.path.isdir(ema_path):
                raise ValueError(f"{path} holds no EMA ({ema_path}); resume without EMA (diffusion.ema_decay=null)")
            self.ema.load(ema_path)
        return step

    # --- samples ----------------------------------------------------------------------------------------------

    def sample_grid(self, step: int) -> str | None:
        """Every rank gathers the EMA (a collective); rank 0 samples the fixed prompts and seeds and writes a PNG."""
        from .sampling import build_pipeline, sample_images, save_grid

        averaged = self.ema.full(to_rank=0) if self.ema is not None else None
        if averaged is None:
            model = self.booster.engine.optimizer
            averaged = (
                model.full_params()
                if hasattr(model, "full_params")
                else {n: p.detach().clone() for n, p in self.booster.unwrap().named_parameters()}
            )
        if self.rank != 0:
            return None
        section = self.config.diffusion
        unet = initial_unet(self.config)  # a LoRA run's frozen base is still this one
        if self.config.lora.enabled:
            add_unet_lora(unet, **lora_settings(self.config.lora))
        state = {name.removeprefix("unet."): value for name, value in averaged.items()}
        missing = set(state) - set(unet.state_dict())
        if missing:
            raise KeyError(f"the averaged weights name parameters the UNet does not have: {sorted(missing)[:3]}")
        unet.load_state_dict(state, strict=not self.config.lora.enabled)
        pipeline = build_pipeline(
            unet=unet.eval().to(self.device),
            vae=self.vae if self.vae is not None else load_vae(self.config).to(self.device),  # cached latents: loaded
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            objective=self.objective,
        )
        pipeline.set_progress_bar_config(disable=True)
        seeds = list(range(section.samples_per_prompt))
        images = sample_images(
            pipeline,
            section.sample_prompts,
            seeds=seeds,
            steps=section.sample_steps,
            guidance_scale=section.guidance_scale,
            size=section.image_size,
        )
        path = save_grid(
            images, os.path.join(self.config.output_dir, "samples", f"step-{step:08d}.png"), columns=len(seeds)
        )
        if self.log.writer is not None:
            from .sampling import grid_tensor

            self.log.writer.add_image("samples", grid_tensor(images, columns=len(seeds)), step)
        return path

    # --- the loop ---------------------------------------------------------------------------------------------

    def fit(self) -> dict:
        config = self.config
        start = self.resume()
        total = config.schedule.stop_at_step or config.schedule.total_steps
        logging = config.logging
        self.log = MetricsLogger(
            config.output_dir,
            total_steps=config.schedule.total_steps,
            start_step=start,
            jsonl=logging.jsonl,
            tensorboard=logging.tensorboard,
            progress_bar=logging.progress_bar,
            enabled=self.rank == 0,
        )
        losses, grids, device = [], [], self.device
        self.log.print(
            f"colo train: {config.name} | {self.world_size} process(es) on {device.type} | plugin {config.plugin.name} "
            f"({config.plugin.precision}) | diffusion, {len(self.dataset)} images of {config.diffusion.image_size} px, "
            f"{config.data.global_batch_size} per step"
        )
        began = time.perf_counter()
        saved = None
        for step in range(start, total):
            result = self.booster.train_step(self.step_batch(step))
            if self.ema is not None:
                self.ema.step()
            losses.append(result.loss)
            done = step + 1
            self.log.advance(done, f"loss {result.loss:.4f}")
            if done % logging.every_steps == 0 or done == total:
                elapsed = time.perf_counter() - began
                memory, _ = memory_bytes(device)
                record = {
                    "step": done,
                    "loss": result.loss,
                    "lr": result.lr,
                    "grad_norm": result.grad_norm,
                    "images_per_s": len(losses) * config.data.global_batch_size / elapsed,
                    "memory": memory,
                }
                self.log.log(record)
                self.log.print(step_line(record, total_steps=config.schedule.total_steps))
            if config.eval.every_steps and done % config.eval.every_steps == 0:
                path = self.sample_grid(done)
                if path:
                    grids.append(path)
                    self.log.print(f"samples at step {done}: {path}")
            every = config.checkpoint.every_steps
            if config.checkpoint.enabled and (
                (every and done % every == 0) or (done == config.schedule.total_steps and config.checkpoint.save_final)
            ):
                saved = self.save(done)
        if losses:
            memory, what = memory_bytes(device)
            self.log.print(
                f"done: steps {start + 1}-{start + len(losses)} in {time.perf_counter() - began:.1f} s | loss "
                f"{losses[0]:.4f} -> {losses[-1]:.4f} | {what} {format_bytes(memory)} | last checkpoint "
                f"{saved or 'none'}" + (f" | last samples {grids[-1]}" if grids else "")
            )
        else:
            self.log.print("no steps run (the checkpoint is already at the end; raise schedule.total_steps to go on)")
        self.log.close()
        return {"losses": losses, "start_step": start, "grids": grids}


def train_diffusion(config) -> dict:
    """Run `DiffusionTrainer(config).fit()` (every rank)."""
    return DiffusionTrainer(config).fit()
