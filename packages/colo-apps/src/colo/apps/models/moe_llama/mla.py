"""`MultiHeadLatentAttention`: DeepSeek-V2/V3's multi-head latent attention (MLA), architecture only.

Keys and values are compressed into one latent of ``kv_lora_rank`` per token (``kv_a_proj_with_mqa``, then
``kv_a_layernorm``) and expanded per head by ``kv_b_proj`` into a key part without position (``qk_nope_head_dim``) and
a value (``v_head_dim``); position enters through a decoupled rotary key of ``qk_rope_head_dim``, computed from the
token directly and shared by every head. Queries come from the token (``q_proj``) or through a low-rank path of their
own (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` with ``q_lora_rank``), and split likewise into a part without
position and a rotary part. Scores use the full ``qk_nope_head_dim + qk_rope_head_dim`` per head, scaled by its inverse
square root (DeepSeek-AI, "DeepSeek-V2", 2024, section 2.1). Module names and the computation are those of
transformers' ``DeepseekV3Attention``; ``rope_interleave`` (DeepSeek's layout, transformers' default) rotates
adjacent pairs of the rotary dims: they are de-interleaved here (evens, then odds) and rotated in the half-split
layout of `colo.kernels.rotary`, which computes the same numbers.

The attention itself is `colo.apps.models.llama.layers.AttentionCore` (`colo.kernels.flash_attention`), whose values
have the keys' head size and whose Triton kernel takes head sizes 16, 32, 64 and 128: queries, keys and values are
zero-padded to the smallest of those that holds both head sizes and the output is cut back (zero dims change no
score: the scale is explicit). Heads wider than 128 (DeepSeek-V3's 192) go to torch's
``scaled_dot_product_attention`` instead, which takes the two head sizes as they are (with packed documents, to
colo's torch reference with their mask).

Incremental decoding: with a static `colo.apps.models.llama.KVCache` (``KVCache.for_model``: ``num_kv_heads`` is
``num_heads``, ``head_dim`` the padded width above) the layer caches the expanded keys (after rotary) and values, not
the latent: correct, without MLA's smaller cache. A paged cache (serving) is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from colo.kernels import DocumentMask, flash_attention

from ..llama.layers import AttentionCore, RMSNorm, apply_rotary

KERNEL_HEAD_DIMS = (16, 32, 64, 128)
"""Head sizes `colo.kernels.flash_attention`'s Triton kernel takes."""


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The last dim's pairs ``(x0, x1), (x2, x3), ...`` laid out as ``(x0, x2, ..., x1, x3, ...)``."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention (see the module docstring).

    Args:
        hidden_size (int): width of the tokens.
        num_heads (int): attention heads.
        kv_lora_rank (int): width of the compressed key/value latent.
        qk_nope_head_dim (int): per-head query/key dims without position.
        qk_rope_head_dim (int): per-head rotary query/key dims (the rotary key is shared by the heads); even.
        v_head_dim (int): per-head value dims.
        q_lora_rank (int | None): width of the queries' low-rank path; ``None``: one ``q_proj``. Default: ``None``.
        rope_interleave (bool): the rotary dims are adjacent pairs (DeepSeek's layout). Default: ``True``.
        rms_norm_eps (float): eps of the latents' RMSNorms. Default: ``1e-6``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope_interleave: bool = True,
        rms_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(
                f"MultiHeadLatentAttention: qk_rope_head_dim={qk_rope_head_dim} must be even (rotary pairs)"
            )
        self.num_heads = num_heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_interleave = rope_interleave
        queries = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, queries, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=rms_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, queries, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=rms_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.core = AttentionCore(causal=True, scale=self.qk_head_dim**-0.5)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        width = max(self.qk_head_dim, v_head_dim)
        self.head_dim = next((size for size in KERNEL_HEAD_DIMS if size >= width), width)
        """Width of the keys and values attention runs on (and a KV cache holds): both head sizes, zero-padded."""
        self.num_kv_heads = num_heads
        """Key/value heads a KV cache holds: every head's expanded keys and values."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        kv_cache=None,
        document_ids: torch.Tensor | DocumentMask | None = None,
    ) -> torch.Tensor:
        """``x``: ``(batch, seq, hidden)``; ``cos``, ``sin``: rotary tables of ``qk_rope_head_dim``
        (`colo.apps.models.llama.layers.RotaryEmbedding`). Returns ``x``'s shape. ``document_ids`` as in
        `colo.apps.models.llama.layers.LlamaAttention`.

        With ``kv_cache`` (this layer's slot of a static `KVCache`), the new expanded keys and values are written to
        it and the queries attend over every cached token and the new ones (``cos`` and ``sin`` then start at the
        first new token's position).

        Raises:
            ValueError: with a paged cache (serving), which multi-head latent attention does not implement.
        """
        if getattr(kv_cache, "paged", False):
            raise ValueError(
                "MultiHeadLatentAttention: a paged KV cache (colo serve) is not implemented for multi-head latent "
                "attention; decode with the static KVCache (colo generate)"
            )
        batch, seq = x.shape[:2]
        heads, nope, rope, v_dim = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(batch, seq, heads, self.qk_head_dim).split([nope, rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, heads, nope + v_dim)
        k_nope, v = kv.split([nope, v_dim], dim=-1)
        k_rot = k_rot.reshape(batch, seq, 1, rope)
        if self.rope_interleave:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = apply_rotary(q_rot.contiguous(), k_rot.contiguous(), cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(batch, seq, heads, rope)], dim=-1)
        out = self._attend(q, k, v, document_ids, kv_cache)
        return self.o_proj(out[..., :v_dim].reshape(batch, seq, heads * v_dim))

    def _attend(self, q, k, v, document_ids, kv_cache) -> torch.Tensor:
        """Causal attention of ``(batch, seq, heads, dim)`` tensors, the values' dims first in the output (module
        docstring)."""
        wide = self.head_dim not in KERNEL_HEAD_DIMS
        if wide and document_ids is None and kv_cache is None:  # SDPA takes the two head sizes as they are
            out = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.core.scale
            )
            return out.transpose(1, 2)
        q, k, v = (nn.functional.pad(t, (0, self.head_dim - t.shape[-1])) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # every cached token's k / v and the new ones
        if wide:  # the torch reference: any head size, packed documents' mask, bottom-right causal over a cache
            return flash_attention(
                q, k, v, causal=True, scale=self.core.scale, document_ids=document_ids, backend="torch"
            )
        return self.core(q, k, v) if document_ids is None else self.core(q, k, v, document_ids=document_ids)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}"
        )
