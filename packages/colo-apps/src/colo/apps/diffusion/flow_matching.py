"""The flow-matching (rectified-flow) objective of diffusers' SD3 training script (``train_dreambooth_sd3.py``) and
its Euler sampler (Lipman et al., 2023; Liu et al., 2023; Esser et al., 2024, "Scaling Rectified Flow Transformers").

Training: ``u`` from ``diffusers.training_utils.compute_density_for_timestep_sampling`` (uniform, logit-normal or
mode), ``index = int(u * num_train_timesteps)`` into the `FlowMatchEulerDiscreteScheduler`'s (shifted) timesteps and
sigmas, ``x_t = (1 - sigma) * x_0 + sigma * noise``, target the velocity ``noise - x_0``, per-sample weights from
``compute_loss_weighting_for_sd3`` (sigma_sqrt, cosmap, none). The batch has the keys `DenoiserLoss` takes, so its
per-sample weighted MSE is the script's loss. Sampling: ``x <- x + (sigma_next - sigma) * v`` over the scheduler's
inference sigmas (``FlowMatchEulerDiscreteScheduler.step``), with classifier-free guidance as SD3's pipeline does it.

Only the glue is written here; the density, the weighting, the shifted schedules and Flux's ``calculate_shift`` are
diffusers'. Everything is computed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .models import require_diffusers
from .objective import DiffusionBatchBuilder

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal", "mode")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


@dataclass(kw_only=True)
class FlowMatchingObjective:
    """How flow-matching timesteps are drawn and weighted, and the scheduler's timestep shift.

    ``train_dreambooth_sd3.py`` passes one ``--weighting_scheme`` to both diffusers functions (so a density other than
    uniform always comes with weight 1 there); here the two are separate fields, and the script's runs are the cases
    where one of them is left at its neutral value.
    """

    timestep_sampling: str = "logit_normal"
    """``compute_density_for_timestep_sampling``'s scheme: ``"uniform"``, ``"logit_normal"`` or ``"mode"``."""
    logit_mean: float = 0.0
    """Mean of the logit-normal density (the script's ``--logit_mean``)."""
    logit_std: float = 1.0
    """Standard deviation of the logit-normal density (``--logit_std``)."""
    mode_scale: float = 1.29
    """Scale of the mode density (``--mode_scale``)."""
    loss_weighting: str = "none"
    """``compute_loss_weighting_for_sd3``'s scheme: ``"none"``, ``"sigma_sqrt"`` (``sigma ** -2``) or ``"cosmap"``."""
    shift: float = 3.0
    """The scheduler's static timestep shift ``sigma' = shift * sigma / (1 + (shift - 1) * sigma)`` (SD3's 3.0; 1.0
    is no shift). Ignored with ``use_dynamic_shifting``."""
    use_dynamic_shifting: bool = False
    """Flux's resolution-dependent shift at sampling: ``mu`` grows linearly in the image's token count from
    ``base_shift`` at ``base_image_seq_len`` to ``max_shift`` at ``max_image_seq_len``. Training then draws from the
    unshifted schedule, as diffusers' Flux scripts do."""
    base_shift: float = 0.5
    """``mu`` at ``base_image_seq_len`` tokens (dynamic shifting)."""
    max_shift: float = 1.15
    """``mu`` at ``max_image_seq_len`` tokens (dynamic shifting)."""
    base_image_seq_len: int = 256
    """Token count of ``base_shift``."""
    max_image_seq_len: int = 4096
    """Token count of ``max_shift``."""
    condition_dropout: float = 0.0
    """Probability of training a sample on the empty caption (classifier-free guidance); 0: off."""
    num_train_timesteps: int = 1000
    """Discrete training timesteps of the scheduler."""

    def __post_init__(self) -> None:
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ValueError(
                f"FlowMatchingObjective.timestep_sampling={self.timestep_sampling!r} is unknown; use one of "
                f"{TIMESTEP_SAMPLINGS}"
            )
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(
                f"FlowMatchingObjective.loss_weighting={self.loss_weighting!r} is unknown; use one of {LOSS_WEIGHTINGS}"
            )
        if not self.logit_std > 0:
            raise ValueError(f"FlowMatchingObjective.logit_std={self.logit_std!r} must be positive")
        if not self.shift > 0:
            raise ValueError(f"FlowMatchingObjective.shift={self.shift!r} must be positive (1.0: no shift)")
        if not 0 <= self.condition_dropout < 1:
            raise ValueError(f"FlowMatchingObjective.condition_dropout={self.condition_dropout!r} must be in [0, 1)")
        if self.num_train_timesteps < 1:
            raise ValueError(f"FlowMatchingObjective.num_train_timesteps={self.num_train_timesteps!r} must be >= 1")

    def scheduler(self):
        """A fresh `FlowMatchEulerDiscreteScheduler` of this objective (its config is also a pipeline's)."""
        diffusers = require_diffusers()
        return diffusers.FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=self.num_train_timesteps,
            shift=self.shift,
            use_dynamic_shifting=self.use_dynamic_shifting,
            base_shift=self.base_shift,
            max_shift=self.max_shift,
            base_image_seq_len=self.base_image_seq_len,
            max_image_seq_len=self.max_image_seq_len,
        )

    def timestep_density(self, batch_size: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``batch_size`` draws of ``u`` in [0, 1] from diffusers' ``compute_density_for_timestep_sampling``."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        return compute_density_for_timestep_sampling(
            weighting_scheme=self.timestep_sampling,
            batch_size=batch_size,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
            generator=generator,
        )

    def image_seq_len_shift(self, image_seq_len: int) -> float:
        """Flux's ``mu`` for an image of ``image_seq_len`` latent tokens (diffusers' ``calculate_shift``)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        return calculate_shift(
            image_seq_len, self.base_image_seq_len, self.max_image_seq_len, self.base_shift, self.max_shift
        )


def flow_matching_inputs(
    objective: FlowMatchingObjective, scheduler, latents: torch.Tensor, noise: torch.Tensor, u: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The training inputs of clean ``latents`` with ``noise`` at densities ``u`` (fp32).

    Args:
        objective: the `FlowMatchingObjective` (its ``loss_weighting``).
        scheduler: a `FlowMatchEulerDiscreteScheduler` as built (``set_timesteps`` not called: its training schedule).
        latents: the clean samples ``x_0``, batch first.
        noise: standard normal noise of ``latents``' shape.
        u: ``(batch,)`` draws of `FlowMatchingObjective.timestep_density`.

    Returns:
        ``noisy_latents`` (``x_t``), ``timesteps`` (the scheduler's, ``sigma * num_train_timesteps``: what the denoiser
        is conditioned on), ``sigmas`` (``(batch,)``), ``target`` (``noise - x_0``) and ``loss_weights`` (``(batch,)``).
    """
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    if len(scheduler.sigmas) != objective.num_train_timesteps:
        raise ValueError(
            f"the scheduler holds {len(scheduler.sigmas)} sigmas, not the {objective.num_train_timesteps} training "
            "ones (set_timesteps was called on it); pass a fresh FlowMatchingObjective.scheduler()"
        )
    latents, noise = latents.float(), noise.float()
    # u = 1 exactly (the mode density at u = 0) would index one past the end, where the script fails: the last index
    indices = (u * objective.num_train_timesteps).long().clamp(max=objective.num_train_timesteps - 1).cpu()
    timesteps = scheduler.timesteps[indices].to(latents.device)
    sigmas = scheduler.sigmas[indices].to(latents.device, torch.float32)
    sigma = sigmas.view(-1, *[1] * (latents.ndim - 1))
    weights = compute_loss_weighting_for_sd3(weighting_scheme=objective.loss_weighting, sigmas=sigmas)
    return {
        "noisy_latents": (1.0 - sigma) * latents + sigma * noise,
        "timesteps": timesteps,
        "sigmas": sigmas,
        "target": noise - latents,
        "loss_weights": weights.float(),
    }


