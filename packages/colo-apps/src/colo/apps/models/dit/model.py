"""colo's diffusion transformer (`DiffusionTransformer`): PixArt-alpha's architecture with the parameter names and
shapes of diffusers' ``PixArtTransformer2DModel``, so its state dict loads strictly into that class (export is a
save) and back.

Architecture only, as the Llama's model file: attention runs through `colo.kernels.flash_attention` (Triton on
CUDA, the torch reference elsewhere) and the LayerNorms through `colo.kernels.layer_norm`; parallelism is applied
from outside. Activations are ``(batch, tokens, hidden)``; attention keeps the kernels' ``(batch, seq, heads,
head_dim)`` layout.

The caption mask (``encoder_attention_mask``, 1 = keep) becomes a document mask of the cross-attention, built once
per forward: the caption's tokens are document 0 with the queries, its padding document 1. diffusers adds a bias of
-10000 to the padded keys' scores instead, which in fp32 gives them a weight of exactly 0 too; the two differ only
for a caption with no token kept (colo: zero attention output; diffusers: attention over the padding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from colo.kernels import DocumentMask, build_document_mask, flash_attention, layer_norm

from .config import TRITON_HEAD_DIMS, DiTConfig

TIMESTEP_CHANNELS = 256
"""Width of the sinusoidal timestep (and micro-condition) features."""


def timestep_features(timesteps: torch.Tensor, channels: int = TIMESTEP_CHANNELS) -> torch.Tensor:
    """``(n, channels)`` sinusoidal features of ``n`` (fractional) timesteps, ``[cos | sin]`` over frequencies
    ``10000 ** (-i / (channels / 2))`` (diffusers' ``Timesteps(channels, flip_sin_to_cos=True,
    downscale_freq_shift=0)``), in fp32."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    angles = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def sincos_positions(dim: int, height: int, width: int, *, base_size: int, scale: float, device=None) -> torch.Tensor:
    """``(height * width, dim)`` 2-D sin-cos positional embeddings of a row-major patch grid (MAE / DiT), as
    diffusers' ``get_2d_sincos_pos_embed``: the first half encodes the column, the second the row, each coordinate
    rescaled to a ``base_size`` grid and divided by ``scale``; frequencies in fp64, the result in fp32."""
    rows = torch.arange(height, device=device, dtype=torch.float32) / (height / base_size) / scale
    cols = torch.arange(width, device=device, dtype=torch.float32) / (width / base_size) / scale
    grid_rows, grid_cols = torch.meshgrid(rows, cols, indexing="ij")
    omega = torch.arange(dim // 4, device=device, dtype=torch.float64) / (dim / 4.0)
    omega = 1.0 / 10000**omega

    def one_axis(positions: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(positions.reshape(-1), omega)
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    return torch.cat([one_axis(grid_cols), one_axis(grid_rows)], dim=1).float()


def frame_positions(dim: int, frames: int, *, device=None) -> torch.Tensor:
    """``(frames, dim)`` 1-D sin-cos embeddings of the frame index (``[sin | cos]`` over frequencies
    ``10000 ** (-i / (dim / 2))``, diffusers' ``get_1d_sincos_pos_embed_from_grid``): the temporal positions a
    video latent's tokens add to their spatial ones (Open-Sora's spatial-temporal DiT adds them the same way).
    Frequencies in fp64, the result in fp32."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, device=device, dtype=torch.float64) / (dim / 2.0))
    angles = torch.outer(torch.arange(frames, device=device, dtype=torch.float64), omega)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch_size`` patches to tokens (a strided convolution) plus the fixed sin-cos positions
    (computed for the input's grid, interpolated from ``sample_size`` as diffusers does).

    A video latent ``(batch, channels, frames, height, width)`` is patchified frame by frame with the same
    convolution; its tokens are frame-major (``frames x rows x cols``) and add `frame_positions` of their frame to
    the spatial positions of their patch."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.base_size = config.sample_size // config.patch_size
        self.scale = config.positional_interpolation_scale
        self.proj = nn.Conv2d(config.in_channels, config.hidden_size, config.patch_size, stride=config.patch_size)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        height, width = latents.shape[-2] // self.patch_size, latents.shape[-1] // self.patch_size
        frames = latents.shape[2] if latents.dim() == 5 else None
        if frames is not None:  # (batch, channels, frames, h, w) -> (batch * frames, channels, h, w)
            latents = latents.transpose(1, 2).flatten(0, 1)
        tokens = self.proj(latents).flatten(2).transpose(1, 2)
        positions = sincos_positions(
            tokens.shape[-1], height, width, base_size=self.base_size, scale=self.scale, device=tokens.device
        )
        if frames is None:
            return (tokens + positions.unsqueeze(0)).to(tokens.dtype)
        temporal = frame_positions(tokens.shape[-1], frames, device=tokens.device)
        positions = (positions[None] + temporal[:, None]).flatten(0, 1)  # frame-major: (frames * rows * cols, dim)
        tokens = tokens.reshape(-1, frames * height * width, tokens.shape[-1])
        return (tokens + positions.unsqueeze(0)).to(tokens.dtype)


class TimestepEmbedding(nn.Module):
    """``linear_2(silu(linear_1(features)))``: the MLP over sinusoidal features (diffusers' ``TimestepEmbedding``)."""

    def __init__(self, in_features: int, width: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, width)
        self.linear_2 = nn.Linear(width, width)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(features)))


class ConditionEmbedding(nn.Module):
    """The timestep embedding, plus (with micro-conditions) the embeddings of the resolution and aspect ratio, each
    a third of the width (PixArt-alpha's ``PixArtAlphaCombinedTimestepSizeEmbeddings``)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        width = config.hidden_size
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, width)
        self.use_additional_conditions = config.use_additional_conditions
        if self.use_additional_conditions:
            self.resolution_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, width // 3)
            self.aspect_ratio_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, width // 3)

    def forward(self, timestep, *, resolution=None, aspect_ratio=None, dtype: torch.dtype) -> torch.Tensor:
        embedded = self.timestep_embedder(timestep_features(timestep).to(dtype))
        if not self.use_additional_conditions:
            return embedded
        if resolution is None or aspect_ratio is None:
            raise ValueError(
                "this DiT has use_additional_conditions: pass added_cond_kwargs={'resolution': (batch, 2), "
                "'aspect_ratio': (batch, 1)}"
            )
        batch = timestep.shape[0]
        size = self.resolution_embedder(timestep_features(resolution.flatten()).to(dtype)).reshape(batch, -1)
        ratio = self.aspect_ratio_embedder(timestep_features(aspect_ratio.flatten()).to(dtype)).reshape(batch, -1)
        return embedded + torch.cat([size, ratio], dim=1)


class AdaLayerNormSingle(nn.Module):
    """adaLN-single (PixArt-alpha, section 2.3): one MLP for the whole model maps the condition embedding to the six
    shift / scale / gate vectors every block adds its own learned table to.

    Returns ``(modulation, embedded)``: ``(batch, 6 * hidden)`` and the ``(batch, hidden)`` embedding itself (the
    output layer's modulation)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.emb = ConditionEmbedding(config)
        self.linear = nn.Linear(config.hidden_size, 6 * config.hidden_size)

    def forward(self, timestep, *, resolution=None, aspect_ratio=None, dtype: torch.dtype):
        embedded = self.emb(timestep, resolution=resolution, aspect_ratio=aspect_ratio, dtype=dtype)
        return self.linear(F.silu(embedded)), embedded


class CaptionProjection(nn.Module):
    """The text states to the hidden size: ``linear_2(gelu_tanh(linear_1(caption)))``."""

    def __init__(self, in_features: int, width: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, width)
        self.linear_2 = nn.Linear(width, width)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(caption), approximate="tanh"))


