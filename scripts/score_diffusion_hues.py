"""Score a diffusion export: for every prompt "a <colour> <shape> on <background>", sample N images and count those
whose foreground (the centre quarter of the image, where every procedural shape lies) has the prompted hue.

    python scripts/score_diffusion_hues.py PIPELINE_DIR [--samples 32] [--steps 10] [--guidance 3.0] [--grid out.png]

PIPELINE_DIR is a `colo convert --to diffusers` export: a StableDiffusionPipeline (UNet runs) or a PixArtAlphaPipeline
(``diffusion.denoiser: dit`` runs), sampled with the scheduler it holds (DPM-Solver++).
"""

from __future__ import annotations

import argparse
import colorsys
import json

import torch

from colo.apps.diffusion.data import COLORS

HUES = {name: colorsys.rgb_to_hsv(*rgb)[0] * 360 for name, rgb in COLORS.items()}
PROMPTS = [
    f"a {color} {shape} on {background}"
    for color, shape, background in [
        ("red", "circle", "white"),
        ("yellow", "square", "black"),
        ("green", "triangle", "gray"),
        ("cyan", "circle", "black"),
        ("blue", "square", "white"),
        ("magenta", "triangle", "gray"),
    ]
]


def foreground_colour(image: torch.Tensor) -> str | None:
    """The palette hue nearest the mean colour of the image's centre (``None`` when it is grey: no hue)."""
    _, h, w = image.shape
    centre = image[:, h * 3 // 8 : h * 5 // 8, w * 3 // 8 : w * 5 // 8].reshape(3, -1).mean(dim=1).clamp(0, 1)
    hue, saturation, _ = colorsys.rgb_to_hsv(*centre.tolist())
    if saturation < 0.25:
        return None
    distance = {name: min(abs(hue * 360 - h), 360 - abs(hue * 360 - h)) for name, h in HUES.items()}
    return min(distance, key=distance.get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--grid", default=None, help="also write a grid PNG (8 samples per prompt)")
    args = parser.parse_args()
    from diffusers import DiffusionPipeline

    from colo.apps.diffusion.sampling import sample_images, save_grid

    pipeline = DiffusionPipeline.from_pretrained(args.pipeline)
    pipeline.set_progress_bar_config(disable=True)
    denoiser = pipeline.unet if hasattr(pipeline, "unet") else pipeline.transformer  # SD or PixArt (a DiT run)
    size = denoiser.config.sample_size * pipeline.vae_scale_factor
    scores, grid = {}, []
    for prompt in PROMPTS:
        images = sample_images(
            pipeline,
            [prompt],
            seeds=list(range(args.samples)),
            steps=args.steps,
            guidance_scale=args.guidance,
            size=size,
        )
        wanted = prompt.split()[1]
        scores[prompt] = sum(foreground_colour(image) == wanted for image in images) / len(images)
        grid.append(images[:8])
    total = sum(scores.values()) / len(scores)
    print(json.dumps({"per_prompt": scores, "mean": total, "samples_per_prompt": args.samples}, indent=1))
    if args.grid:
        save_grid(torch.cat(grid), args.grid, columns=8)


if __name__ == "__main__":
    main()