class FlowMatchingBatchBuilder(DiffusionBatchBuilder):
    """`DiffusionBatchBuilder` with the flow-matching objective: the denoiser batch `DenoiserLoss` takes.

    Draws, from `step_generator(seed, step)` for the *global* batch of ``global_rows`` rows, in this order: the
    posterior sample's normal noise, the flow noise, the timestep densities ``u``, the condition-dropout uniforms
    (when on); then keeps this rank's ``rows``. Latents are ``(z - shift_factor) * scaling_factor`` (SD3's VAE has a
    shift factor; the SD 1.5-style VAE none).

    Args:
        objective: the `FlowMatchingObjective`.
        tokenizer, text_encoder, vae, seed, scaling_factor, caption_mask: as `DiffusionBatchBuilder`'s.
        shift_factor: the latents' shift (``None``: the VAE config's ``shift_factor``, 0 where it has none).
    """

    def __init__(
        self,
        objective: FlowMatchingObjective,
        *,
        tokenizer,
        text_encoder,
        vae=None,
        seed: int = 0,
        scaling_factor: float | None = None,
        shift_factor: float | None = None,
        caption_mask: bool = False,
    ) -> None:
        super().__init__(
            objective,
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            seed=seed,
            scaling_factor=scaling_factor,
            caption_mask=caption_mask,
        )
        if shift_factor is None:
            shift_factor = getattr(vae.config, "shift_factor", None) if vae is not None else None
        self.shift_factor = float(shift_factor or 0.0)

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
        latent_mean, latent_std, generator, sample, noise = self._step_draws(
            step, captions, rows, global_rows, pixel_values, latent_mean, latent_std
        )
        objective = self.objective
        u = objective.timestep_density(global_rows, generator=generator)[rows]
        captions = self._drop_captions(captions, generator, rows, global_rows)
        device = latent_mean.device
        latents = (latent_mean + latent_std * sample.to(device) - self.shift_factor) * self.scaling_factor
        batch = flow_matching_inputs(objective, self.scheduler, latents, noise.to(device), u)
        del batch["sigmas"]
        batch.update(self.text_inputs(captions, device))
        return batch


