"""Captioned image sets: the embedded procedural one (coloured shapes on backgrounds, generated at run time, no
download) and an image folder with captions (diffusers' ``metadata.jsonl`` layout)."""

from __future__ import annotations

import json
import math
import os

import torch

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "yellow": (1.0, 1.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "blue": (0.0, 0.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
}
"""Foreground colours: six hues 60 degrees apart, full saturation."""
BACKGROUNDS: dict[str, tuple[float, float, float]] = {
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
    **COLORS,
}
"""Background colours: the greys and every foreground hue (never the shape's own)."""
SHAPES = ("circle", "square", "triangle")


def caption_vocabulary() -> list[str]:
    """Every word a procedural caption can hold (the tokenizer's vocabulary)."""
    return sorted({"a", "on", *COLORS, *BACKGROUNDS, *SHAPES})


def _shape_mask(shape: str, size: int, cx: float, cy: float, radius: float) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    if shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= radius**2
    if shape == "square":
        half = radius * 0.85
        return ((x - cx).abs() <= half) & ((y - cy).abs() <= half)
    # an upward triangle whose inscribed centre is (cx, cy)
    top, bottom = cy - radius, cy + radius * 0.75
    half_width = (y - top) / (bottom - top) * radius * 1.15
    return (y >= top) & (y <= bottom) & ((x - cx).abs() <= half_width)


class ShapesDataset(torch.utils.data.Dataset):
    """``length`` captioned images: a coloured circle, square or triangle on a background, e.g. "a red circle on
    blue". Item ``i`` is a function of ``(seed, i)`` only, so every rank and every run sees the same images.

    Items are ``{"pixel_values": (3, size, size) in [-1, 1], "caption": str}``.

    Args:
        length: number of images.
        image_size: side in pixels.
        seed: the set's seed.
    """

    def __init__(self, length: int = 512, *, image_size: int = 16, seed: int = 0) -> None:
        if length < 1 or image_size < 8:
            raise ValueError(f"ShapesDataset needs length >= 1 and image_size >= 8, got {length}, {image_size}")
        self.length, self.image_size, self.seed = length, image_size, seed

    def __len__(self) -> int:
        return self.length

    def describe(self, index: int) -> tuple[str, str, str, float, float, float]:
        """``(colour, shape, background, cx, cy, radius)`` of item ``index``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        colors, shapes = list(COLORS), list(SHAPES)
        color = colors[int(torch.randint(len(colors), (1,), generator=generator))]
        shape = shapes[int(torch.randint(len(shapes), (1,), generator=generator))]
        backgrounds = [b for b in BACKGROUNDS if b != color]
        background = backgrounds[int(torch.randint(len(backgrounds), (1,), generator=generator))]
        size = self.image_size
        u = torch.rand(3, generator=generator).tolist()
        radius = size * (0.28 + 0.1 * u[0])
        cx = size / 2 + (u[1] - 0.5) * size * 0.15
        cy = size / 2 + (u[2] - 0.5) * size * 0.15
        return color, shape, background, cx, cy, radius

    def caption(self, index: int) -> str:
        """The caption of item ``index`` (without drawing its image)."""
        color, shape, background, *_ = self.describe(index)
        return f"a {color} {shape} on {background}"

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(index)
        color, shape, background, cx, cy, radius = self.describe(index)
        mask = _shape_mask(shape, self.image_size, cx, cy, radius)
        image = torch.tensor(BACKGROUNDS[background]).view(3, 1, 1).expand(3, self.image_size, self.image_size).clone()
        image[:, mask] = torch.tensor(COLORS[color]).view(3, 1)
        return {"pixel_values": image * 2 - 1, "caption": f"a {color} {shape} on {background}"}


MOTIONS: dict[str, tuple[float, float]] = {
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
}
"""Directions a clip's shape moves in (x, y; image rows grow downwards)."""


def video_caption_vocabulary() -> list[str]:
    """Every word a `MovingShapesDataset` caption can hold."""
    return sorted({*caption_vocabulary(), "moving", *MOTIONS})


class MovingShapesDataset(ShapesDataset):
    """``length`` captioned clips of ``num_frames`` frames: `ShapesDataset`'s shape on its background, moving in a
    straight line, e.g. "a red circle moving left on blue". The shape's centre travels ``travel`` of the image side
    over the clip, centred on the still image's centre. A function of ``(seed, index)`` only.

    Items are ``{"pixel_values": (3, num_frames, size, size) in [-1, 1], "caption": str}`` (channels, frames, height,
    width: diffusers' video layout).

    Args:
        length: number of clips.
        image_size: side in pixels.
        num_frames: frames per clip (>= 2).
        travel: the distance the centre moves over the clip, as a fraction of the side. Default: 0.375.
        seed: the set's seed.
    """

    def __init__(
        self, length: int = 512, *, image_size: int = 16, num_frames: int = 4, travel: float = 0.375, seed: int = 0
    ) -> None:
        super().__init__(length, image_size=image_size, seed=seed)
        if num_frames < 2:
            raise ValueError(f"MovingShapesDataset needs num_frames >= 2, got {num_frames}; use ShapesDataset")
        self.num_frames, self.travel = num_frames, travel

    def motion(self, index: int) -> str:
        """The direction item ``index``'s shape moves in."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 7_919)
        return list(MOTIONS)[int(torch.randint(len(MOTIONS), (1,), generator=generator))]

    def caption(self, index: int) -> str:
        color, shape, background, *_ = self.describe(index)
        return f"a {color} {shape} moving {self.motion(index)} on {background}"

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(index)
        color, shape, background, cx, cy, radius = self.describe(index)
        dx, dy = MOTIONS[self.motion(index)]
        size, frames = self.image_size, self.num_frames
        clip = torch.tensor(BACKGROUNDS[background]).view(3, 1, 1, 1).expand(3, frames, size, size).clone()
        for frame in range(frames):
            offset = (frame / (frames - 1) - 0.5) * self.travel * size
            mask = _shape_mask(shape, size, cx + dx * offset, cy + dy * offset, radius)
            clip[:, frame, mask] = torch.tensor(COLORS[color]).view(3, 1)
        return {"pixel_values": clip * 2 - 1, "caption": self.caption(index)}


class ImageCaptionFolder(torch.utils.data.Dataset):
    """Images with captions from a folder holding ``metadata.jsonl`` lines ``{"file_name": ..., "text": ...}`` (the
    layout of diffusers' ``train_text_to_image.py`` image folders).

    Args:
        directory: the folder.
        resize: resize every image to ``resize x resize`` (bicubic) then centre-crop; ``None``: every image must
            already have the same size (mixed sizes are an error naming them).
    """

    def __init__(self, directory: str | os.PathLike, *, resize: int | None = None) -> None:
        from PIL import Image

        metadata = os.path.join(directory, "metadata.jsonl")
        if not os.path.exists(metadata):
            raise FileNotFoundError(f"{directory} has no metadata.jsonl with {{'file_name': ..., 'text': ...}} lines")
        with open(metadata) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        self.records = [(os.path.join(directory, r["file_name"]), r["text"]) for r in rows]
        self.resize = resize
        if resize is None:
            sizes = {}
            for path, _ in self.records:
                with Image.open(path) as image:
                    sizes.setdefault(image.size, path)
            if len(sizes) > 1:
                found = ", ".join(f"{w}x{h} ({os.path.basename(p)})" for (w, h), p in sizes.items())
                raise ValueError(
                    f"images in {directory} have mixed sizes: {found}; set diffusion.resize (e.g. 16) to resize "
                    "and centre-crop them, or resize them beforehand"
                )

    def __len__(self) -> int:
        return len(self.records)

    def caption(self, index: int) -> str:
        """The caption of item ``index`` (without reading its image)."""
        return self.records[index][1]

    def __getitem__(self, index: int) -> dict:
        from PIL import Image

        path, caption = self.records[index]
        with Image.open(path) as image:
            image = image.convert("RGB")
            if self.resize is not None:
                scale = self.resize / min(image.size)
                w, h = (
                    max(self.resize, math.ceil(image.width * scale)),
                    max(self.resize, math.ceil(image.height * scale)),
                )
                image = image.resize((w, h), Image.BICUBIC)
                left, top = (w - self.resize) // 2, (h - self.resize) // 2
                image = image.crop((left, top, left + self.resize, top + self.resize))
            data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
            pixels = data.view(image.height, image.width, 3).permute(2, 0, 1).float() / 255
        return {"pixel_values": pixels * 2 - 1, "caption": caption}


def frames_as_images(pixels: torch.Tensor) -> torch.Tensor:
    """``(batch, channels, frames, h, w)`` clips as ``(batch * frames, channels, h, w)`` images, frame-major per clip
    (4-D images pass unchanged)."""
    return pixels.transpose(1, 2).flatten(0, 1) if pixels.dim() == 5 else pixels


def images_as_frames(images: torch.Tensor, num_frames: int) -> torch.Tensor:
    """The inverse of `frames_as_images`: ``(batch * frames, channels, h, w)`` to ``(batch, channels, frames, h,
    w)``."""
    return images.unflatten(0, (-1, num_frames)).transpose(1, 2)


def collate(items: list[dict]) -> dict:
    """Stack pixel values, keep captions as a list (and any ``index``)."""
    batch = {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "caption": [item["caption"] for item in items],
    }
    return batch
