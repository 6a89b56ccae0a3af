"""Score a video DiT run (``diffusion.num_frames > 1``, e.g. ``tiny-video-dit``): for every prompt "a <colour> <shape>
moving <direction> on <background>", sample N clips from the checkpoint's EMA weights (Euler flow steps through colo's
DiT, each frame decoded by the run's VAE) and count

- hue: clips whose foreground (the centre quarter of each frame, which the moving shape always covers) has the
  prompted hue in most frames (as `score_diffusion_hues.py` scores images);
- motion: clips whose prompted-hue pixels' centroid moves from the first frame to the last in the prompted direction,
  by at least 1 px along it and more than across it.

    python scripts/score_video_dit.py CHECKPOINT [--samples 16] [--steps 10] [--guidance 3.0] [--grid out.png]
"""

from __future__ import annotations

import argparse
import colorsys
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from score_diffusion_hues import HUES, foreground_colour  # noqa: E402

PROMPTS = [
    ("red", "circle", "right", "white"),
    ("yellow", "square", "left", "black"),
    ("green", "triangle", "up", "gray"),
    ("cyan", "circle", "down", "black"),
    ("blue", "square", "right", "white"),
    ("magenta", "triangle", "left", "gray"),
]


def centroid(frame: torch.Tensor, colour: str) -> tuple[float, float] | None:
    """``(x, y)`` of the pixels within 30 degrees of ``colour``'s hue (saturation > 0.25), or ``None``."""
    pixels = frame.permute(1, 2, 0).reshape(-1, 3).clamp(0, 1).tolist()
    width = frame.shape[2]
    xs, ys = [], []
    for index, rgb in enumerate(pixels):
        hue, saturation, _ = colorsys.rgb_to_hsv(*rgb)
        distance = abs(hue * 360 - HUES[colour])
        if saturation > 0.25 and min(distance, 360 - distance) < 30:
            ys.append(index // width)
            xs.append(index % width)
    if not xs:
        return None
    return sum(xs) / len(xs), sum(ys) / len(ys)


def moves(clip: torch.Tensor, colour: str, direction: str) -> bool:
    """Whether the ``colour`` centroid of ``clip`` (``(3, frames, h, w)``) travels in ``direction``."""
    from colo.apps.diffusion.data import MOTIONS

    first, last = centroid(clip[:, 0], colour), centroid(clip[:, -1], colour)
    if first is None or last is None:
        return False
    dx, dy = MOTIONS[direction]
    along = (last[0] - first[0]) * dx + (last[1] - first[1]) * dy
    across = abs((last[0] - first[0]) * dy) + abs((last[1] - first[1]) * dx)
    return along >= 1.0 and along > across


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--grid", default=None, help="also write a grid PNG (2 clips per prompt, frames in a row)")
    args = parser.parse_args()
    from colo.apps.diffusion.data import frames_as_images
    from colo.apps.diffusion.ema import PREFIX, ema_checkpoint
    from colo.apps.diffusion.export import diffusion_run, frozen_side
    from colo.apps.diffusion.sampling import sample_flow_video, save_grid
    from colo.apps.models.dit import DiffusionTransformer
    from colo.apps.train.config import RunConfig
    from colo.tensor.checkpoint import load_checkpoint

    run = diffusion_run(args.checkpoint)
    config = RunConfig.model_validate(run["config"])
    section = config.diffusion
    tokenizer, text_encoder, vae = frozen_side(run, config)
    transformer = DiffusionTransformer(section.dit_config_object())
    state = {PREFIX + "transformer." + name: value for name, value in transformer.state_dict().items()}
    load_checkpoint(ema_checkpoint(args.checkpoint), state, strict=False)
    transformer.load_state_dict({name.removeprefix(PREFIX + "transformer."): v for name, v in state.items()})
    hue, motion, grid = {}, {}, []
    for colour, shape, direction, background in PROMPTS:
        prompt = f"a {colour} {shape} moving {direction} on {background}"
        clips = sample_flow_video(
            transformer=transformer.eval(),
            vae=vae.eval(),
            text_encoder=text_encoder.eval(),
            tokenizer=tokenizer,
            objective=section.training_objective(),
            prompts=[prompt],
            seeds=list(range(args.samples)),
            steps=args.steps,
            guidance_scale=args.guidance,
            size=section.image_size,
            num_frames=section.num_frames,
        )
        frames = clips.shape[2]
        hue[prompt] = sum(
            sum(foreground_colour(clip[:, t]) == colour for t in range(frames)) > frames / 2 for clip in clips
        ) / len(clips)
        motion[prompt] = sum(moves(clip, colour, direction) for clip in clips) / len(clips)
        grid.append(frames_as_images(clips[:2]))
    print(
        json.dumps(
            {
                "hue": hue,
                "motion": motion,
                "hue_mean": sum(hue.values()) / len(hue),
                "motion_mean": sum(motion.values()) / len(motion),
                "samples_per_prompt": args.samples,
            },
            indent=1,
        )
    )
    if args.grid:
        save_grid(torch.cat(grid), args.grid, columns=section.num_frames)


if __name__ == "__main__":
    main()
