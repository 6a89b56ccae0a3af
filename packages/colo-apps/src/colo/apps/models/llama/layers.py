"""The building blocks of the Llama decoder: RMSNorm, rotary tables, grouped-query attention, the SwiGLU MLP and
the pre-norm decoder layer. Architecture only: every op is a `colo.kernels` function (Triton on CUDA, the torch
reference elsewhere), and nothing here knows about distribution.

Activations are ``(batch, seq, ...)`` throughout; attention keeps the kernels' ``(batch, seq, heads, head_dim)``
layout, so no transposes are needed. Head counts are attributes of `LlamaAttention` (``num_heads``,
``num_kv_heads``) that a tensor-parallel plan rewrites to this rank's counts when it shards the projections.
"""

from __future__ import annotations

import torch
from torch import nn

from colo.kernels import DocumentMask, flash_attention, rms_norm, rotary, rotary_cos_sin, swiglu

from .config import LlamaConfig
from .kv_cache import LayerKVCache


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned scale (Zhang & Sennrich, 2019), on `colo.kernels.rms_norm`.

    Args:
        hidden_size (int): size of the normalized (last) dimension.
        eps (float): added to the mean square. Default: ``1e-6``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Set the scale to one (nothing on the meta device)."""
        if not self.weight.is_meta:
            nn.init.ones_(self.weight)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x``; with ``residual``, normalize ``h = x + residual`` and return ``(normalized, h)``."""
        return rms_norm(x, self.weight, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """The ``cos`` / ``sin`` tables of rotary position embeddings (Su et al., 2021), one row per position.

    The tables are non-persistent buffers (not in the state dict), computed by `reset_parameters` in fp32 and
    kept in the buffers' dtype (converting the model to bf16 rounds them, as Hugging Face rounds its tables).

    Args:
        head_dim (int): size of one attention head (even).
        max_positions (int): number of positions the tables hold.
        theta (float): the RoPE base.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Compute the tables (nothing on the meta device)."""
        if self.cos.is_meta:
            return
        cos, sin = rotary_cos_sin(self.max_positions, self.head_dim, self.theta, device=self.cos.device)
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(
        self, seq_len: int, position_ids: torch.Tensor | None = None, *, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables for a batch of ``seq_len`` tokens.

        Args:
            seq_len (int): length of the sequences.
            position_ids (torch.Tensor | None): ``(seq,)``, ``(1, seq)`` or ``(batch, seq)`` positions; ``None``:
                ``offset .. offset + seq_len - 1``. Default: ``None``.
            offset (int): position of the first token when ``position_ids`` is ``None`` (the tokens already in a
                `KVCache`). Default: ``0``.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: ``(cos, sin)``, each ``(positions, head_dim)`` (row ``s`` for token
            ``s`` of every sequence) or, for per-sequence positions, ``(batch, seq, head_dim)``.
        """
        if position_ids is None:
            if offset == 0:
                if seq_len > self.max_positions:
                    raise ValueError(
                        f"a sequence of {seq_len} tokens is longer than max_position_embeddings={self.max_positions}; "
                        "shorten the sequences or build the model with a larger max_position_embeddings"
                    )
                return self.cos, self.sin
            if offset < 0 or offset + seq_len > self.max_positions:
                raise ValueError(
                    f"positions {offset} .. {offset + seq_len - 1} fall outside max_position_embeddings="
                    f"{self.max_positions}; reset the KV cache (or slide the window) before it passes the table"
                )
            return self.cos[offset:], self.sin[offset:]  # row 0 is position `offset`; no copy
        if position_ids.shape[-1] != seq_len or position_ids.dim() not in (1, 2):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected (seq,), (1, seq) or (batch, seq) "
                f"with seq={seq_len}"
            )
        if position_ids.dim() == 2 and position_ids.shape[0] == 1:
            position_ids = position_ids[0]
        return self.cos[position_ids], self.sin[position_ids]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, theta={self.theta}"


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``(batch, seq, heads, head_dim)`` queries and keys by the tables of `RotaryEmbedding.forward`.

    Tables with one row per position of the sequence go to `colo.kernels.rotary` as they are. Per-sequence
    tables ``(batch, seq, head_dim)`` are handled by folding the batch into the sequence: the ``batch * seq``
    tokens become one sequence whose row ``t`` is token ``t``'s own position, one kernel call either way.
    """
    if cos.dim() == 2:
        return rotary(q, k, cos, sin)
    batch, seq = q.shape[:2]
    if cos.shape[:2] != (batch, seq):
        raise ValueError(f"position_ids for {tuple(cos.shape[:2])} tokens do not match a batch of {(batch, seq)}")
    q_rot, k_rot = rotary(
        q.reshape(1, batch * seq, *q.shape[2:]),
        k.reshape(1, batch * seq, *k.shape[2:]),
        cos.reshape(batch * seq, -1),
        sin.reshape(batch * seq, -1),
    )
    return q_rot.view(q.shape), k_rot.view(k.shape)


class AttentionCore(nn.Module):
    """``softmax(scale * q k^T) v`` over ``(batch, seq, heads, head_dim)`` tensors, on `colo.kernels.flash_attention`.

    Parameter-free and called as ``core(q, k, v)`` with ``causal`` and ``scale`` attributes: the attention core a
    sequence-parallel plan wraps (Ulysses) or replaces (ring attention), leaving the projections around it alone.
    With ``document_ids`` (``(batch, seq_k)``, or the `colo.kernels.DocumentMask` the model builds once per forward;
    see `colo.kernels.document_mask`) a token attends only within its own document of a packed row.

    Args:
        causal (bool): bottom-right aligned causal mask. Default: ``True``.
        scale (float | None): score scale; ``None``: ``1 / sqrt(head_dim)``. Default: ``None``.
    """

    def __init__(self, *, causal: bool = True, scale: float | None = None):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        document_ids: torch.Tensor | DocumentMask | None = None,
    ) -> torch.Tensor:
        """``q``: ``(batch, seq, heads, head_dim)``; ``k``, ``v``: ``(batch, seq, kv_heads, head_dim)``;
        ``document_ids``: ``(batch, seq_k)``, a `DocumentMask` or ``None``."""
        return flash_attention(q, k, v, causal=self.causal, scale=self.scale, document_ids=document_ids)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}"


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with RoPE and one fused q/k/v projection.

    ``qkv_proj`` has output rows ``[q heads | k heads | v heads]`` (Hugging Face's ``q_proj``, ``k_proj`` and
    ``v_proj`` stacked); query head ``h`` attends with kv head ``h // (num_heads // num_kv_heads)``. RoPE is applied
    to q and k here; the attention itself is the ``core`` submodule (`AttentionCore`).

    Args:
        config (LlamaConfig): the model's shape.

    Attributes:
        num_heads (int): query heads this module computes (this rank's count once sharded).
        num_kv_heads (int): key/value heads this module computes (likewise).
        head_dim (int): size of one head.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.core = AttentionCore(causal=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        kv_cache: LayerKVCache | None = None,
        document_ids: torch.Tensor | DocumentMask | None = None,
    ) -> torch.Tensor:
        """``x``: ``(batch, seq, hidden)``; ``cos``, ``sin``: from `RotaryEmbedding`. Returns ``x``'s shape.

        With ``kv_cache`` (this layer's slot of a `KVCache`), the new keys and values are written to the cache and
        the queries attend over every cached token and the new ones; ``cos`` and ``sin`` must then start at the
        first new token's position. A paged cache's layer (``paged = True``, `colo.apps.generation.paged_cache`)
        writes and attends itself, each row over its own tokens (``document_ids`` is then unused).
        ``document_ids`` (``(batch, keys)``, one id per key): attend only within a document
        (`colo.kernels.flash_attention`); only passed to the core when given.
        """
        head_dim = self.head_dim
        widths = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        qkv = self.qkv_proj(x)
        batch, seq = qkv.shape[:2]  # not x's: a sequence-parallel projection gathers the sequence
        q, k, v = qkv.split(widths, dim=-1)
        q = q.reshape(batch, seq, self.num_heads, head_dim)
        k = k.reshape(batch, seq, self.num_kv_heads, head_dim)
        v = v.reshape(batch, seq, self.num_kv_heads, head_dim)
        q, k = apply_rotary(q, k, cos, sin)
        if getattr(kv_cache, "paged", False):  # a paged cache (colo.apps.generation.paged_cache): own masks per row
            out = kv_cache.attend(q, k, v, scale=self.core.scale)
            return self.o_proj(out.reshape(batch, seq, self.num_heads * head_dim))
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # every cached token's k / v and the new ones: (batch, length + seq, ...)
        out = self.core(q, k, v) if document_ids is None else self.core(q, k, v, document_ids=document_ids)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * head_dim))


class LlamaMLP(nn.Module):
    """The SwiGLU feed-forward block (Shazeer, 2020): ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Args:
        config (LlamaConfig): the model's shape.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    The residual add before the second norm runs inside the RMSNorm kernel (``rms_norm(..., residual=x)``).

    Args:
        config (LlamaConfig): the model's shape.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        kv_cache: LayerKVCache | None = None,
        document_ids: torch.Tensor | DocumentMask | None = None,
    ) -> torch.Tensor:
        """``x``: ``(batch, seq, hidden)``. Returns the layer's output, shaped like ``x``.

        ``kv_cache``: this layer's slot of a `KVCache` for incremental decoding; ``document_ids``: the document
        mask (both as in `LlamaAttention`).
        """
        attention = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache=kv_cache, document_ids=document_ids)
        normed, h = self.post_attention_layernorm(attention, residual=x)
        return h + self.mlp(normed)
