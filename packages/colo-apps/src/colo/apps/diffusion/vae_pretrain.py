"""Training the tiny ``AutoencoderKL`` of the CPU preset on its own images (no pretrained VAE exists offline, and
a random one decodes noise): reconstruction MSE + a small KL term, then the VAE is frozen."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import collate, frames_as_images


def pretrain_vae(
    vae, dataset, *, steps: int, lr: float, batch_size: int = 16, seed: int = 0, kl_weight: float = 1e-6
) -> list[float]:
    """Train ``vae`` in place for ``steps`` AdamW steps on ``dataset`` (a video set's frames as images); returns the
    losses. Sets
    ``vae.config.scaling_factor`` to ``1 / std`` of the latents of one batch (as Stable Diffusion's 0.18215 was
    chosen), so the denoiser sees unit-variance latents."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr)
    vae.train().requires_grad_(True)
    losses = []
    for _ in range(steps):
        indices = torch.randint(len(dataset), (batch_size,), generator=generator).tolist()
        pixels = frames_as_images(collate([dataset[i] for i in indices])["pixel_values"])
        posterior = vae.encode(pixels).latent_dist
        reconstruction = vae.decode(posterior.sample(generator=generator)).sample
        loss = F.mse_loss(reconstruction, pixels) + kl_weight * posterior.kl().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        pixels = frames_as_images(collate([dataset[i] for i in range(min(len(dataset), 64))])["pixel_values"])
        std = vae.encode(pixels).latent_dist.mean.std().item()
    vae.register_to_config(scaling_factor=1.0 / max(std, 1e-6))
    return losses
