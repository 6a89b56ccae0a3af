"""The ``diffusion`` section of the run config (``data.task: diffusion``): models, objective, EMA, data, samples."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DDPM_FIELDS = ("prediction_type", "snr_gamma", "noise_offset")
"""Fields of the ``diffusion`` section that only ``objective: ddpm`` reads."""
FLOW_MATCHING_FIELDS = ("timestep_sampling", "logit_mean", "logit_std", "mode_scale", "loss_weighting", "flow_shift")
"""Fields of the ``diffusion`` section that only ``objective: flow_matching`` reads."""
UNET_FIELDS = ("unet_channels", "unet_layers_per_block", "attention_head_dim", "unet_config", "unet_from")
"""Fields of the ``diffusion`` section that only ``denoiser: unet`` reads."""
DIT_FIELDS = ("dit_layers", "dit_heads", "dit_head_dim", "dit_patch_size", "dit_config", "num_frames")
"""Fields of the ``diffusion`` section that only ``denoiser: dit`` reads."""


class DiffusionSection(BaseModel):
    """Text-to-image denoiser training (colo.apps.diffusion): the denoiser (UNet or DiT) / CLIP / VAE sizes, the
    objective, the EMA, the captioned images and the sample grids written at every eval."""

    model_config = ConfigDict(extra="forbid")

    denoiser: Literal["unet", "dit"] = Field(
        default="unet",
        description="unet: diffusers' UNet2DConditionModel (the unet_* fields); dit: colo's PixArt-alpha-style "
        "diffusion transformer (colo.apps.models.dit, the dit_* fields; weights named as diffusers' "
        "PixArtTransformer2DModel), trained with the caption's attention mask and exported as a PixArtAlphaPipeline.",
    )
    dit_layers: int = Field(default=4, ge=1, description="DiT: transformer blocks.")
    dit_heads: int = Field(default=4, ge=1, description="DiT: attention heads.")
    dit_head_dim: int = Field(
        default=32, ge=1, description="DiT: channels per head (hidden = heads x head_dim; Triton: 16/32/64/128)."
    )
    dit_patch_size: int = Field(default=2, ge=1, description="DiT: side of a latent patch (one token).")
    dit_config: dict[str, Any] = Field(
        default={},
        description="DiTConfig fields (PixArtTransformer2DModel config names) that replace the ones built from the "
        "sizes above and the VAE / text encoder, e.g. use_additional_conditions, interpolation_scale, sample_size.",
    )

    num_frames: int = Field(
        default=1,
        ge=1,
        description="DiT: frames per sample. 1: images; > 1: short video clips of the procedural shapes moving "
        "(MovingShapesDataset: 'a red circle moving left on blue'), each frame through the image VAE, the DiT on "
        "(channels, frames, height, width) latents with full spatial-temporal attention; sample grids show one clip "
        "a row (Euler flow steps). No image_dir, latent cache or diffusers export with clips.",
    )
    image_size: int = Field(default=16, ge=8, description="Side of the square training images (pixels).")
    unet_channels: list[int] = Field(default=[32, 64], description="The UNet's block_out_channels.")
    unet_layers_per_block: int = Field(default=1, ge=1, description="The UNet's layers_per_block.")
    attention_head_dim: int = Field(default=8, ge=1, description="Channels per attention head of the UNet.")
    norm_num_groups: int = Field(default=8, ge=1, description="GroupNorm groups of the UNet and VAE.")
    text_hidden_size: int = Field(default=32, ge=8, description="Width of the CLIP text encoder.")
    text_layers: int = Field(default=2, ge=1, description="Layers of the CLIP text encoder.")
    text_heads: int = Field(default=2, ge=1, description="Heads of the CLIP text encoder.")
    max_caption_tokens: int = Field(default=16, ge=4, description="Caption tokens with BOS/EOS (longer: an error).")
    vae_channels: list[int] = Field(default=[16, 32], description="The AutoencoderKL's block_out_channels.")
    unet_config: dict[str, Any] = Field(
        default={},
        description="UNet2DConditionModel config fields that replace the ones built from the sizes above, e.g. "
        "SD-1.5's published config (block types, attention_head_dim, cross_attention_dim, sample_size, ...).",
    )
    text_encoder_from: str | None = Field(default=None, description="A local CLIPTextModel directory (None: built).")
    tokenizer_from: str | None = Field(
        default=None,
        description="A local CLIPTokenizer directory, the one text_encoder_from was trained with (None: built "
        "from the captions' words, which fits only a text encoder trained with that vocabulary, e.g. an export's).",
    )
    vae_from: str | None = Field(default=None, description="A local AutoencoderKL directory (None: built, trained).")
    vae_pretrain_steps: int = Field(
        default=0,
        ge=0,
        description="Train the built AutoencoderKL this many steps on the run's images first (rank "
        "0, saved to output_dir/vae and reused on resume), then freeze it.",
    )
    vae_lr: float = Field(default=2e-3, gt=0, description="Learning rate of the VAE pre-training.")
    cache_latents: bool = Field(
        default=False,
        description="Encode the images once with the frozen VAE into output_dir/latents (safetensors: the "
        "posterior's mean and std; reused on resume, rebuilt when the images or the VAE changed) and train from "
        "it, drawing a fresh latent per step; training then holds no VAE (the sample grids load it).",
    )
    unet_from: str | None = Field(
        default=None,
        description="A local UNet2DConditionModel directory to start from, e.g. an export's unet/ (None: built "
        "from the sizes above, seeded). The base of a LoRA run (the lora section: adapters on the UNet's "
        "attention, to_q / to_k / to_v / to_out.0 unless lora.target_modules names others).",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute the UNet's blocks in backward instead of keeping their activations (diffusers' "
        "enable_gradient_checkpointing; the DiT's transformer blocks: colo.apps.apply_activation_checkpointing, "
        "full): less memory, ~1 more forward per step; the same losses.",
    )
    objective: Literal["ddpm", "flow_matching"] = Field(
        default="ddpm",
        description="ddpm: DDPMScheduler noising with prediction_type / snr_gamma / noise_offset "
        "(train_text_to_image.py); flow_matching: SD3's rectified flow (train_dreambooth_sd3.py) with "
        "timestep_sampling / loss_weighting / flow_shift; a UNet's grids sample with Euler steps (no diffusers "
        "export), a DiT's with the flow DPM-Solver++ of its PixArtAlphaPipeline export.",
    )
    prediction_type: Literal["epsilon", "v_prediction"] = Field(default="epsilon", description="The DDPM target.")
    snr_gamma: float | None = Field(default=None, gt=0, description="Min-SNR-gamma weighting (None: off; DDPM).")
    noise_offset: float = Field(default=0.0, ge=0, description="Noise offset (0: off; DDPM).")
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = Field(
        default="logit_normal", description="Flow matching: compute_density_for_timestep_sampling's scheme."
    )
    logit_mean: float = Field(default=0.0, description="Flow matching: mean of the logit-normal density.")
    logit_std: float = Field(default=1.0, gt=0, description="Flow matching: std of the logit-normal density.")
    mode_scale: float = Field(default=1.29, description="Flow matching: scale of the mode density.")
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = Field(
        default="none", description="Flow matching: compute_loss_weighting_for_sd3's scheme."
    )
    flow_shift: float = Field(
        default=3.0, gt=0, description="Flow matching: FlowMatchEulerDiscreteScheduler's shift (SD3's 3.0; 1: none)."
    )
    condition_dropout: float = Field(default=0.1, ge=0, lt=1, description="Empty-caption probability (CFG).")
    ema_decay: float | None = Field(default=0.999, gt=0, le=1, description="EMA decay of the denoiser (None: no EMA).")
    ema_warmup: bool = Field(default=True, description="EMAModel's use_ema_warmup (power ema_power, inv_gamma 1).")
    ema_power: float = Field(default=0.75, gt=0, description="EMA warmup power.")
    num_images: int = Field(default=1024, ge=1, description="Size of the procedural image set (with no image_dir).")
    image_dir: str | None = Field(default=None, description="An image folder with metadata.jsonl (None: shapes).")
    resize: int | None = Field(default=None, ge=8, description="Resize image_dir images to this side (None: as is).")
    sample_prompts: list[str] = Field(
        default=[
            "a red circle on white",
            "a blue square on black",
            "a green triangle on gray",
            "a yellow circle on blue",
        ],
        description="Prompts of the sample grid written at every eval.",
    )
    samples_per_prompt: int = Field(default=4, ge=1, description="Seeds per prompt in the grid (seeds 0..n-1).")
    sample_steps: int = Field(default=10, ge=1, description="Steps of the DPM-Solver++ sampler.")
    guidance_scale: float = Field(default=3.0, ge=1, description="Classifier-free guidance scale of the samples.")

    @model_validator(mode="after")
    def _sizes(self):
        from .models import DiffusionModelConfig

        self.model_config_object()  # validates channel counts against the groups
        if self.image_size % 8:
            raise ValueError(f"diffusion.image_size={self.image_size} must be a multiple of 8 (diffusers' pipelines)")
        del DiffusionModelConfig
        foreign = DDPM_FIELDS if self.objective == "flow_matching" else FLOW_MATCHING_FIELDS
        for name in foreign:  # a value other than the default would be silently ignored
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value != default:
                raise ValueError(
                    f"diffusion.{name}={value!r} does not apply to diffusion.objective={self.objective!r}; set it to "
                    f"{default!r} or choose the other objective"
                )
        for name in UNET_FIELDS if self.denoiser == "dit" else DIT_FIELDS:
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value != default:
                raise ValueError(
                    f"diffusion.{name}={value!r} does not apply to diffusion.denoiser={self.denoiser!r}; set it to "
                    f"{default!r} or choose the other denoiser"
                )
        if self.denoiser == "dit":
            self.dit_config_object()  # validates the sizes and dit_config
        if self.num_frames > 1:
            clash = [
                (name, value)
                for name, value in (("image_dir", self.image_dir), ("cache_latents", self.cache_latents))
                if value
            ]
            if clash:
                name, value = clash[0]
                raise ValueError(
                    f"diffusion.{name}={value!r} does not work with diffusion.num_frames={self.num_frames} (video "
                    f"clips come from the procedural moving shapes, encoded every step); unset {name} or set "
                    "num_frames=1"
                )
            if self.objective != "flow_matching":
                raise ValueError(
                    f"diffusion.num_frames={self.num_frames} trains video clips with flow matching (their sample grids "
                    "use the Euler flow sampler); set diffusion.objective='flow_matching'"
                )
        return self

    def dit_config_object(self):
        """The `colo.apps.models.dit.DiTConfig` of ``denoiser: dit``: the dit_* sizes, the latent's side and channels
        (``sample_size``, ``in_channels``), the text encoder's width (``caption_channels``, projected to the hidden
        size), then ``dit_config``'s fields."""
        from ..models.dit import DiTConfig

        model = self.model_config_object()
        fields = {
            "num_attention_heads": self.dit_heads,
            "attention_head_dim": self.dit_head_dim,
            "num_layers": self.dit_layers,
            "patch_size": self.dit_patch_size,
            "sample_size": model.latent_size,
            "in_channels": model.latent_channels,
            "caption_channels": self.text_hidden_size,
            "cross_attention_dim": self.dit_heads * self.dit_head_dim,
        }
        unknown = sorted(set(self.dit_config) - set(DiTConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"diffusion.dit_config names {unknown}, which are not DiTConfig fields; use "
                f"{sorted(DiTConfig.__dataclass_fields__)}"
            )
        try:
            return DiTConfig(**{**fields, **self.dit_config})
        except ValueError as error:
            raise ValueError(f"diffusion.dit_* sizes: {error}") from None

    def model_config_object(self):
        from .models import DiffusionModelConfig

        return DiffusionModelConfig(
            image_size=self.image_size,
            unet_channels=tuple(self.unet_channels),
            unet_layers_per_block=self.unet_layers_per_block,
            attention_head_dim=self.attention_head_dim,
            norm_num_groups=self.norm_num_groups,
            text_hidden_size=self.text_hidden_size,
            text_layers=self.text_layers,
            text_heads=self.text_heads,
            max_caption_tokens=self.max_caption_tokens,
            vae_channels=tuple(self.vae_channels),
            unet_extra=dict(self.unet_config),
        )

    def training_objective(self):
        """The `DiffusionObjective` or, with ``objective: flow_matching``, the `FlowMatchingObjective` of the run."""
        if self.objective == "flow_matching":
            from .flow_matching import FlowMatchingObjective

            return FlowMatchingObjective(
                timestep_sampling=self.timestep_sampling,
                logit_mean=self.logit_mean,
                logit_std=self.logit_std,
                mode_scale=self.mode_scale,
                loss_weighting=self.loss_weighting,
                shift=self.flow_shift,
                condition_dropout=self.condition_dropout,
            )
        from .objective import DiffusionObjective

        return DiffusionObjective(
            prediction_type=self.prediction_type,
            snr_gamma=self.snr_gamma,
            noise_offset=self.noise_offset,
            condition_dropout=self.condition_dropout,
        )
