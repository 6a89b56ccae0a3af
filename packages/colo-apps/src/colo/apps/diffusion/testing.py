"""Tiny, seeded components of the diffusion recipe for tests and benchmarks: the same in every process."""

from __future__ import annotations

import os
import tempfile

GLOBAL_BATCH, LR, SEED = 4, 1e-3, 0
TINY_DIT = {"dit_layers": 2, "dit_heads": 2, "dit_head_dim": 16, "dit_patch_size": 2}
"""The DiT sizes of `tiny_run_config` with ``denoiser="dit"``: 2 blocks of 32 wide, 16 tokens of the 8 x 8 latent."""


def tiny_config():
    from colo.apps.diffusion import DiffusionModelConfig

    return DiffusionModelConfig(
        image_size=16,
        unet_channels=(8, 16),
        attention_head_dim=8,
        norm_num_groups=4,
        text_hidden_size=16,
        text_layers=1,
        text_heads=2,
        max_caption_tokens=16,
        vae_channels=(8, 8),
    )


def components(seed: int = SEED):
    """``(config, tokenizer, text_encoder, vae, unet)``, the same in every process."""
    from colo.apps.diffusion import (
        build_text_encoder,
        build_unet,
        build_vae,
        caption_vocabulary,
        save_caption_tokenizer,
    )

    config = tiny_config()
    directory = os.path.join(tempfile.gettempdir(), f"colo-diffusion-tokenizer-{os.getpid()}")
    tokenizer = save_caption_tokenizer(caption_vocabulary(), directory, max_length=config.max_caption_tokens)
    text_encoder = build_text_encoder(config, tokenizer, seed=seed + 1)
    vae = build_vae(config, seed=seed + 2).requires_grad_(False).eval()
    unet = build_unet(config, seed=seed + 3)
    return config, tokenizer, text_encoder, vae, unet


def step_images(step: int):
    """The global batch of step ``step``: images ``4 * step ...`` of the procedural set."""
    from colo.apps.diffusion import ShapesDataset, collate

    dataset = ShapesDataset(64, image_size=16, seed=0)
    return collate([dataset[(GLOBAL_BATCH * step + i) % len(dataset)] for i in range(GLOBAL_BATCH)])


def tiny_run_config(
    output_dir: str,
    *,
    lora: dict | None = None,
    plugin: dict | None = None,
    schedule: dict | None = None,
    checkpoint_every: int = 3,
    **diffusion,
):
    """The run config of a tiny 2-process ZeRO-2 ``data.task: diffusion`` run of 3 steps (no VAE pre-training, no
    evals, a checkpoint every ``checkpoint_every`` steps; ``denoiser="dit"``: the `TINY_DIT` sizes instead of the
    UNet's); ``diffusion`` fields override the section's, ``lora`` fills
    the lora section, ``plugin`` replaces the plugin section, ``schedule`` fields override the schedule's."""
    from colo.apps.train.config import RunConfig

    return RunConfig(
        output_dir=output_dir,
        seed=SEED,
        plugin=plugin or {"name": "zero", "stage": 2},
        optimizer={"lr": LR, "weight_decay": 0.0},
        schedule={"total_steps": 3, "warmup_steps": 1, **(schedule or {})},
        data={"task": "diffusion", "global_batch_size": GLOBAL_BATCH},
        checkpoint={"every_steps": checkpoint_every, "resume": "auto"},
        logging={"every_steps": 1, "tensorboard": False, "progress_bar": False},
        lora=lora or {},
        diffusion={
            **(TINY_DIT if diffusion.get("denoiser") == "dit" else {"unet_channels": [8, 16]}),
            "norm_num_groups": 4,
            "text_hidden_size": 16,
            "text_layers": 1,
            "vae_channels": [8, 8],
            "num_images": 16,
            "ema_decay": 0.9,
            "prediction_type": "v_prediction",
            "condition_dropout": 0.2,
            "sample_prompts": ["a red circle on white"],
            "samples_per_prompt": 1,
            "sample_steps": 1,
            **diffusion,
        },
    )
