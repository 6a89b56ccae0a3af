"""Named run configs for ``colo train --preset NAME``: the CPU demo and Llama-shaped GPU recipes.

Each is the raw mapping a YAML file would hold; `colo.apps.train.load_config` validates it (tests check that all
of them validate). The GPU recipes follow common practice for their size (Llama-2 / TinyLlama hyperparameters:
AdamW lr 3e-4 (1b) to 1.5e-4 (70b), betas (0.9, 0.95), weight decay 0.1, 2000 warmup steps, cosine to 10%).
"""

from __future__ import annotations

RUN_PRESETS: dict[str, dict] = {
    # Text-to-image diffusion on CPU (2 processes, DDP): coloured shapes on backgrounds generated at run time, a tiny
    # AutoencoderKL trained first on those images (no pretrained VAE offline), then a small UNet conditioned on a
    # tiny CLIP text encoder, EMA, sample grids at every eval (colo.apps.diffusion).
    "tiny-diffusion": {
        "name": "tiny-diffusion",
        "output_dir": "runs/tiny-diffusion",
        "seed": 0,
        "plugin": {"name": "ddp", "precision": "fp32"},
        "optimizer": {"lr": 2e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
        "schedule": {"total_steps": 1500, "warmup_steps": 20, "min_lr": 2e-4},
        "data": {"task": "diffusion", "global_batch_size": 32},
        "checkpoint": {"every_steps": 500, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 20},
        "eval": {"every_steps": 500},
        "diffusion": {
            "image_size": 16,
            "unet_channels": [32, 64],
            "vae_channels": [16, 32],
            "num_images": 2048,
            "vae_pretrain_steps": 300,
            "condition_dropout": 0.1,
            "snr_gamma": 5.0,
            "ema_decay": 0.995,
            "sample_steps": 10,
            "guidance_scale": 3.0,
        },
    },
    # The same images, VAE and CLIP with colo's diffusion transformer (PixArt-alpha-style, colo.apps.models.dit:
    # 4 blocks of 128 wide, 4 heads of 32, 1 x 1 patches of the 8 x 8 latent: 64 tokens, 1.2M parameters) trained with
    # flow matching (logit-normal timesteps, no shift at this size); exported as a PixArtAlphaPipeline. 2 x 2 patches
    # (16 tokens) train ~2.5x faster but score lower (see the README).
    "tiny-dit": {
        "name": "tiny-dit",
        "output_dir": "runs/tiny-dit",
        "seed": 0,
        "plugin": {"name": "ddp", "precision": "fp32"},
        "optimizer": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
        "schedule": {"total_steps": 2500, "warmup_steps": 50, "min_lr": 1e-4},
        "data": {"task": "diffusion", "global_batch_size": 32},
        "checkpoint": {"every_steps": 500, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 20},
        "eval": {"every_steps": 500},
        "diffusion": {
            "denoiser": "dit",
            "dit_layers": 4,
            "dit_heads": 4,
            "dit_head_dim": 32,
            "dit_patch_size": 1,
            "objective": "flow_matching",
            "timestep_sampling": "logit_normal",
            "flow_shift": 1.0,
            "image_size": 16,
            "vae_channels": [16, 32],
            "num_images": 2048,
            "vae_pretrain_steps": 300,
            "condition_dropout": 0.1,
            "ema_decay": 0.995,
            "sample_steps": 10,
            "guidance_scale": 3.0,
        },
    },
    # Video on CPU (2 processes, Ulysses sp2): clips of 4 frames of tiny-dit's shapes moving left / right / up / down
    # ("a red circle moving left on blue"), each frame through the tiny VAE (pre-trained on the frames) into an 8 x 8
    # latent; the DiT (4 blocks of 128, 4 heads of 32, 2 x 2 patches: 4 frames x 16 = 64 tokens, full
    # spatial-temporal attention) trains with flow matching under HybridParallel sp=2: each rank holds half of every
    # clip's tokens, attention runs over all of them by Ulysses all-to-all. Sample grids: one clip a row. It trains
    # (loss 1.9 -> 0.28 in 1500 steps) but does not yet follow the prompt at 1500 steps (see the README's figures).
    "tiny-video-dit": {
        "name": "tiny-video-dit",
        "output_dir": "runs/tiny-video-dit",
        "seed": 0,
        "plugin": {"name": "hybrid", "sp": 2, "sp_mode": "ulysses", "zero_stage": 1, "precision": "fp32"},
        "optimizer": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
        "schedule": {"total_steps": 1500, "warmup_steps": 50, "min_lr": 1e-4},
        "data": {"task": "diffusion", "global_batch_size": 16},
        "checkpoint": {"every_steps": 500, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 20},
        "eval": {"every_steps": 500},
        "diffusion": {
            "denoiser": "dit",
            "num_frames": 4,
            "dit_layers": 4,
            "dit_heads": 4,
            "dit_head_dim": 32,
            "dit_patch_size": 2,
            "objective": "flow_matching",
            "timestep_sampling": "logit_normal",
            "flow_shift": 1.0,
            "image_size": 16,
            "vae_channels": [16, 32],
            "num_images": 2048,
            "vae_pretrain_steps": 300,
            "condition_dropout": 0.1,
            "ema_decay": 0.995,
            "sample_prompts": [
                "a red circle moving right on white",
                "a blue square moving down on black",
                "a green triangle moving left on gray",
                "a yellow circle moving up on blue",
            ],
            "samples_per_prompt": 2,
            "sample_steps": 10,
            "guidance_scale": 3.0,
        },
    },
    # The CPU demo (`make demo`): 2 processes, DDP, fp32, the byte tokenizer on the standard library's .py files.
    # ~2.2M parameters with the byte vocabulary; 300 steps of 16 x 128 tokens finish in a few minutes on 2 cores.
    "tiny-llama": {
        "name": "tiny-llama",
        "output_dir": "runs/tiny-llama",
        "seed": 0,
        "model": {"preset": "tiny-llama"},
        "plugin": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total_steps": 300, "warmup_steps": 30, "min_lr": 2e-4},
        "data": {"seq_len": 128, "global_batch_size": 16, "max_tokens": 4_000_000},
        "checkpoint": {"every_steps": 100, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 10},
        "eval": {"every_steps": 100, "num_sequences": 64, "batch_size": 16},
        "sample": {"prompt": "def ", "prompts": ["import ", "class "], "max_new_tokens": 80},
    },
    # Mixture of experts on CPU (2 processes): the MoE Llama (Mixtral-style, 8 experts top-2 on every layer) with its
    # experts split over ep=2 (tokens by all-to-all), ZeRO-2, fp32, on the same text as tiny-llama; the log shows the
    # router statistics (moe_*), and `colo convert --to hf` writes a Mixtral.
    "tiny-moe": {
        "name": "tiny-moe",
        "output_dir": "runs/tiny-moe",
        "seed": 0,
        "model": {
            "preset": "tiny-moe",
            "hidden_size": 128,
            "intermediate_size": 192,
            "num_hidden_layers": 4,
            "max_position_embeddings": 256,
            "num_local_experts": 8,
            "router_z_loss_coef": 1e-3,
        },
        "plugin": {"name": "expert", "ep": 2, "stage": 2, "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total_steps": 300, "warmup_steps": 30, "min_lr": 2e-4},
        "data": {"seq_len": 128, "global_batch_size": 16, "max_tokens": 4_000_000},
        "checkpoint": {"every_steps": 100, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 10},
        "eval": {"every_steps": 100, "num_sequences": 64, "batch_size": 16},
        "sample": {"prompt": "def ", "max_new_tokens": 80},
    },
    # DeepSeek-V3's shape on CPU (2 processes): tiny-deepseek's multi-head latent attention, dense first layer, shared
    # expert, 16 narrow experts (top-4) in two groups, one per ep rank (each token's rows go to one rank), sigmoid
    # routing with the aux-loss-free bias updated every step; ZeRO-2, fp32, on the same text as tiny-llama;
    # `colo convert --to hf` writes a DeepseekV3ForCausalLM.
    "tiny-deepseek": {
        "name": "tiny-deepseek",
        "output_dir": "runs/tiny-deepseek",
        "seed": 0,
        "model": {"preset": "tiny-deepseek", "router_z_loss_coef": 1e-3},
        "plugin": {"name": "expert", "ep": 2, "stage": 2, "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total_steps": 200, "warmup_steps": 20, "min_lr": 2e-4},
        "data": {"seq_len": 128, "global_batch_size": 16, "max_tokens": 4_000_000},
        "checkpoint": {"every_steps": 100, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 10},
        "eval": {"every_steps": 100, "num_sequences": 64, "batch_size": 16},
        "sample": {"prompt": "def ", "max_new_tokens": 80},
    },
    # Reward model on CPU (2 processes): the embedded preference set (a standard-library Python line chosen, its words
    # shuffled rejected, after the previous line), generated at run time. The recipe first SFTs the policy on the
    # chosen answers (preference.sft_steps, tiny-dpo's warm-up), saves it (runs/tiny-rm/sft-policy), then trains the
    # reward model from it: the policy's weights with a scalar head in place of lm_head, its own optimizer.
    "tiny-rm": {
        "name": "tiny-rm",
        "output_dir": "runs/tiny-rm",
        "seed": 0,
        "model": {"preset": "tiny", "num_hidden_layers": 4},
        "plugin": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"total_steps": 500, "warmup_steps": 20, "min_lr": 3e-4},
        "data": {"task": "rm", "seq_len": 80, "global_batch_size": 32},
        "preference": {"synthetic_records": 4000, "sft_steps": 200},
        "checkpoint": {"every_steps": 100, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 20},
        "eval": {"every_steps": 100, "num_sequences": 256, "batch_size": 32},
    },
    # DPO on CPU (2 processes), same data: the recipe first SFTs the policy on the chosen answers
    # (preference.sft_steps), then takes that policy as the frozen reference and runs DPO (sigmoid, beta 0.1).
    "tiny-dpo": {
        "name": "tiny-dpo",
        "output_dir": "runs/tiny-dpo",
        "seed": 0,
        "model": {"preset": "tiny", "num_hidden_layers": 4},
        "plugin": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"total_steps": 400, "warmup_steps": 20, "min_lr": 3e-4},
        "data": {"task": "dpo", "seq_len": 80, "global_batch_size": 32},
        "preference": {"synthetic_records": 4000, "sft_steps": 200, "loss_type": "sigmoid", "beta": 0.1},
        "checkpoint": {"every_steps": 100, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 20},
        "eval": {"every_steps": 100, "num_sequences": 256, "batch_size": 32},
        "sample": {"prompt": "for name in names:\n", "max_new_tokens": 40, "temperature": 0.0},
    },
    # GRPO on CPU (2 processes): integer addition prompts ('12+7=') generated at run time, reward 1 for the exact
    # answer. The recipe first SFTs the policy on the answers (grpo.sft_steps), then takes it as the frozen reference
    # and runs GRPO (8 completions per prompt, k3 KL, token-mean loss); evals report the held-out greedy exact match.
    "tiny-grpo": {
        "name": "tiny-grpo",
        "output_dir": "runs/tiny-grpo",
        "seed": 0,
        "model": {"preset": "tiny", "num_hidden_layers": 4},
        "plugin": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"total_steps": 300, "warmup_steps": 20, "min_lr": 3e-4},
        "data": {"task": "grpo", "seq_len": 12, "global_batch_size": 16},
        "grpo": {
            "synthetic_prompts": 400,
            "max_operand": 20,
            "group_size": 8,
            "max_prompt_len": 7,
            "max_new_tokens": 4,
            "sft_steps": 150,
            "beta": 0.04,
            "temperature": 1.0,
        },
        "checkpoint": {"every_steps": 50, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 10},
        "eval": {"every_steps": 50, "num_sequences": 80},
        "sample": {"prompt": "12+7=", "max_new_tokens": 4, "temperature": 0.0},
    },
    # GRPO with longer responses on CPU (2 processes, sequence parallel): tiny-grpo's addition prompts answered with a
    # worked solution in GSM8K's form ('12+9=' -> '2+9=11, 10+0=10, 10+11=21 #### 21', up to 34 tokens and eos: ~9x
    # tiny-grpo's answers), rewarded by the math-answer checker (the number after '####'). Both ranks are one
    # sequence-parallel pair (HybridParallel sp2, Ulysses): the update splits every rollout row between them and
    # gathers the per-token log-probs. 200 SFT steps at the schedule's LR (3e-3 cosine), then 150 GRPO steps (G = 8,
    # 16 prompts, sampled at 0.7: at 1.0 the sampled reward stayed ~0.2) at their own constant grpo.lr 3e-4
    # (rlhf/rl_lr.py). Measured (README): with the schedule's ~1.5e-3 -> 3e-4 the GRPO phase fell below the SFT
    # policy first and ended within noise of it (held-out greedy 0.375 -> 0.400); grpo.lr 1e-3 fell to 0.237 / 0.075
    # (seeds 0 / 1) at step 250; grpo.lr 3e-4 gains +0.200 / +0.125 / +0.225 / +0.163 / +0.213 over the post-SFT
    # value by step 350 (seeds 0-4; e.g. 0.375 -> 0.575).
    "tiny-grpo-long": {
        "name": "tiny-grpo-long",
        "output_dir": "runs/tiny-grpo-long",
        "seed": 0,
        "model": {"preset": "tiny", "num_hidden_layers": 4},
        "plugin": {"name": "hybrid", "sp": 2, "sp_mode": "ulysses", "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"total_steps": 350, "warmup_steps": 20, "min_lr": 3e-4},
        "data": {"task": "grpo", "seq_len": 44, "global_batch_size": 16},
        "grpo": {
            "synthetic_prompts": 400,
            "max_operand": 20,
            "synthetic_answer": "worked",
            "reward_functions": ["colo.apps.rlhf.math_answer:math_answer"],
            "group_size": 8,
            "max_prompt_len": 7,
            "max_new_tokens": 36,
            "sft_steps": 200,
            "lr": 3e-4,
            "beta": 0.04,
            "temperature": 0.7,
            "eval_samples": 4,
        },
        "checkpoint": {"every_steps": 50, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 10},
        "eval": {"every_steps": 50, "num_sequences": 80},
        "sample": {"prompt": "12+9=", "max_new_tokens": 36, "temperature": 0.0},
    },
    # PPO on CPU (2 processes): tiny-grpo's addition prompts and exact-answer rule reward, with a critic of its own
    # (started from the policy after the SFT warm-up, fresh value head), GAE (gamma 1, lambda 0.95), advantages
    # whitened over both ranks, a k1 KL penalty in the rewards with the adaptive controller; 150 SFT steps, then 450
    # PPO steps of 8 completions per prompt, 2 epochs x 2 minibatches each; evals report the held-out greedy exact
    # match.
    "tiny-ppo": {
        "name": "tiny-ppo",
        "output_dir": "runs/tiny-ppo",
        "seed": 0,
        "model": {"preset": "tiny", "num_hidden_layers": 4},
        "plugin": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"total_steps": 600, "warmup_steps": 20, "min_lr": 3e-4},
        "data": {"task": "ppo", "seq_len": 12, "global_batch_size": 16},
        "ppo": {
            "synthetic_prompts": 400,
            "max_operand": 20,
            "group_size": 8,
            "max_prompt_len": 7,
            "max_new_tokens": 4,
            "sft_steps": 150,
            "epochs": 2,
            "minibatches": 2,
            "critic": "separate",
            "critic_lr": 3e-3,
            "kl_coef": 0.05,
            "kl_controller": "adaptive",
            "kl_target": 1.0,
            "kl_horizon": 10000,
            "gamma": 1.0,
            "lam": 0.95,
            "value_clip": 0.2,
            "temperature": 1.0,
        },
        "checkpoint": {"every_steps": 50, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 10},
        "eval": {"every_steps": 50, "num_sequences": 80},
        "sample": {"prompt": "12+7=", "max_new_tokens": 4, "temperature": 0.0},
    },
    # Text-to-image at Stable Diffusion 1.5's size on 8 GPUs: a UNet2DConditionModel with SD-1.5's published config
    # (859.5M parameters, built and trained from the seed; diffusion.unet_from=<sd-1.5>/unet fine-tunes it instead),
    # conditioned on a frozen CLIP ViT-L/14 text encoder with its tokenizer, on the latents of SD's frozen VAE, all
    # three read from local directories (nothing downloads: point them at a StableDiffusionPipeline directory), and
    # captioned 512 x 512 images in diffusers' metadata.jsonl layout. ZeRO-2 dp8, bf16 compute with fp32 masters: each
    # rank keeps 1/8 of the masters, Adam moments and gradients (~1.3 GB) beside the bf16 weights; 256 images per
    # step as 4 microbatches of 8 per GPU. AdamW at SD's 1e-4 with diffusers' weight decay and clipping; EMA 0.9999.
    "sd15-diffusion": {
        "name": "sd15-diffusion",
        "output_dir": "runs/sd15-diffusion",
        "seed": 0,
        "plugin": {"name": "zero", "stage": 2, "precision": "bf16", "max_grad_norm": 1.0},
        "optimizer": {"lr": 1e-4, "betas": [0.9, 0.999], "weight_decay": 1e-2},
        "schedule": {"total_steps": 100_000, "warmup_steps": 5000, "min_lr": 1e-5, "num_microbatches": 4},
        "data": {"task": "diffusion", "global_batch_size": 256},
        "checkpoint": {"every_steps": 2000, "keep_last": 3, "resume": "auto"},
        "logging": {"every_steps": 50},
        "eval": {"every_steps": 5000},
        "diffusion": {
            "image_size": 512,
            "image_dir": "data/text-to-image",
            "resize": 512,
            "text_encoder_from": "pretrained/stable-diffusion-v1-5/text_encoder",
            "tokenizer_from": "pretrained/stable-diffusion-v1-5/tokenizer",
            "vae_from": "pretrained/stable-diffusion-v1-5/vae",
            "vae_channels": [128, 256, 512, 512],  # SD's VAE: 8x downsampling, 64 x 64 x 4 latents
            "unet_channels": [320, 640, 1280, 1280],
            "unet_layers_per_block": 2,
            "norm_num_groups": 32,
            "text_hidden_size": 768,
            "text_layers": 12,
            "text_heads": 12,
            "max_caption_tokens": 77,
            "unet_config": {  # SD-1.5's unet/config.json (diffusers names heads attention_head_dim)
                "sample_size": 64,
                "in_channels": 4,
                "out_channels": 4,
                "down_block_types": [
                    "CrossAttnDownBlock2D",
                    "CrossAttnDownBlock2D",
                    "CrossAttnDownBlock2D",
                    "DownBlock2D",
                ],
                "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
                "block_out_channels": [320, 640, 1280, 1280],
                "layers_per_block": 2,
                "attention_head_dim": 8,
                "cross_attention_dim": 768,
                "norm_num_groups": 32,
                "norm_eps": 1e-5,
                "act_fn": "silu",
                "center_input_sample": False,
                "downsample_padding": 1,
                "flip_sin_to_cos": True,
                "freq_shift": 0,
                "mid_block_scale_factor": 1,
            },
            "gradient_checkpointing": True,  # 512 px activations of 8 images per GPU; off: faster if memory allows
            "prediction_type": "epsilon",
            "snr_gamma": 5.0,
            "noise_offset": 0.0,
            "condition_dropout": 0.1,
            "ema_decay": 0.9999,
            "sample_prompts": [
                "a photograph of an astronaut riding a horse",
                "a red sports car parked on a city street at night",
                "a bowl of fruit on a wooden table, oil painting",
                "a snowy mountain lake at sunrise",
            ],
            "samples_per_prompt": 2,
            "sample_steps": 25,
            "guidance_scale": 7.5,
        },
    },
    # PixArt-alpha XL/2's transformer (28 blocks of 1152, 16 heads, patch 2, adaLN-single; ~607M parameters with
    # CLIP-L's 768-wide captions projected in) on SD-1.5's VAE latents at 512 px (64 x 64 x 4: 1024 tokens), flow
    # matching with logit-normal timesteps and a shift of 2 (SD3's resolution rule: sqrt(512^2 / 256^2)), DiT's
    # optimizer (AdamW 1e-4, no weight decay), 8 GPUs, ZeRO-2, bf16, the blocks checkpointed. Head size 72 is not one
    # colo's Triton attention takes: attention runs the torch reference there (18 heads of 64 would run the kernel).
    "pixart-dit": {
        "name": "pixart-dit",
        "output_dir": "runs/pixart-dit",
        "seed": 0,
        "plugin": {"name": "zero", "stage": 2, "precision": "bf16", "max_grad_norm": 1.0},
        "optimizer": {"lr": 1e-4, "betas": [0.9, 0.999], "weight_decay": 0.0},
        "schedule": {"total_steps": 400_000, "warmup_steps": 1000, "min_lr": 1e-4, "num_microbatches": 2},
        "data": {"task": "diffusion", "global_batch_size": 256},
        "checkpoint": {"every_steps": 2000, "keep_last": 3, "resume": "auto"},
        "logging": {"every_steps": 50},
        "eval": {"every_steps": 5000},
        "diffusion": {
            "denoiser": "dit",
            "dit_layers": 28,
            "dit_heads": 16,
            "dit_head_dim": 72,
            "dit_patch_size": 2,
            "image_size": 512,
            "image_dir": "data/text-to-image",
            "resize": 512,
            "text_encoder_from": "pretrained/stable-diffusion-v1-5/text_encoder",
            "tokenizer_from": "pretrained/stable-diffusion-v1-5/tokenizer",
            "vae_from": "pretrained/stable-diffusion-v1-5/vae",
            "vae_channels": [128, 256, 512, 512],
            "norm_num_groups": 32,
            "text_hidden_size": 768,
            "text_layers": 12,
            "text_heads": 12,
            "max_caption_tokens": 77,
            "gradient_checkpointing": True,
            "objective": "flow_matching",
            "timestep_sampling": "logit_normal",
            "flow_shift": 2.0,
            "condition_dropout": 0.1,
            "ema_decay": 0.9999,
            "sample_prompts": [
                "a photograph of an astronaut riding a horse",
                "a red sports car parked on a city street at night",
                "a bowl of fruit on a wooden table, oil painting",
                "a snowy mountain lake at sunrise",
            ],
            "sample_steps": 20,
            "guidance_scale": 4.5,
        },
    },
    # A PixArt-style DiT at Stable Diffusion 3 medium's size (~2.08B parameters), not SD3's MMDiT: SD3-medium is 24
    # joint blocks of 1536 with separate text and image weights (~2B); this is 24 PixArt blocks (self-attention,
    # cross-attention on the caption, MLP, adaLN-single) of 2304 (36 heads of 64, which colo's Triton attention takes),
    # on SD3's 16-channel VAE latents at 1024 px (128 x 128 x 16, patch 2: 4096 tokens) with one of SD3's text encoders
    # (CLIP-L, 768 wide, projected in; SD3 also reads CLIP-G and T5-XXL). Flow matching as SD3 trains it: logit-normal
    # timesteps, shift 3. 8 GPUs, ZeRO-3 bf16 (2.08B x 16 bytes of masters, moments and gradients over 8 ranks), the
    # blocks checkpointed. The VAE, text encoder and tokenizer are read from a local StableDiffusion3Pipeline directory.
    "sd3-medium-dit": {
        "name": "sd3-medium-dit",
        "output_dir": "runs/sd3-medium-dit",
        "seed": 0,
        "plugin": {"name": "zero", "stage": 3, "precision": "bf16", "max_grad_norm": 1.0},
        "optimizer": {"lr": 1e-4, "betas": [0.9, 0.999], "weight_decay": 0.0},
        "schedule": {"total_steps": 400_000, "warmup_steps": 1000, "min_lr": 1e-4, "num_microbatches": 4},
        "data": {"task": "diffusion", "global_batch_size": 256},
        "checkpoint": {"every_steps": 2000, "keep_last": 3, "resume": "auto"},
        "logging": {"every_steps": 50},
        "eval": {"every_steps": 5000},
        "diffusion": {
            "denoiser": "dit",
            "dit_layers": 24,
            "dit_heads": 36,
            "dit_head_dim": 64,
            "dit_patch_size": 2,
            "dit_config": {"in_channels": 16},  # SD3's VAE latents
            "image_size": 1024,
            "image_dir": "data/text-to-image",
            "resize": 1024,
            "text_encoder_from": "pretrained/stable-diffusion-3-medium/text_encoder",
            "tokenizer_from": "pretrained/stable-diffusion-3-medium/tokenizer",
            "vae_from": "pretrained/stable-diffusion-3-medium/vae",
            "vae_channels": [128, 256, 512, 512],  # SD3's VAE: 8x downsampling (its 16 latent channels: dit_config)
            "norm_num_groups": 32,
            "text_hidden_size": 768,
            "text_layers": 12,
            "text_heads": 12,
            "max_caption_tokens": 77,
            "gradient_checkpointing": True,
            "objective": "flow_matching",
            "timestep_sampling": "logit_normal",
            "flow_shift": 3.0,
            "condition_dropout": 0.1,
            "ema_decay": 0.9999,
            "sample_prompts": [
                "a photograph of an astronaut riding a horse",
                "a red sports car parked on a city street at night",
                "a bowl of fruit on a wooden table, oil painting",
                "a snowy mountain lake at sunrise",
            ],
            "sample_steps": 28,
            "guidance_scale": 5.0,
        },
    },
    # TinyLlama-1.1B's shape on 8 GPUs: tp2 x dp4, ZeRO-1, bf16; 2M tokens per step.
    "llama-1b": {
        "name": "llama-1b",
        "output_dir": "runs/llama-1b",
        "model": {"preset": "1b"},
        "plugin": {"name": "hybrid", "tp": 2, "zero_stage": 1, "precision": "bf16", "max_grad_norm": 1.0},
        "optimizer": {"lr": 4e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total_steps": 100_000, "warmup_steps": 2000, "min_lr": 4e-5, "num_microbatches": 4},
        "data": {"seq_len": 2048, "global_batch_size": 1024},
        "checkpoint": {"every_steps": 1000, "keep_last": 3},
        "eval": {"every_steps": 1000, "num_sequences": 512},
    },
    # Llama-2-7B on 32 GPUs: tp8 within a node x dp4, ZeRO-1, Megatron sequence parallelism, bf16; 4M tokens per step.
    "llama-7b": {
        "name": "llama-7b",
        "output_dir": "runs/llama-7b",
        "model": {"preset": "7b"},
        "plugin": {
            "name": "hybrid",
            "tp": 8,
            "sp_mode": "megatron",
            "zero_stage": 1,
            "precision": "bf16",
            "max_grad_norm": 1.0,
        },
        "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total_steps": 500_000, "warmup_steps": 2000, "min_lr": 3e-5, "num_microbatches": 8},
        "data": {"seq_len": 4096, "global_batch_size": 1024},
        "checkpoint": {"every_steps": 1000, "keep_last": 3},
        "eval": {"every_steps": 2000, "num_sequences": 512, "batch_size": 32},  # a multiple of the microbatches
    },
    # Llama-2-70B on 256 GPUs: tp8 x pp8 (interleaved 1F1B, 2 chunks per rank) x dp4, ZeRO-1, bf16; 4M tokens.
    "llama-70b": {
        "name": "llama-70b",
        "output_dir": "runs/llama-70b",
        "model": {"preset": "70b"},
        "plugin": {
            "name": "hybrid",
            "tp": 8,
            "pp": 8,
            "zero_stage": 1,
            "schedule": "interleaved_1f1b",
            "num_model_chunks": 2,
            "precision": "bf16",
            "max_grad_norm": 1.0,
        },
        "optimizer": {"lr": 1.5e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total_steps": 500_000, "warmup_steps": 2000, "min_lr": 1.5e-5, "num_microbatches": 32},
        "data": {"seq_len": 4096, "global_batch_size": 1024},
        "checkpoint": {"every_steps": 500, "keep_last": 3},
        "eval": {"every_steps": 2000, "num_sequences": 512, "batch_size": 32},  # a multiple of the microbatches
    },
}
"""``colo train --preset NAME`` configs: ``tiny-llama`` (the CPU demo), ``tiny-moe`` and ``tiny-deepseek`` (mixture of
experts, Mixtral- and DeepSeek-style, ep2, CPU)
and ``llama-1b`` / ``llama-7b`` / ``llama-70b`` (GPU recipes: configs that validate; their world sizes are what the
comments say, set by ``colo launch``)."""

