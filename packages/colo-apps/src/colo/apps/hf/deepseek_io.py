"""Writing colo's `MoELlama` with multi-head latent attention as a Hugging Face ``DeepseekV3ForCausalLM`` directory,
without importing transformers.

The experts are written one tensor per expert under DeepSeek-V3's checkpoint names
(``model.layers.N.mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``, the router as
``mlp.gate.weight`` with its ``e_score_correction_bias``); transformers stacks them into its in-memory
``gate_up_proj`` / ``down_proj`` on load. A model has that form when its attention is multi-head latent attention
(``kv_lora_rank`` set) and its routing is DeepSeek-V3's (sigmoid scores, top-k renormalized, an MoE MLP on every
layer after the first ``first_k_dense_replace``, dropless). `use_colo_deepseek_blocks` goes the other way for a
transformers model: its MoE blocks become colo's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.moe_llama import MoELlama, MoELlamaConfig, moe_llama_state_dict_to_deepseek_v3
from .llama_io import CONFIG_FILE, WEIGHTS_FILE, llama_config_to_hf


def check_deepseek_v3_form(config: MoELlamaConfig) -> None:
    """Raise a `ValueError` naming the field and the fix when ``config`` has no ``DeepseekV3ForCausalLM`` form."""
    if not config.latent_attention:
        raise ValueError(
            "kv_lora_rank=None: Hugging Face DeepseekV3 uses multi-head latent attention; set kv_lora_rank, "
            "qk_nope_head_dim, qk_rope_head_dim and v_head_dim (or export a Mixtral-shaped model as a Mixtral)"
        )
    required = {
        "score_func": (config.score_func, "sigmoid"),
        "moe_layer_interval": (config.moe_layer_interval, 1),
        "capacity_factor": (config.capacity_factor, None),
    }
    for name, (value, wanted) in required.items():
        if value != wanted:
            raise ValueError(
                f"{name}={value!r}: Hugging Face DeepseekV3 has {name}={wanted!r}; only such models export to it"
            )


def deepseek_v3_config_to_hf(config: MoELlamaConfig, *, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` dict of ``transformers.DeepseekV3ForCausalLM`` for a `MoELlamaConfig`
    (`check_deepseek_v3_form` first)."""
    check_deepseek_v3_form(config)
    hf = llama_config_to_hf(config, dtype=dtype)
    for llama_only in ("mlp_bias", "head_dim"):
        hf.pop(llama_only, None)
    hf.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        moe_intermediate_size=config.expert_intermediate_size,
        n_routed_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        n_shared_experts=config.n_shared_experts,
        n_group=config.n_group,
        topk_group=config.moe_config().groups_per_token,
        routed_scaling_factor=config.routed_scaling_factor,
        norm_topk_prob=True,
        first_k_dense_replace=config.first_k_dense_replace,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_interleave=config.rope_interleave,
    )
    return hf


def save_moe_llama_as_deepseek_v3(model: MoELlama, directory: str | os.PathLike) -> list[str]:
    """Write an unsharded `MoELlama` as a Hugging Face ``DeepseekV3ForCausalLM`` directory (``config.json`` and
    ``model.safetensors``; a tied ``lm_head.weight`` left out). Returns the files written, relative to
    ``directory``.

    Raises:
        TypeError: ``model`` is not a `MoELlama`; ValueError: it has no DeepseekV3 form (`check_deepseek_v3_form`).
    """
    if not isinstance(model, MoELlama):
        raise TypeError(f"save_moe_llama_as_deepseek_v3: model must be a colo MoELlama, not {type(model).__name__}")
    config = model.config
    check_deepseek_v3_form(config)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("save_moe_llama_as_deepseek_v3: the model is on the meta device; load its weights first")
    native = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    state = moe_llama_state_dict_to_deepseek_v3(native, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {name: tensor.contiguous().cpu() for name, tensor in state.items()}
    dtype = model.embed_tokens.weight.dtype
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(deepseek_v3_config_to_hf(config, dtype=dtype), indent=2) + "\n")
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    return [CONFIG_FILE, WEIGHTS_FILE]


@torch.no_grad()
def use_colo_deepseek_blocks(model: torch.nn.Module, **moe_overrides) -> torch.nn.Module:
    """Replace every ``DeepseekV3MoE`` of a Hugging Face DeepseekV3 model (transformers 5) by a
    `colo.tensor.moe.MoEBlock` holding the same weights (its router ``gate.weight`` and ``e_score_correction_bias`` as
    colo's ``expert_bias``; its fused ``gate_up_proj`` split into ``w1`` / ``w3``, ``down_proj`` as ``w2``; its shared
    experts), in place, so that `colo.tensor.moe.shard_experts` can split its experts over ``ep`` (the grouped
    experts and colo's dispatch then run them). The model computes what it computed (sigmoid scores, group-limited
    choice, routed scaling); the bias is then updated by colo's aux-loss-free rule wherever
    `colo.tensor.moe.update_expert_biases` runs.

    Args:
        model: a ``DeepseekV3ForCausalLM`` (or ``DeepseekV3Model``), matched by class name: transformers is not
            imported.
        **moe_overrides: other `MoEConfig` fields (``aux_loss_coef``, ``expert_bias_update_rate``, ...).

    Returns:
        ``model``.

    Raises:
        ValueError: the model has no ``DeepseekV3MoE``, or its config sets ``norm_topk_prob=False`` (colo
            renormalizes the top-k weights).
    """
    from colo.tensor.moe import MoEBlock, MoEConfig

    config = model.config
    if not getattr(config, "norm_topk_prob", True):
        raise ValueError("use_colo_deepseek_blocks: norm_topk_prob=False is not supported (colo renormalizes top-k)")
    settings = {
        "num_experts": config.n_routed_experts,
        "top_k": config.num_experts_per_tok,
        "score_func": "sigmoid",
        "expert_bias": True,
        "num_shared_experts": config.n_shared_experts,
        "num_groups": config.n_group,
        "top_k_groups": config.topk_group,
        "routed_scaling_factor": float(config.routed_scaling_factor),
        **moe_overrides,
    }
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "DeepseekV3MoE":
            continue
        gate_up, down = module.experts.gate_up_proj, module.experts.down_proj
        intermediate = down.shape[-1]
        weight = module.gate.weight
        with torch.device(weight.device):
            block = MoEBlock(weight.shape[1], intermediate, MoEConfig(**settings)).to(down.dtype)
        block.gate.weight.copy_(weight)
        block.gate.expert_bias.copy_(module.gate.e_score_correction_bias)
        block.experts.w1.copy_(gate_up[:, :intermediate])
        block.experts.w3.copy_(gate_up[:, intermediate:])
        block.experts.w2.copy_(down)
        block.shared_experts.load_state_dict(module.shared_experts.state_dict())
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, block)
        replaced += 1
    if not replaced:
        raise ValueError(
            f"use_colo_deepseek_blocks: {type(model).__name__} has no DeepseekV3MoE; pass a transformers 5 DeepseekV3"
        )
    return model
