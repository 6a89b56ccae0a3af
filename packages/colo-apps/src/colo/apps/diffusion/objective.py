"""The denoising objective of `train_text_to_image.py`: DDPM noising, epsilon or v-prediction targets, Min-SNR-gamma
weights (Hang et al., 2023, through ``diffusers.training_utils.compute_snr``), noise offset, and condition dropout
for classifier-free guidance (Ho & Salimans, 2022).

Only the denoiser is boosted: the frozen text encoder and VAE run in `DiffusionBatchBuilder`, on each rank for its own
rows, and the boosted module is `DenoiserLoss` (the UNet and its weighted MSE), whose batch splits on dim 0 like any
other, so microbatches and data-parallel ranks average exactly like one process on the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .data import frames_as_images, images_as_frames
from .models import require_diffusers, tokenize_captions

PREDICTION_TYPES = ("epsilon", "v_prediction")


@dataclass(kw_only=True)
class DiffusionObjective:
    """What the denoiser learns and how each step's noise is drawn."""

    prediction_type: str = "epsilon"
    """``"epsilon"`` (predict the noise) or ``"v_prediction"`` (Salimans & Ho, 2022)."""
    snr_gamma: float | None = None
    """Min-SNR-gamma weighting (5.0 is the paper's); ``None``: the plain MSE."""
    noise_offset: float = 0.0
    """Add ``noise_offset * N(0, 1)`` per sample and channel to the noise (Guttenberg, 2023); 0: off."""
    condition_dropout: float = 0.0
    """Probability of training a sample on the empty caption (classifier-free guidance); 0: off."""
    num_train_timesteps: int = 1000
    """DDPM timesteps."""
    beta_schedule: str = "scaled_linear"
    """DDPMScheduler ``beta_schedule`` (Stable Diffusion's ``scaled_linear``)."""
    beta_start: float = 0.00085
    """First beta."""
    beta_end: float = 0.012
    """Last beta."""

    def __post_init__(self) -> None:
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"DiffusionObjective.prediction_type={self.prediction_type!r} is unknown; use one of {PREDICTION_TYPES}"
            )
        if self.snr_gamma is not None and not self.snr_gamma > 0:
            raise ValueError(f"DiffusionObjective.snr_gamma={self.snr_gamma!r} must be positive or None")
        if not 0 <= self.condition_dropout < 1:
            raise ValueError(f"DiffusionObjective.condition_dropout={self.condition_dropout!r} must be in [0, 1)")
        if self.noise_offset < 0:
            raise ValueError(f"DiffusionObjective.noise_offset={self.noise_offset!r} must be >= 0")

    def scheduler(self):
        """The `DDPMScheduler` of training (its config is also the exported pipeline's)."""
        diffusers = require_diffusers()
        return diffusers.DDPMScheduler(
            num_train_timesteps=self.num_train_timesteps,
            beta_schedule=self.beta_schedule,
            beta_start=self.beta_start,
            beta_end=self.beta_end,
            prediction_type=self.prediction_type,
            steps_offset=1,  # Stable Diffusion's (inference only: training's noising ignores it)
        )