PRESET_DESCRIPTIONS: dict[str, str] = {
    "tiny-llama": "CPU demo (make demo): a 3M-parameter Llama on the standard library's .py files, DDP, 300 steps",
    "tiny-moe": "CPU: a Mixtral-style MoE Llama (8 experts, top-2) with experts over ep=2, ZeRO-2; Mixtral export",
    "tiny-deepseek": "CPU: DeepSeek-V3-shaped (MLA, shared expert, 16 experts top-4, groups = ep ranks) over ep=2",
    "tiny-rm": "CPU: a reward model on generated preference pairs, from a policy SFT'd first",
    "tiny-dpo": "CPU: DPO on the same preference pairs, after an SFT warm-up that becomes the reference",
    "tiny-grpo": "CPU: GRPO on integer-addition prompts with an exact-answer reward, after an SFT warm-up",
    "tiny-grpo-long": "CPU: GRPO on worked-solution answers ~9x tiny-grpo's, math-answer reward, hybrid sp2 (Ulysses)",
    "tiny-ppo": "CPU: PPO with a critic (GAE, adaptive KL) on tiny-grpo's addition prompts",
    "tiny-diffusion": "CPU: text-to-image diffusion (tiny VAE + UNet + CLIP) on generated coloured shapes",
    "tiny-dit": "CPU: the same shapes with a PixArt-style diffusion transformer and flow matching; PixArt export",
    "sd15-diffusion": "8 GPUs: Stable Diffusion 1.5's UNet on local images and captions, ZeRO-2 bf16",
    "pixart-dit": "8 GPUs: a PixArt-alpha-sized diffusion transformer (~607M) with flow matching, ZeRO-2 bf16",
    "tiny-video-dit": "CPU: 4-frame clips of the shapes moving, a DiT over frames x patches under Ulysses sp2",
    "sd3-medium-dit": "8 GPUs: a PixArt-style diffusion transformer at SD3-medium's size (~2.08B), ZeRO-3 bf16",
    "llama-1b": "8 GPUs: TinyLlama-1.1B's shape, tp2 x dp4, ZeRO-1, bf16, 2M tokens per step",
    "llama-7b": "32 GPUs: Llama-2-7B, tp8 x dp4 with sequence parallelism, ZeRO-1, bf16, 4M tokens per step",
    "llama-70b": "256 GPUs: Llama-2-70B, tp8 x pp8 (interleaved 1F1B) x dp4, ZeRO-1, bf16, 4M tokens per step",
}
"""One line per run preset, for ``colo train --help``, ``colo config --help`` and ``colo config --list``."""


def preset_table() -> str:
    """Every run preset with its one-line description, one per line (the registry's order)."""
    width = max(len(name) for name in RUN_PRESETS)
    return "\n".join(f"{name:<{width}}  {PRESET_DESCRIPTIONS.get(name, '')}" for name in RUN_PRESETS)