class DiTAttentionCore(nn.Module):
    """Non-causal ``softmax(q k^T / sqrt(d)) v`` over ``(batch, seq, heads, head_dim)`` on
    `colo.kernels.flash_attention`; parameter-free, the module a sequence-parallel plan wraps. Head sizes the
    Triton kernel does not take (`TRITON_HEAD_DIMS`) run the torch reference."""

    def forward(self, q, k, v, *, document_ids: DocumentMask | None = None) -> torch.Tensor:
        backend = None if q.shape[-1] in TRITON_HEAD_DIMS else "torch"
        return flash_attention(q, k, v, causal=False, backend=backend, document_ids=document_ids)


class DiTAttention(nn.Module):
    """Multi-head attention with biased q / k / v / out projections (diffusers' ``Attention`` names: ``to_q``,
    ``to_k``, ``to_v``, ``to_out.0``); self-attention, or cross-attention when called with ``context``.

    The number of heads is read from the projections' width (``width // head_dim``), so a tensor-parallel plan that
    splits ``to_q`` / ``to_k`` / ``to_v`` by output features (whole heads per rank) and ``to_out.0`` by input
    features needs no attribute rewritten.
    """

    def __init__(self, config: DiTConfig, *, context_dim: int | None = None):
        super().__init__()
        width = config.hidden_size
        self.head_dim = config.attention_head_dim
        self.to_q = nn.Linear(width, width)
        self.to_k = nn.Linear(context_dim or width, width)
        self.to_v = nn.Linear(context_dim or width, width)
        self.to_out = nn.ModuleList([nn.Linear(width, width)])
        self.core = DiTAttentionCore()

    def forward(self, x, context=None, *, document_ids: DocumentMask | None = None) -> torch.Tensor:
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        batch, head_dim = q.shape[0], self.head_dim
        q = q.reshape(batch, q.shape[1], -1, head_dim)
        k = k.reshape(batch, k.shape[1], -1, head_dim)
        v = v.reshape(batch, v.shape[1], -1, head_dim)
        out = self.core(q, k, v) if document_ids is None else self.core(q, k, v, document_ids=document_ids)
        return self.to_out[0](out.reshape(batch, out.shape[1], -1))


