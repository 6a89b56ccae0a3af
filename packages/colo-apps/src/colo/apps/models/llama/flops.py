"""Model FLOPs of a Llama training step, per token: the numerator of MFU (`colo.apps.mfu`)."""

from __future__ import annotations

from .config import LlamaConfig


def matmul_parameters(config: LlamaConfig) -> int:
    """The weights of every matrix multiply of one token's forward pass: the attention projections, the MLP and
    ``lm_head`` (the embedding is a lookup and the norms are elementwise, so neither is counted; a tied matrix is
    counted once, as ``lm_head``)."""
    return config.num_parameters(embeddings=False) - config.num_norm_parameters


def flops_per_token(config: LlamaConfig, seq_len: int, *, causal: bool = False) -> int:
    """Training FLOPs (forward + backward) per token of a Llama on sequences of ``seq_len`` tokens.

    ``6 * N + 12 * L * S * H * D``, as in PaLM's appendix B (Chowdhery et al., 2022) and torchtitan:

    - ``6 * N``: a matmul with ``N`` weights costs ``2 N`` FLOPs per token forward and ``4 N`` backward (the
      gradients of its input and of its weights); ``N`` is `matmul_parameters`.
    - ``12 * L * S * H * D``: per layer, the scores ``q k^T`` and the product with ``v`` cost ``2 * S * H * D``
      FLOPs each per token forward over ``S`` keys (``L`` layers, ``H`` query heads of size ``D``), times 3 for
      the backward. Grouped-query attention does not change it (every query head still scores every key). With
      query/key heads of ``Dqk`` and value heads of ``Dv`` (`LlamaConfig.attention_head_dims`; multi-head latent
      attention) the term is ``6 * L * S * H * (Dqk + Dv)``.

    Model FLOPs, not hardware FLOPs: recomputation (activation checkpointing) is not counted, and with
    ``causal=False`` neither is the causal mask: the full ``S x S`` scores are counted, the convention MFU figures
    are usually reported in. ``causal=True`` counts only the visible half (``S / 2`` keys on average).

    Args:
        config (LlamaConfig): the model's shape.
        seq_len (int): tokens per sequence.
        causal (bool): count only the unmasked half of the attention scores. Default: ``False``.

    Returns:
        int: FLOPs per token.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len={seq_len!r} must be a positive integer")
    qk_dim, v_dim = config.attention_head_dims  # (D, D) for Llama; multi-head latent attention's differ
    attention = 6 * config.num_hidden_layers * seq_len * config.num_attention_heads * (qk_dim + v_dim)
    return 6 * matmul_parameters(config) + (attention // 2 if causal else attention)