def inference_sigmas(
    objective: FlowMatchingObjective, num_steps: int, *, image_seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timesteps, sigmas)`` of ``num_steps`` Euler steps: ``sigmas`` has ``num_steps + 1`` entries ending in 0.

    The schedule is the scheduler's ``set_timesteps``: SD3's pipeline call (static ``shift``), or with
    ``use_dynamic_shifting`` Flux's (``sigmas = linspace(1, 1 / num_steps, num_steps)`` and ``mu`` of
    ``image_seq_len`` latent tokens).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    scheduler = objective.scheduler()
    if objective.use_dynamic_shifting:
        if image_seq_len is None:
            raise ValueError("use_dynamic_shifting needs image_seq_len (latent tokens per image) to pick the shift")
        scheduler.set_timesteps(
            sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps),  # Flux's pipeline, in float64 as there
            mu=objective.image_seq_len_shift(image_seq_len),
        )
    else:
        scheduler.set_timesteps(num_steps)
    return scheduler.timesteps.float(), scheduler.sigmas.float()


@torch.no_grad()
def euler_flow_sample(
    velocity: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    noise: torch.Tensor,
    *,
    objective: FlowMatchingObjective,
    num_steps: int,
    condition: torch.Tensor | None = None,
    uncondition: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    image_seq_len: int | None = None,
) -> torch.Tensor:
    """Integrate the flow from ``noise`` (sigma 1) to a sample (sigma 0) with Euler steps, in fp32.

    Each step is ``FlowMatchEulerDiscreteScheduler.step``'s: ``x <- x + (sigma_next - sigma) * v``. With
    ``guidance_scale > 1`` the velocity is classifier-free guided as in SD3's pipeline: one call on the batch
    ``[uncondition; condition]``, then ``v_u + guidance_scale * (v_c - v_u)``.

    Args:
        velocity: ``velocity(x, timesteps, condition) -> v``; ``timesteps`` is ``(batch,)`` on the scheduler's
            scale (``sigma * num_train_timesteps``), as in training.
        noise: the starting standard normal sample.
        objective: the `FlowMatchingObjective` (its scheduler's shift).
        num_steps: Euler steps.
        condition: the model's condition for each row (``None`` for an unconditional model).
        uncondition: the empty condition, one row per row of ``noise``; needed when ``guidance_scale > 1``.
        guidance_scale: classifier-free guidance scale; 1.0: no guidance. Default: 1.0.
        image_seq_len: latent tokens per image, for ``use_dynamic_shifting``.

    Returns:
        The sample, fp32, ``noise``'s shape.
    """
    timesteps, sigmas = inference_sigmas(objective, num_steps, image_seq_len=image_seq_len)
    guided = guidance_scale > 1
    if guided and (condition is None or uncondition is None):
        raise ValueError(f"guidance_scale={guidance_scale} needs both condition and uncondition")
    sample = noise.float()
    sigmas = sigmas.to(sample.device)
    for index in range(num_steps):
        t = timesteps[index].to(sample.device).expand(sample.shape[0])
        if guided:
            both = velocity(torch.cat([sample, sample]), torch.cat([t, t]), torch.cat([uncondition, condition]))
            v_uncond, v_cond = both.float().chunk(2)
            v = v_uncond + guidance_scale * (v_cond - v_uncond)
        else:
            v = velocity(sample, t, condition).float()
        sample = sample + (sigmas[index + 1] - sigmas[index]) * v
    return sample