class DenoiserLoss(torch.nn.Module):
    """The boosted module: the denoiser (``unet``, or colo's diffusion transformer as ``transformer``) and the
    weighted MSE of its prediction.

    ``forward`` returns ``mean_i(w_i * mean(|pred_i - target_i|^2))``: per-sample MSE times its Min-SNR weight (1
    without it), averaged over the batch, which equals `train_text_to_image.py`'s loss in both branches. The
    denoiser's parameters are named ``unet.*`` or ``transformer.*`` (the folder of the exported pipeline).

    Args:
        unet: a diffusers ``UNet2DConditionModel`` (or another module with its call signature).
        transformer: a `colo.apps.models.dit.DiffusionTransformer` instead of ``unet``.
        compute_dtype: the dtype the latents and text states enter the denoiser in: the plugin's compute dtype under
            bf16 / fp16 (``plugin.compute_dtype``). ZeRO and Gemini keep their compute weights in it and do not cast
            a batch's floating inputs, so the fp32 batch would meet them in the timestep embedding's linear and the
            first convolution (a dtype error); DDP's autocast casts anyway. While the weights are still fp32 outside
            autocast (the Booster's one execution-order forward before it shards them) the inputs stay fp32.
            ``None``: as given (fp32 runs). The loss is taken in fp32 either way.
    """

    def __init__(
        self,
        unet: torch.nn.Module | None = None,
        *,
        transformer: torch.nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if (unet is None) == (transformer is None):
            raise ValueError("DenoiserLoss takes exactly one denoiser: unet=... or transformer=...")
        if unet is not None:
            self.unet = unet
        else:
            self.transformer = transformer
        self.compute_dtype = compute_dtype

    def _input_dtype(self, noisy_latents: torch.Tensor) -> torch.dtype | None:
        """``compute_dtype``, except where the denoiser's weights are still fp32 outside autocast: the forward the
        Booster runs once on the unboosted model (``example_batch``, to pack ZeRO / Gemini chunks in execution
        order), which would otherwise meet bf16 inputs with fp32 weights."""
        if self.compute_dtype is None or torch.is_autocast_enabled(noisy_latents.device.type):
            return self.compute_dtype
        weight = next(self.denoiser.parameters(), None)
        if weight is not None and weight.dtype == torch.float32:
            return None
        return self.compute_dtype

    @property
    def denoiser_name(self) -> str:
        """``"unet"`` or ``"transformer"``: the denoiser's attribute, the prefix of its parameter names."""
        return "unet" if "unet" in self._modules else "transformer"

    @property
    def denoiser(self) -> torch.nn.Module:
        """The UNet or the transformer."""
        return self._modules[self.denoiser_name]

    def forward(
        self, noisy_latents, timesteps, encoder_hidden_states, target, loss_weights, encoder_attention_mask=None
    ):
        dtype = self._input_dtype(noisy_latents)
        if dtype is not None:
            noisy_latents = noisy_latents.to(dtype)
            encoder_hidden_states = encoder_hidden_states.to(dtype)
        if self.denoiser_name == "transformer":
            pred = self.transformer(
                noisy_latents, encoder_hidden_states, timesteps, encoder_attention_mask=encoder_attention_mask
            )
        elif encoder_attention_mask is None:
            pred = self.unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        else:
            pred = self.unet(
                noisy_latents, timesteps, encoder_hidden_states, encoder_attention_mask=encoder_attention_mask,
                return_dict=False,
            )[0]  # fmt: skip
        per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.dim())))
        return (per_sample * loss_weights).mean()


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step ``step``'s draws (the same on every rank: draws are made for the global batch)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class DiffusionBatchBuilder:
    """Turns a step's images (or cached latent statistics) and captions into the denoiser's batch.

    Draws, from `step_generator(seed, step)` for the *global* batch of ``global_rows`` rows, in this order: the
    posterior sample's normal noise, the diffusion noise, the noise offset's per-channel noise (when on), the
    timesteps, the condition-dropout uniforms (when on); then keeps this rank's ``rows``. So any data-parallel
    layout, microbatching and the latent cache see the same numbers as one process.

    Args:
        objective: the `DiffusionObjective`.
        tokenizer, text_encoder: the frozen text side.
        vae: the frozen `AutoencoderKL` (``None`` with cached latents).
        seed: the run's seed.
        scaling_factor: the latents' scale (``None``: the VAE's; needed without one, e.g. the `LatentCache`'s).
        caption_mask: also return the captions' ``encoder_attention_mask`` (1 = token, 0 = padding; the text
            encoder gets it too), as PixArt trains and samples; the UNet recipe attends to the padding.
    """

    def __init__(
        self,
        objective: DiffusionObjective,
        *,
        tokenizer,
        text_encoder,
        vae=None,
        seed: int = 0,
        scaling_factor: float | None = None,
        caption_mask: bool = False,
    ) -> None:
        self.objective = objective
        self.caption_mask = caption_mask
        self.scheduler = objective.scheduler()
        self.tokenizer, self.text_encoder, self.vae = tokenizer, text_encoder, vae
        if scaling_factor is None:
            if vae is None:
                raise ValueError("DiffusionBatchBuilder without a VAE needs scaling_factor (the latent cache's)")
            scaling_factor = vae.config.scaling_factor
        self.scaling_factor = float(scaling_factor)
        self.seed = seed

    @torch.no_grad()
    def posterior(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, std)`` of the VAE's latent distribution of the images (of each frame of ``(batch, 3, frames, h, w)``
        clips: ``(batch, latent channels, frames, h', w')``)."""
        if self.vae is None:
            raise ValueError("this builder has no VAE: pass cached latent statistics (latent_mean, latent_std)")
        if pixel_values.dim() == 5:  # clips: every frame through the image VAE, back to (batch, c, frames, h, w)
            frames = pixel_values.shape[2]
            mean, std = self.posterior(frames_as_images(pixel_values))
            return images_as_frames(mean, frames), images_as_frames(std, frames)
        dist = self.vae.encode(pixel_values.to(self.vae.dtype)).latent_dist
        return dist.mean.float(), dist.std.float()

    def _step_draws(self, step, captions, rows, global_rows, pixel_values, latent_mean, latent_std) -> tuple:
        """``(latent_mean, latent_std, generator, sample, noise)`` of this rank's ``rows``: the latent statistics
        (from the images when not cached), the step's generator and its first two draws over the whole step's batch
        (the latent sample and the noise), so any split of the rows over ranks draws what one process draws."""
        if latent_mean is None:
            latent_mean, latent_std = self.posterior(pixel_values)
        local = latent_mean.shape[0]
        if local != rows.stop - rows.start or len(captions) != local:
            raise ValueError(f"{local} images and {len(captions)} captions for rows {rows}")
        shape = (global_rows, *latent_mean.shape[1:])
        generator = step_generator(self.seed, step)
        sample = torch.randn(shape, generator=generator)[rows]
        noise = torch.randn(shape, generator=generator)[rows]
        return latent_mean, latent_std, generator, sample, noise

    def _drop_captions(self, captions: list[str], generator, rows: slice, global_rows: int) -> list[str]:
        """Condition dropout for classifier-free guidance: each caption emptied with ``condition_dropout``."""
        if self.objective.condition_dropout <= 0:
            return captions
        dropped = (torch.rand(global_rows, generator=generator) < self.objective.condition_dropout)[rows]
        return ["" if drop else caption for caption, drop in zip(captions, dropped.tolist())]

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> torch.Tensor:
        ids = tokenize_captions(self.tokenizer, captions).to(self.text_encoder.device)
        return self.text_encoder(ids, return_dict=False)[0].float()

    @torch.no_grad()
    def text_inputs(self, captions: list[str], device) -> dict[str, torch.Tensor]:
        """``encoder_hidden_states`` of the captions and, with ``caption_mask``, their ``encoder_attention_mask``
        (the encoder then reads the mask too, as PixArt's pipeline calls it)."""
        if not self.caption_mask:
            return {"encoder_hidden_states": self.encode_text(captions).to(device)}
        ids, mask = tokenize_captions(self.tokenizer, captions, return_mask=True)
        encoder_device = self.text_encoder.device
        states = self.text_encoder(ids.to(encoder_device), attention_mask=mask.to(encoder_device), return_dict=False)
        return {"encoder_hidden_states": states[0].float().to(device), "encoder_attention_mask": mask.to(device)}

    @torch.no_grad()
    def __call__(
        self,
        *,
        step: int,
        captions: list[str],
        rows: slice,
        global_rows: int,
        pixel_values: torch.Tensor | None = None,
        latent_mean: torch.Tensor | None = None,
        latent_std: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The denoiser batch of this rank's ``rows`` of the step (``captions`` and images are those rows only)."""
        from diffusers.training_utils import compute_snr

        latent_mean, latent_std, generator, sample, noise = self._step_draws(
            step, captions, rows, global_rows, pixel_values, latent_mean, latent_std
        )
        objective, local, shape = self.objective, latent_mean.shape[0], (global_rows, *latent_mean.shape[1:])
        if objective.noise_offset > 0:
            offset = torch.randn((global_rows, shape[1], 1, 1), generator=generator)[rows]
            noise = noise + objective.noise_offset * offset
        timesteps = torch.randint(0, objective.num_train_timesteps, (global_rows,), generator=generator)[rows]
        captions = self._drop_captions(captions, generator, rows, global_rows)
        device = latent_mean.device
        latents = (latent_mean + latent_std * sample.to(device)) * self.scaling_factor
        noise, timesteps = noise.to(device), timesteps.to(device)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        if objective.prediction_type == "epsilon":
            target = noise
        else:
            target = self.scheduler.get_velocity(latents, noise, timesteps)
        if objective.snr_gamma is None:
            weights = torch.ones(local, device=device)
        else:
            snr = compute_snr(self.scheduler, timesteps)
            weights = torch.stack([snr, objective.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
            weights = weights / (snr if objective.prediction_type == "epsilon" else snr + 1)
        return {
            "noisy_latents": noisy,
            "timesteps": timesteps,
            **self.text_inputs(captions, device),
            "target": target,
            "loss_weights": weights.float(),
        }
