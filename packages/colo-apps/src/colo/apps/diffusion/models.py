"""Model builders of the diffusion recipe: a diffusers `UNet2DConditionModel` denoiser, a frozen `CLIPTextModel`
with a `CLIPTokenizer` built from a caption vocabulary, and a frozen `AutoencoderKL`, all from configs (no download).

diffusers and transformers are imported inside the functions (``pip install colo-apps[diffusion]``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def require_diffusers():
    """Import diffusers, or say how to install it."""
    try:
        import diffusers
    except ImportError as error:  # pragma: no cover - the testing extra installs it
        raise ImportError(
            "colo.apps.diffusion needs diffusers: pip install 'colo-apps[diffusion]' (diffusers>=0.42)"
        ) from error
    return diffusers


@dataclass(kw_only=True)
class DiffusionModelConfig:
    """Sizes of the three models (diffusers / transformers config fields; the defaults are the tiny CPU ones)."""

    image_size: int = 16
    """Side of the square training images in pixels."""
    unet_channels: tuple[int, ...] = (16, 32)
    """``block_out_channels`` of the UNet (one down/up block each; the first is plain, the rest cross-attention)."""
    unet_layers_per_block: int = 1
    """``layers_per_block`` of the UNet."""
    attention_head_dim: int = 8
    """Channels per attention head in the UNet's transformer blocks."""
    norm_num_groups: int = 8
    """GroupNorm groups of the UNet and VAE (divides every channel count)."""
    text_hidden_size: int = 32
    """Width of the CLIP text encoder (the UNet's ``cross_attention_dim``)."""
    text_layers: int = 2
    """Transformer layers of the CLIP text encoder."""
    text_heads: int = 2
    """Attention heads of the CLIP text encoder."""
    max_caption_tokens: int = 16
    """The text encoder's maximum sequence (``max_position_embeddings``, ``model_max_length``), BOS/EOS included."""
    vae_channels: tuple[int, ...] = (16, 32)
    """``block_out_channels`` of the AutoencoderKL (downsamples ``2 ** (len - 1)``)."""
    latent_channels: int = 4
    """Channels of the VAE latents (the UNet's in/out channels)."""
    unet_extra: dict = field(default_factory=dict)
    """More `UNet2DConditionModel` config fields (overrides), e.g. for an SD-1.5-sized UNet."""

    def __post_init__(self) -> None:
        for name in ("unet_channels", "vae_channels"):
            channels = tuple(getattr(self, name))
            setattr(self, name, channels)
            bad = [c for c in channels if c % self.norm_num_groups]
            if bad:
                raise ValueError(
                    f"DiffusionModelConfig.{name}={channels} has channel counts {bad} not divisible by "
                    f"norm_num_groups={self.norm_num_groups}; pick multiples of it"
                )
        factor = 2 ** (len(self.vae_channels) - 1)
        if self.image_size % factor:
            raise ValueError(f"image_size={self.image_size} must be a multiple of the VAE's downsampling {factor}")

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae_channels) - 1)

    def unet_config(self) -> dict:
        """The `UNet2DConditionModel` config."""
        num = len(self.unet_channels)
        down = ["DownBlock2D"] + ["CrossAttnDownBlock2D"] * (num - 1)
        up = ["CrossAttnUpBlock2D"] * (num - 1) + ["UpBlock2D"]
        heads = [max(1, c // self.attention_head_dim) for c in self.unet_channels]
        config = {
            "sample_size": self.latent_size,
            "in_channels": self.latent_channels,
            "out_channels": self.latent_channels,
            "down_block_types": down,
            "up_block_types": up,
            "block_out_channels": list(self.unet_channels),
            "layers_per_block": self.unet_layers_per_block,
            "cross_attention_dim": self.text_hidden_size,
            "attention_head_dim": heads,
            "norm_num_groups": self.norm_num_groups,
        }
        return {**config, **self.unet_extra}

    def vae_config(self) -> dict:
        """The `AutoencoderKL` config."""
        num = len(self.vae_channels)
        return {
            "in_channels": 3,
            "out_channels": 3,
            "down_block_types": ["DownEncoderBlock2D"] * num,
            "up_block_types": ["UpDecoderBlock2D"] * num,
            "block_out_channels": list(self.vae_channels),
            "latent_channels": self.latent_channels,
            "norm_num_groups": self.norm_num_groups,
            "sample_size": self.image_size,
        }

    def text_config(self, vocab_size: int, *, bos_token_id: int, eos_token_id: int) -> dict:
        """The `CLIPTextConfig` fields."""
        return {
            "vocab_size": vocab_size,
            "hidden_size": self.text_hidden_size,
            "intermediate_size": 2 * self.text_hidden_size,
            "num_hidden_layers": self.text_layers,
            "num_attention_heads": self.text_heads,
            "max_position_embeddings": self.max_caption_tokens,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": eos_token_id,
        }


def build_unet(config: DiffusionModelConfig, *, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised `UNet2DConditionModel` (the same on every rank for the same ``seed``)."""
    import inspect

    diffusers = require_diffusers()
    known = set(inspect.signature(diffusers.UNet2DConditionModel.__init__).parameters) - {"self"}
    unknown = sorted(set(config.unet_extra) - known)
    if unknown:
        raise ValueError(
            f"diffusion.unet_config names {unknown}, which are not UNet2DConditionModel config fields; see "
            "diffusers' UNet2DConditionModel (e.g. block_out_channels, attention_head_dim, cross_attention_dim)"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return diffusers.UNet2DConditionModel(**config.unet_config())


def build_dit(config, *, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised `colo.apps.models.dit.DiffusionTransformer` of the `DiTConfig` ``config`` (PixArt's
    initialization, the same on every rank for the same ``seed``)."""
    from ..models.dit import DiffusionTransformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionTransformer(config)
        model.initialize_weights()
    return model


def build_vae(config: DiffusionModelConfig, *, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised `AutoencoderKL` (train it, or load one, before using it as the frozen encoder)."""
    diffusers = require_diffusers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return diffusers.AutoencoderKL(**config.vae_config())


def _learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-pair merges that make every word of ``words`` one token (CLIP's convention: the last symbol of a word
    carries ``</w>``); learned most-frequent-pair first, ties broken by the pair's text, so deterministic."""
    pieces = {word: [*word[:-1], word[-1] + "</w>"] for word in words}
    merges = []
    while True:
        pairs = Counter(p for symbols in pieces.values() for p in zip(symbols, symbols[1:]))
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for word, symbols in pieces.items():
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            pieces[word] = merged


def save_caption_tokenizer(words: list[str], directory: str | os.PathLike, *, max_length: int):
    """Write a `CLIPTokenizer` whose vocabulary is ``words`` (each one token) to ``directory`` and load it.

    The vocabulary holds the two special tokens, every lowercase ASCII letter and digit alone and with ``</w>``
    (so an unseen word still tokenizes, letter by letter), the merges' products, and nothing else.
    """
    from transformers import CLIPTokenizer

    words = sorted({w.lower() for w in words})
    bad = [w for w in words if not w.isalnum() or not w.isascii()]
    if bad:
        raise ValueError(f"caption vocabulary words must be ASCII letters/digits, got {bad}")
    merges = _learn_merges(words)
    symbols = [BOS, EOS]
    for char in "abcdefghijklmnopqrstuvwxyz0123456789":
        symbols += [char, char + "</w>"]
    symbols += [a + b for a, b in merges if a + b not in symbols]
    os.makedirs(directory, exist_ok=True)
    vocab = {symbol: index for index, symbol in enumerate(dict.fromkeys(symbols))}
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokenizer = CLIPTokenizer(
        os.path.join(directory, "vocab.json"),
        os.path.join(directory, "merges.txt"),
        model_max_length=max_length,
        unk_token=EOS,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
    )
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_text_encoder(config: DiffusionModelConfig, tokenizer, *, seed: int = 0, pretrained: str | None = None):
    """A frozen `CLIPTextModel`: from ``pretrained`` (a local directory) or a config sized by ``config`` and the
    tokenizer's vocabulary, seeded."""
    from transformers import CLIPTextConfig, CLIPTextModel

    if pretrained is not None:
        model = CLIPTextModel.from_pretrained(pretrained)
    else:
        text_config = CLIPTextConfig(
            **config.text_config(
                len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
            )
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CLIPTextModel(text_config)
    model.requires_grad_(False)
    return model.eval()


def tokenize_captions(tokenizer, captions: list[str], *, return_mask: bool = False):
    """Token ids padded to the tokenizer's maximum; a caption longer than it is an error (not silently cut). With
    ``return_mask``: ``(ids, mask)``, the mask 1 on the caption's tokens (BOS/EOS included), 0 on the padding."""
    encoded = tokenizer(list(captions), padding="max_length", truncation=False, return_tensors=None)
    ids = encoded["input_ids"]
    limit = tokenizer.model_max_length
    for caption, row in zip(captions, ids):
        if len(row) > limit:
            raise ValueError(
                f"caption {caption!r} is {len(row)} tokens with BOS/EOS, more than the text encoder's maximum "
                f"{limit}; shorten it or raise model.max_caption_tokens"
            )
    if return_mask:
        return torch.tensor(ids, dtype=torch.long), torch.tensor(encoded["attention_mask"], dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long)
