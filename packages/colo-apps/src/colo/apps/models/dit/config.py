"""`DiTConfig`: the shape of colo's PixArt-alpha / DiT-style diffusion transformer, in diffusers'
``PixArtTransformer2DModel`` config names, and its presets."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

TRITON_HEAD_DIMS = (16, 32, 64, 128)
"""Head sizes colo's Triton attention kernel takes; other sizes run the torch reference (see `DiTConfig`)."""


@dataclass(kw_only=True)
class DiTConfig:
    """A diffusion transformer over latent patches (Peebles & Xie, 2023, "Scalable Diffusion Models with
    Transformers"; Chen et al., 2023, "PixArt-alpha"): patchify, adaLN-single timestep conditioning, self-attention,
    cross-attention on the text encoder's hidden states, a GELU (tanh) MLP, unpatchify.

    The fields are ``PixArtTransformer2DModel``'s config fields of the same names (`diffusers_config` is that
    config), restricted to what PixArt-alpha / Sigma use: ``norm_type="ada_norm_single"``, ``attention_bias=True``,
    ``activation_fn="gelu-approximate"``, no dropout, no learned norm affine.
    """

    num_attention_heads: int = 16
    """Attention heads of every self- and cross-attention."""
    attention_head_dim: int = 72
    """Channels per head (the hidden size is ``num_attention_heads * attention_head_dim``). On CUDA, sizes other
    than 16, 32, 64 and 128 run the torch reference attention (colo's Triton kernel does not take them)."""
    in_channels: int = 4
    """Latent channels in."""
    out_channels: int | None = None
    """Channels out; ``None``: ``in_channels`` (flow matching / epsilon; PixArt-alpha's 8 learn a variance too)."""
    num_layers: int = 28
    """Transformer blocks."""
    sample_size: int = 128
    """The latent side trained at (positional embeddings are interpolated from it for other sizes)."""
    patch_size: int = 2
    """Side of a square latent patch (one token)."""
    cross_attention_dim: int | None = 1152
    """Width of the states the cross-attention reads: the hidden size when ``caption_channels`` is set (the caption
    is projected to it first), else the text encoder's width."""
    caption_channels: int | None = 4096
    """Width of the text encoder's states, projected to the hidden size by ``caption_projection`` (PixArt's T5-XXL:
    4096); ``None``: no projection, the cross-attention reads the states as they are."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon of the blocks."""
    interpolation_scale: float | None = None
    """Positional-embedding interpolation scale; ``None``: ``max(sample_size // 64, 1)`` (diffusers' default)."""
    use_additional_conditions: bool = False
    """PixArt-alpha's micro-conditions: the image resolution and aspect ratio are embedded and added to the
    timestep embedding (``added_cond_kwargs``); needs a hidden size divisible by 3."""
    num_embeds_ada_norm: int = 1000
    """Kept for diffusers' config (``PixArtTransformer2DModel`` requires it; no parameter depends on it)."""

    def __post_init__(self) -> None:
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "num_layers", "sample_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DiTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.patch_size < 1 or self.sample_size % self.patch_size:
            raise ValueError(
                f"DiTConfig.patch_size={self.patch_size} must divide sample_size={self.sample_size}; pick a divisor "
                "of the latent side"
            )
        if self.hidden_size % 4:
            raise ValueError(
                f"DiTConfig: the hidden size num_attention_heads x attention_head_dim = {self.hidden_size} must be a "
                "multiple of 4 (the 2-D sin-cos positional embedding splits it in four)"
            )
        if self.caption_channels is not None and self.cross_attention_dim != self.hidden_size:
            raise ValueError(
                f"DiTConfig.cross_attention_dim={self.cross_attention_dim} must equal the hidden size "
                f"{self.hidden_size} when caption_channels={self.caption_channels} (the caption is projected to the "
                "hidden size before the cross-attention); set it to the hidden size"
            )
        if self.caption_channels is None and self.cross_attention_dim is None:
            raise ValueError("DiTConfig needs caption_channels or cross_attention_dim (the text encoder's width)")
        if self.use_additional_conditions and self.hidden_size % 3:
            raise ValueError(
                f"DiTConfig.use_additional_conditions needs a hidden size divisible by 3 (resolution and aspect ratio "
                f"take a third each); {self.hidden_size} is not"
            )

    @property
    def hidden_size(self) -> int:
        """``num_attention_heads * attention_head_dim``."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        """``out_channels`` or, when ``None``, ``in_channels``."""
        return self.in_channels if self.out_channels is None else self.out_channels

    @property
    def text_width(self) -> int:
        """Width of the text states the model takes (``caption_channels``, else ``cross_attention_dim``)."""
        return self.caption_channels if self.caption_channels is not None else self.cross_attention_dim

    @property
    def positional_interpolation_scale(self) -> float:
        """``interpolation_scale``, or diffusers' default ``max(sample_size // 64, 1)``."""
        if self.interpolation_scale is not None:
            return self.interpolation_scale
        return max(self.sample_size // 64, 1)

    def diffusers_config(self) -> dict:
        """The ``PixArtTransformer2DModel`` config whose parameters have this model's names and shapes."""
        fields = asdict(self)
        return {
            **fields,
            "out_channels": self.output_channels,
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "dropout": 0.0,
            "upcast_attention": False,
            "attention_type": "default",
        }

    @classmethod
    def from_diffusers(cls, config: dict) -> DiTConfig:
        """The `DiTConfig` of a ``PixArtTransformer2DModel`` config (refusing fields this model does not build)."""
        fixed = {
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "dropout": 0.0,
            "upcast_attention": False,
            "attention_type": "default",
        }
        for name, value in fixed.items():
            if name in config and config[name] != value:
                raise ValueError(
                    f"PixArtTransformer2DModel config {name}={config[name]!r}: colo's DiT builds {value!r}"
                )
        names = set(cls.__dataclass_fields__)
        fields = {name: value for name, value in config.items() if name in names}
        if fields.get("use_additional_conditions") is None:  # diffusers' rule: on at sample_size 128 (1024 px)
            fields["use_additional_conditions"] = config.get("sample_size", 128) == 128
        return cls(**fields)


PRESETS: dict[str, DiTConfig] = {
    # CPU: 16-pixel images, an 8 x 8 latent from the tiny VAE, 2 x 2 patches (16 tokens), a 32-wide CLIP
    "tiny-dit": DiTConfig(
        num_attention_heads=4,
        attention_head_dim=32,
        num_layers=4,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=128,
        caption_channels=32,
    ),
    # PixArt-alpha XL/2 at 1024 px (latent 128, T5-XXL captions, micro-conditions), flow matching: 4 channels out
    "pixart-alpha-1024": DiTConfig(
        num_attention_heads=16,
        attention_head_dim=72,
        num_layers=28,
        sample_size=128,
        patch_size=2,
        cross_attention_dim=1152,
        caption_channels=4096,
        use_additional_conditions=True,
    ),
    # The same at 512 px (latent 64; PixArt-alpha's 512 checkpoint has no micro-conditions)
    "pixart-alpha-512": DiTConfig(
        num_attention_heads=16,
        attention_head_dim=72,
        num_layers=28,
        sample_size=64,
        patch_size=2,
        cross_attention_dim=1152,
        caption_channels=4096,
    ),
}
"""Named shapes: ``tiny-dit`` (CPU) and PixArt-alpha XL/2 (~600M parameters)."""


def get_preset(name: str, **overrides) -> DiTConfig:
    """The preset ``name`` with ``overrides`` applied (re-validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown DiT preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)
