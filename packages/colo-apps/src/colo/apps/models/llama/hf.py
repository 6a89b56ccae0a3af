"""Mapping between Hugging Face ``LlamaForCausalLM`` and `Llama`: configs and state-dict names.

The names agree up to two differences: Hugging Face prefixes every tensor of the decoder with ``model.``, and
keeps q, k and v as three projections where `Llama` has one fused ``qkv_proj`` whose rows are q, then k, then v.
Both use the "rotate half" RoPE convention, so no weight is permuted. transformers is not imported here: these
functions read attributes and tensors only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .config import LlamaConfig

_QKV = re.compile(r"^(layers\.\d+\.self_attn)\.(q|k|v)_proj\.weight$")
_FUSED = re.compile(r"^(layers\.\d+\.self_attn)\.qkv_proj\.weight$")
_HF_DECODER_PREFIX = "model."


def llama_config_from_hf(hf_config) -> LlamaConfig:
    """The `LlamaConfig` of a Hugging Face ``LlamaConfig`` (transformers 4.45+ or 5).

    Args:
        hf_config: a ``transformers.LlamaConfig`` (or any object with its attributes).

    Returns:
        LlamaConfig: the same architecture.

    Raises:
        ValueError: for features `Llama` does not implement (biases, an activation other than SiLU, RoPE scaling,
            a head_dim other than ``hidden_size / num_attention_heads``).
    """
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "attention_bias": getattr(hf_config, "attention_bias", False),
        "mlp_bias": getattr(hf_config, "mlp_bias", False),
        "hidden_act != 'silu'": getattr(hf_config, "hidden_act", "silu") != "silu",
        f"rope_type={rope_type!r} (RoPE scaling)": rope_type != "default",
    }
    head_dim = getattr(hf_config, "head_dim", None)
    unsupported[f"head_dim={head_dim}"] = head_dim not in (None, hf_config.hidden_size // hf_config.num_attention_heads)
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise ValueError(f"llama_config_from_hf: colo's Llama does not implement {', '.join(found)}")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return LlamaConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(theta),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=float(getattr(hf_config, "initializer_range", 0.02)),
    )


def llama_state_dict_from_hf(state_dict: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Rename (and fuse) a Hugging Face ``LlamaForCausalLM`` state dict into `Llama`'s names.

    Works on anything keyed by parameter name: weights, gradients, optimizer states.

    Args:
        state_dict (Mapping[str, torch.Tensor]): Hugging Face names -> tensors.
        config (LlamaConfig): the model's config (a tied model may lack ``lm_head.weight``).

    Returns:
        dict[str, torch.Tensor]: `Llama` names -> tensors (``qkv_proj`` concatenated, others as given).

    Raises:
        ValueError: if a layer has some but not all of q, k and v.
    """
    result: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        name = name.removeprefix(_HF_DECODER_PREFIX)
        match = _QKV.match(name)
        if match:
            qkv.setdefault(match.group(1), {})[match.group(2)] = tensor
        else:
            result[name] = tensor
    for attention, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(
                f"llama_state_dict_from_hf: {attention} has {sorted(parts)} projections; q, k and v are needed"
            )
        result[f"{attention}.qkv_proj.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    if config.tie_word_embeddings and "lm_head.weight" not in result and "embed_tokens.weight" in result:
        result["lm_head.weight"] = result["embed_tokens.weight"]
    return result


def llama_state_dict_to_hf(state_dict: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Rename (and split) a `Llama` state dict into Hugging Face ``LlamaForCausalLM`` names.

    Args:
        state_dict (Mapping[str, torch.Tensor]): `Llama` names -> unsharded tensors.
        config (LlamaConfig): the model's config (for the head counts of ``qkv_proj``).

    Returns:
        dict[str, torch.Tensor]: Hugging Face names -> tensors (q, k and v as views of the fused tensor).
    """
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    result: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = _FUSED.match(name)
        if match:
            for part, piece in zip("qkv", tensor.split([q_rows, kv_rows, kv_rows])):
                result[f"{_HF_DECODER_PREFIX}{match.group(1)}.{part}_proj.weight"] = piece
        elif name.startswith("lm_head."):
            result[name] = tensor
        else:
            result[_HF_DECODER_PREFIX + name] = tensor
    return result