class GELUProjection(nn.Module):
    """``gelu_tanh(proj(x))`` (diffusers' ``GELU(approximate="tanh")``)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """The 4x GELU (tanh) MLP; ``net.0.proj`` and ``net.2`` as in diffusers (``net.1`` is its dropout, here an
    identity)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        width = config.hidden_size
        self.net = nn.ModuleList([GELUProjection(width, 4 * width), nn.Identity(), nn.Linear(4 * width, width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class DiTBlock(nn.Module):
    """A PixArt block: ``x += gate_msa * attn1(modulate(norm(x)))``, ``x += attn2(x, caption)`` (no norm, no
    modulation: PixArt's cross-attention), ``x += gate_mlp * ff(modulate(norm(x)))``; the six shift / scale / gate
    vectors are the block's ``scale_shift_table`` plus the model's adaLN-single output."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        width = config.hidden_size
        self.eps = config.norm_eps
        self.attn1 = DiTAttention(config)
        self.attn2 = DiTAttention(config, context_dim=config.cross_attention_dim)
        self.ff = FeedForward(config)
        self.scale_shift_table = nn.Parameter(torch.empty(6, width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """diffusers' initialization of the table: ``randn / sqrt(hidden)`` (nothing on the meta device)."""
        if not self.scale_shift_table.is_meta:
            with torch.no_grad():
                table = self.scale_shift_table
                table.copy_(torch.randn_like(table) / table.shape[1] ** 0.5)

    def forward(self, x, caption, modulation, *, caption_mask: DocumentMask | None = None) -> torch.Tensor:
        batch = x.shape[0]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + modulation.reshape(batch, 6, -1)
        ).chunk(6, dim=1)
        normed = layer_norm(x, None, None, self.eps) * (1 + scale_msa) + shift_msa
        x = gate_msa * self.attn1(normed) + x
        x = self.attn2(x, caption, document_ids=caption_mask) + x
        normed = layer_norm(x, None, None, self.eps) * (1 + scale_mlp) + shift_mlp
        return gate_mlp * self.ff(normed) + x


class DiffusionTransformer(nn.Module):
    """PixArt-alpha / DiT-style denoiser over latent patches (see the module docstring); parameter names and shapes
    are ``PixArtTransformer2DModel``'s for ``config.diffusers_config()``.

    Args:
        config (DiTConfig): the shape.
    """

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = config
        width, patch = config.hidden_size, config.patch_size
        self.pos_embed = PatchEmbed(config)
        self.transformer_blocks = nn.ModuleList([DiTBlock(config) for _ in range(config.num_layers)])
        self.scale_shift_table = nn.Parameter(torch.empty(2, width))
        self.proj_out = nn.Linear(width, patch * patch * config.output_channels)
        self.adaln_single = AdaLayerNormSingle(config)
        self.caption_projection = None
        if config.caption_channels is not None:
            self.caption_projection = CaptionProjection(config.caption_channels, width)
        if not self.scale_shift_table.is_meta:
            with torch.no_grad():
                self.scale_shift_table.copy_(torch.randn(2, width) / width**0.5)

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """PixArt-alpha's initialization (its ``initialize_weights``, after DiT's): Xavier-uniform linears with zero
        biases, the patch embedding Xavier-uniform over its flattened kernel, the timestep / micro-condition MLPs,
        adaLN-single and the caption projection N(0, 0.02), and the cross-attention outputs and the final projection
        zero, so every block starts as self-attention and MLP only and the model predicts 0. The scale-shift tables
        keep diffusers' ``randn / sqrt(hidden)``. Draws from torch's global generator (seed it)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        proj = self.pos_embed.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))
        nn.init.zeros_(proj.bias)
        normal = [self.adaln_single.emb, self.adaln_single.linear]
        if self.caption_projection is not None:
            normal.append(self.caption_projection)
        for part in normal:
            for module in part.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
        for block in self.transformer_blocks:
            nn.init.zeros_(block.attn2.to_out[0].weight)
            nn.init.zeros_(block.attn2.to_out[0].bias)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        *,
        encoder_attention_mask: torch.Tensor | None = None,
        added_cond_kwargs: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The prediction for ``hidden_states`` (``(batch, in_channels, height, width)`` latents, sides multiples of
        the patch size) at ``timestep`` (``(batch,)`` or a scalar, on the scheduler's scale), conditioned on
        ``encoder_hidden_states`` (``(batch, caption_tokens, text_width)``). A video latent ``(batch, in_channels,
        frames, height, width)`` is patchified per frame and every token attends to every frame's tokens (full
        spatial-temporal attention; frame positions added to the patches', see `PatchEmbed`).

        Args:
            encoder_attention_mask: ``(batch, caption_tokens)``, 1 for a caption token, 0 for padding (which must
                come after the caption's tokens); ``None``: every token counts.
            added_cond_kwargs: ``{"resolution": (batch, 2), "aspect_ratio": (batch, 1)}`` with
                ``use_additional_conditions``; ignored without.

        Returns:
            ``(batch, out_channels, height, width)`` (``(batch, out_channels, frames, height, width)`` for video).
        """
        config = self.config
        if hidden_states.dim() not in (4, 5):
            raise ValueError(
                f"hidden_states must be (batch, channels, height, width) latents or (batch, channels, frames, height, "
                f"width) video latents; got shape {tuple(hidden_states.shape)}"
            )
        batch, height, width = hidden_states.shape[0], hidden_states.shape[-2], hidden_states.shape[-1]
        frames = hidden_states.shape[2] if hidden_states.dim() == 5 else None
        patch = config.patch_size
        if height % patch or width % patch:
            raise ValueError(f"latents of {height} x {width} do not divide into {patch} x {patch} patches")
        tokens = self.pos_embed(hidden_states)
        timestep = torch.as_tensor(timestep, device=tokens.device)
        if timestep.dim() == 0:
            timestep = timestep.expand(batch)
        extra = added_cond_kwargs or {}
        modulation, embedded = self.adaln_single(
            timestep, resolution=extra.get("resolution"), aspect_ratio=extra.get("aspect_ratio"), dtype=tokens.dtype
        )
        caption = encoder_hidden_states
        if self.caption_projection is not None:
            caption = self.caption_projection(caption)
        caption_mask = caption_document_mask(encoder_attention_mask, tokens.shape[1], caption.shape[1])
        for block in self.transformer_blocks:
            tokens = block(tokens, caption, modulation, caption_mask=caption_mask)
        shift, scale = (self.scale_shift_table[None] + embedded[:, None]).chunk(2, dim=1)
        tokens = layer_norm(tokens, None, None, 1e-6) * (1 + scale) + shift
        tokens = self.proj_out(tokens)
        channels, rows, cols = config.output_channels, height // patch, width // patch
        if frames is not None:
            out = tokens.reshape(batch, frames, rows, cols, patch, patch, channels)
            return torch.einsum("nthwpqc->ncthpwq", out).reshape(batch, channels, frames, height, width)
        out = tokens.reshape(batch, rows, cols, patch, patch, channels)
        return torch.einsum("nhwpqc->nchpwq", out).reshape(batch, channels, height, width)


def caption_document_mask(mask: torch.Tensor | None, num_queries: int, num_keys: int) -> DocumentMask | None:
    """The cross-attention's `DocumentMask` for a ``(batch, caption_tokens)`` keep-mask (``None`` for none): the
    kept tokens and every query are document 0, the padding after them document 1.

    Raises:
        ValueError: a mask of another shape, or padding before a kept token (left padding).
    """
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape[1] != num_keys:
        raise ValueError(
            f"encoder_attention_mask must be (batch, caption_tokens={num_keys}) with 1 = keep, 0 = padding; got "
            f"{tuple(mask.shape)}"
        )
    padding = (mask == 0).long()
    if bool((padding[:, 1:] < padding[:, :-1]).any()):
        raise ValueError(
            "encoder_attention_mask keeps a token after padding: pad captions on the right (the tokenizer's "
            "padding_side='right'), as CLIP and T5 tokenizers do"
        )
    queries = torch.zeros(mask.shape[0], num_queries, dtype=torch.long, device=mask.device)
    return build_document_mask(padding, query_document_ids=queries, kv_offsets=0)
