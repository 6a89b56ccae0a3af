"""The latent cache (``diffusion.cache_latents``): the frozen VAE encodes the run's images once, and training reads
the posterior's mean and std from disk, drawing a fresh latent ``mean + std * noise`` every step.

The noise is the builder's (`DiffusionBatchBuilder`: the first draw of `step_generator`), so a cached run draws the
same latents as one that encodes on the fly, and training holds no VAE (the sample grids load it when they run).

On disk: a directory (``output_dir/latents``) with one safetensors file per rank that wrote it,
``part-<rank>-of-<world>.safetensors`` holding ``indices`` (dataset rows), ``mean`` and ``std`` (fp32); each file's
metadata names the cache's fingerprint (a hash of the VAE's config and weights and of the images), the VAE's scaling
factor and the number of images. Written to ``latents.tmp`` and committed by a rename, so a killed run leaves no half
cache; a run that finds a cache reuses it when the fingerprint matches (resume) and rebuilds it otherwise (other
images, another VAE).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .data import ImageCaptionFolder, collate

CACHE_DIR = "latents"
"""The cache's directory under the run's ``output_dir``."""
FORMAT = "colo-latent-cache-1"


def vae_fingerprint(vae) -> str:
    """sha256 of the VAE's config (its scaling factor included) and of every weight's name, dtype, shape and bytes."""
    config = {key: value for key, value in vae.config.items() if not key.startswith("_")}  # not diffusers' own notes
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(vae.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def dataset_fingerprint(dataset) -> str:
    """sha256 of what the latents depend on: an `ImageCaptionFolder`'s files (names and bytes) and resize setting,
    or any other dataset's pixel values (captions are not cached, so they are not hashed)."""
    digest = hashlib.sha256(f"{type(dataset).__name__}:{len(dataset)}".encode())
    if isinstance(dataset, ImageCaptionFolder):
        digest.update(f"resize={dataset.resize}".encode())
        for path, _ in dataset.records:
            digest.update(os.path.basename(path).encode())
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
        return digest.hexdigest()
    for index in range(len(dataset)):
        digest.update(dataset[index]["pixel_values"].contiguous().numpy().tobytes())
    return digest.hexdigest()


def cache_fingerprint(dataset, vae) -> str:
    """The fingerprint a cache of ``dataset`` encoded by ``vae`` is stored under."""
    return hashlib.sha256(f"{FORMAT}:{vae_fingerprint(vae)}:{dataset_fingerprint(dataset)}".encode()).hexdigest()


@dataclass
class LatentCache:
    """The posterior statistics of every image, by dataset row."""

    mean: torch.Tensor
    """``(num_images, latent_channels, h, w)`` fp32."""
    std: torch.Tensor
    """Same shape: ``exp(logvar / 2)`` of the VAE's posterior."""
    scaling_factor: float
    """The VAE's ``scaling_factor`` (latents are ``(mean + std * noise) * scaling_factor``)."""
    fingerprint: str
    """`cache_fingerprint` of the images and VAE it was built from."""

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, std)`` of the dataset rows ``indices``."""
        index = torch.tensor(indices, dtype=torch.long)
        return self.mean[index], self.std[index]


def read_fingerprint(directory: str) -> str | None:
    """The fingerprint of the cache in ``directory`` (None: no complete cache there)."""
    from safetensors import safe_open

    parts = sorted(glob.glob(os.path.join(directory, "part-*.safetensors")))
    if not parts:
        return None
    with safe_open(parts[0], framework="pt") as f:
        return (f.metadata() or {}).get("fingerprint")


def load_latent_cache(directory: str) -> LatentCache:
    """Read the cache in ``directory`` (any number of parts, written at any world size)."""
    from safetensors import safe_open

    parts = sorted(glob.glob(os.path.join(directory, "part-*.safetensors")))
    if not parts:
        raise FileNotFoundError(f"{directory} holds no latent cache (part-*.safetensors)")
    indices, means, stds, metadata = [], [], [], []
    for part in parts:
        with safe_open(part, framework="pt") as f:
            metadata.append(f.metadata() or {})
            indices.append(f.get_tensor("indices"))
            means.append(f.get_tensor("mean"))
            stds.append(f.get_tensor("std"))
    fingerprints = {m.get("fingerprint") for m in metadata}
    if len(fingerprints) != 1:
        raise ValueError(f"the parts of the latent cache {directory} come from different runs; delete it to rebuild")
    num_images = int(metadata[0]["num_images"])
    order = torch.cat(indices)
    if not torch.equal(order.sort().values, torch.arange(num_images)):
        raise ValueError(f"the latent cache {directory} does not hold every one of its {num_images} images once")
    mean, std = torch.empty((num_images, *means[0].shape[1:])), torch.empty((num_images, *stds[0].shape[1:]))
    mean[order], std[order] = torch.cat(means), torch.cat(stds)
    return LatentCache(mean, std, float(metadata[0]["scaling_factor"]), metadata[0]["fingerprint"])


@torch.no_grad()
def _encode(vae, dataset, indices: list[int], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    for start in range(0, len(indices), batch_size):
        pixels = collate([dataset[i] for i in indices[start : start + batch_size]])["pixel_values"]
        posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        means.append(posterior.mean.float().cpu())
        stds.append(posterior.std.float().cpu())
    return torch.cat(means), torch.cat(stds)


def build_latent_cache(
    directory: str, dataset, vae, *, rank: int = 0, world_size: int = 1, batch_size: int = 32
) -> LatentCache:
    """The cache of ``dataset`` under ``vae`` in ``directory``: reused when its fingerprint matches, (re)built
    otherwise, each rank encoding its contiguous share of the images (every rank calls it; a collective when
    ``world_size > 1``).

    Returns:
        The whole cache, on every rank.
    """
    fingerprint = cache_fingerprint(dataset, vae)
    found = read_fingerprint(directory)
    if found == fingerprint:
        return load_latent_cache(directory)
    if found is not None and rank == 0:
        warnings.warn(
            f"the latent cache {directory} was built from other images or another VAE (fingerprint {found[:12]}, "
            f"now {fingerprint[:12]}); rebuilding it",
            stacklevel=2,
        )
    staging = directory.rstrip("/") + ".tmp"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    if world_size > 1:
        dist.barrier()
    per_rank = -(-len(dataset) // world_size)
    indices = list(range(rank * per_rank, min(len(dataset), (rank + 1) * per_rank)))
    from safetensors.torch import save_file

    metadata = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "scaling_factor": repr(float(vae.config.scaling_factor)),
        "num_images": str(len(dataset)),
    }
    if indices:  # more ranks than images: the last ones have none
        mean, std = _encode(vae, dataset, indices, batch_size)
        tensors = {
            "indices": torch.tensor(indices, dtype=torch.long),
            "mean": mean.contiguous(),
            "std": std.contiguous(),
        }
        save_file(tensors, os.path.join(staging, f"part-{rank:05d}-of-{world_size:05d}.safetensors"), metadata=metadata)
    if world_size > 1:
        dist.barrier()
    if rank == 0:  # commit: the old cache (if any) moves aside, the new one takes its name, the old one goes
        stale = directory.rstrip("/") + ".stale"
        shutil.rmtree(stale, ignore_errors=True)
        if os.path.exists(directory):
            os.replace(directory, stale)
        os.replace(staging, directory)
        shutil.rmtree(stale, ignore_errors=True)
    if world_size > 1:
        dist.barrier()
    return load_latent_cache(directory)
