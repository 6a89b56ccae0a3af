"""Mapping between Hugging Face ``MixtralForCausalLM`` and `MoELlama`: configs and state-dict names.

Checkpoint names are those ``save_pretrained`` writes for Mixtral: ``model.layers.N.block_sparse_moe.gate.weight``
(``(E, hidden)``) and one tensor per expert, ``model.layers.N.block_sparse_moe.experts.{e}.w1.weight`` (gate,
``(intermediate, hidden)``), ``w3`` (up, same shape) and ``w2`` (down, ``(hidden, intermediate)``). `MoELlama` keeps
each as an ``(E, ...)`` tensor (``layers.N.mlp.experts.w1``); everything else maps as for Llama
(`colo.apps.models.llama.hf`). Only models whose every layer is MoE have a Mixtral equivalent.

DeepSeek-V3 (`moe_llama_state_dict_to_deepseek_v3`): ``model.layers.N.mlp.gate.weight``, the router bias as
``mlp.gate.e_score_correction_bias``, one tensor per expert as ``mlp.experts.{e}.gate_proj.weight`` (``w1``),
``up_proj`` (``w3``) and ``down_proj`` (``w2``); the shared experts, the dense layers' MLPs and the multi-head latent
attention keep their names under ``model.``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..llama.hf import llama_config_from_hf, llama_state_dict_from_hf, llama_state_dict_to_hf
from .config import MoELlamaConfig

_HF_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_HF_GATE = re.compile(r"^(?:model\.)?layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
_COLO_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w[123])$")
_COLO_GATE = re.compile(r"^layers\.(\d+)\.mlp\.gate\.weight$")


def mixtral_config_from_hf(hf_config, **overrides) -> MoELlamaConfig:
    """The `MoELlamaConfig` of a Hugging Face ``MixtralConfig`` (every layer MoE; ``overrides`` set colo-only
    fields such as ``aux_loss_type``)."""
    if getattr(hf_config, "sliding_window", None) is not None:
        raise ValueError("mixtral_config_from_hf: sliding-window attention is not implemented in colo's Llama")
    base = llama_config_from_hf(hf_config)
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    fields.update(
        num_local_experts=hf_config.num_local_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.02)),
    )
    fields.update(overrides)
    return MoELlamaConfig(**fields)


def moe_llama_state_dict_to_hf(state_dict: Mapping[str, torch.Tensor], config: MoELlamaConfig) -> dict:
    """Rename a `MoELlama` state dict (unsharded tensors) into Mixtral checkpoint names, one tensor per expert."""
    rest: dict[str, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        experts, gate = _COLO_EXPERTS.match(name), _COLO_GATE.match(name)
        if experts:
            layer, which = experts.groups()
            for e in range(tensor.shape[0]):
                result[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{which}.weight"] = tensor[e]
        elif gate:
            result[f"model.layers.{gate.group(1)}.block_sparse_moe.gate.weight"] = tensor
        elif name.endswith("expert_bias") or name.endswith("tokens_per_expert"):
            continue
        else:
            rest[name] = tensor
    result.update(llama_state_dict_to_hf(rest, config))
    return result


_DEEPSEEK_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_COLO_BIAS = re.compile(r"^layers\.(\d+)\.mlp\.gate\.expert_bias$")


def moe_llama_state_dict_to_deepseek_v3(state_dict: Mapping[str, torch.Tensor], config: MoELlamaConfig) -> dict:
    """Rename a `MoELlama` state dict (unsharded tensors, the routers' ``expert_bias`` buffers included) into
    DeepSeek-V3 checkpoint names, one tensor per expert (see the module docstring)."""
    rest: dict[str, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        experts, bias = _COLO_EXPERTS.match(name), _COLO_BIAS.match(name)
        if experts:
            layer, which = experts.groups()
            for e in range(tensor.shape[0]):
                result[f"model.layers.{layer}.mlp.experts.{e}.{_DEEPSEEK_EXPERT_NAMES[which]}.weight"] = tensor[e]
        elif bias:
            result[f"model.layers.{bias.group(1)}.mlp.gate.e_score_correction_bias"] = tensor
        elif name.endswith("tokens_per_expert"):
            continue
        else:
            rest[name] = tensor
    result.update(llama_state_dict_to_hf(rest, config))
    return result


def moe_llama_state_dict_from_hf(state_dict: Mapping[str, torch.Tensor], config: MoELlamaConfig) -> dict:
    """Rename a Mixtral checkpoint state dict into `MoELlama` names, stacking the experts into ``(E, ...)``."""
    rest: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    result: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        expert, gate = _HF_EXPERT.match(name), _HF_GATE.match(name)
        if expert:
            layer, e, which = expert.groups()
            experts.setdefault((layer, which), {})[int(e)] = tensor
        elif gate:
            result[f"layers.{gate.group(1)}.mlp.gate.weight"] = tensor
        else:
            rest[name] = tensor
    for (layer, which), pieces in experts.items():
        if sorted(pieces) != list(range(config.num_local_experts)):
            raise ValueError(
                f"moe_llama_state_dict_from_hf: layer {layer} has experts {sorted(pieces)} of {which}; "
                f"expected 0..{config.num_local_experts - 1}"
            )
        result[f"layers.{layer}.mlp.experts.{which}"] = torch.stack([pieces[e] for e in range(len(pieces))])
    result.update(llama_state_dict_from_hf(rest, config))
    return result
