"""Writing colo's `MoELlama` as a Hugging Face ``MixtralForCausalLM`` directory, without importing transformers.

The experts are written one tensor per expert under the names ``save_pretrained`` gives Mixtral
(``model.layers.N.block_sparse_moe.experts.{e}.w1.weight`` / ``w2`` / ``w3``, the router as
``block_sparse_moe.gate.weight``); transformers fuses them into its in-memory ``gate_up_proj`` / ``down_proj`` on
load. Only models whose every layer is MoE (``moe_layer_interval=1``) are Mixtrals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.moe_llama import MoELlama, MoELlamaConfig, moe_llama_state_dict_to_hf
from .llama_io import CONFIG_FILE, WEIGHTS_FILE, llama_config_to_hf


def mixtral_config_to_hf(config: MoELlamaConfig, *, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` dict of ``transformers.MixtralForCausalLM`` for a `MoELlamaConfig`.

    Raises:
        ValueError: not every layer is MoE, or the routing is not Mixtral's (softmax, top-k renormalized).
    """
    if config.moe_layer_interval != 1:
        raise ValueError(
            f"moe_layer_interval={config.moe_layer_interval}: Mixtral has an MoE MLP on every layer; only models with "
            "moe_layer_interval=1 export to Hugging Face Mixtral"
        )
    if config.score_func != "softmax" or config.expert_bias:
        raise ValueError(
            f"score_func={config.score_func!r}, expert_bias={config.expert_bias}: Mixtral routes by softmax without an "
            "expert bias; only such models export to Hugging Face Mixtral"
        )
    deepseek = {
        "first_k_dense_replace": (config.first_k_dense_replace, 0),
        "n_shared_experts": (config.n_shared_experts, 0),
        "n_group": (config.moe_config().groups_per_token < config.n_group, False),
        "routed_scaling_factor": (config.routed_scaling_factor, 1.0),
        "moe_intermediate_size": (config.expert_intermediate_size, config.intermediate_size),
    }
    for name, (value, mixtral) in deepseek.items():
        if value != mixtral:
            shown = (
                f"n_group={config.n_group}, topk_group={config.topk_group}" if name == "n_group" else f"{name}={value}"
            )
            raise ValueError(
                f"{shown}: a DeepSeek-style setting Mixtral does not have; Hugging Face DeepseekV3 export needs "
                "multi-head latent attention, which colo's MoE Llama does not implement, so such a model has no "
                "Hugging Face export yet (leave the setting at its default for a Mixtral)"
            )
    hf = llama_config_to_hf(config, dtype=dtype)
    hf.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=False,
        sliding_window=None,
    )
    for llama_only in ("mlp_bias", "attention_bias"):
        hf.pop(llama_only, None)
    return hf


def save_moe_llama_as_hf(model: MoELlama, directory: str | os.PathLike) -> list[str]:
    """Write an unsharded `MoELlama` as a Hugging Face ``MixtralForCausalLM`` directory (``config.json`` and
    ``model.safetensors``; a tied ``lm_head.weight`` left out). Returns the files written, relative to
    ``directory``.

    Raises:
        TypeError: ``model`` is not a `MoELlama`; ValueError: it has no Mixtral equivalent (`mixtral_config_to_hf`).
    """
    if not isinstance(model, MoELlama):
        raise TypeError(f"save_moe_llama_as_hf: model must be a colo MoELlama, not {type(model).__name__}")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("save_moe_llama_as_hf: the model is on the meta device; load its weights first")
    config = model.config
    native = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    state = moe_llama_state_dict_to_hf(native, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {name: tensor.contiguous().cpu() for name, tensor in state.items()}
    dtype = next(iter(state.values())).dtype
    hf_config = mixtral_config_to_hf(config, dtype=dtype)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    return [CONFIG_FILE, WEIGHTS_FILE]


@torch.no_grad()
def use_colo_moe_blocks(model: torch.nn.Module, **moe_overrides) -> torch.nn.Module:
    """Replace every ``MixtralSparseMoeBlock`` of a Hugging Face Mixtral model (transformers 5) by a
    `colo.tensor.moe.MoEBlock` holding the same weights (its ``gate.weight``; its fused ``gate_up_proj`` split into
    ``w1`` / ``w3``, ``down_proj`` as ``w2``), in place, so that `colo.tensor.moe.shard_experts` and the
    `ExpertParallel` plugin can split its experts over ``ep``. The model computes what it computed.

    The router's auxiliary losses are then colo's (`colo.tensor.moe.moe_aux_loss`): transformers' own aux loss reads
    router logits its block no longer records, so add ``moe_aux_loss(model)`` to the loss when training with one.

    Args:
        model: a ``MixtralForCausalLM`` (or ``MixtralModel``), matched by class name: transformers is not imported.
        **moe_overrides: `MoEConfig` fields besides the experts and k (``aux_loss_coef``, ``capacity_factor``, ...).

    Returns:
        ``model``.

    Raises:
        ValueError: the model has no ``MixtralSparseMoeBlock``.
    """
    from colo.tensor.moe import MoEBlock, MoEConfig

    config = model.config
    settings = {"num_experts": config.num_local_experts, "top_k": config.num_experts_per_tok, **moe_overrides}
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "MixtralSparseMoeBlock":
            continue
        gate_up, down = module.experts.gate_up_proj, module.experts.down_proj
        intermediate = down.shape[-1]
        weight = module.gate.weight
        with torch.device(weight.device):
            block = MoEBlock(weight.shape[1], intermediate, MoEConfig(**settings)).to(weight.dtype)
        block.gate.weight.copy_(weight)
        block.experts.w1.copy_(gate_up[:, :intermediate])
        block.experts.w3.copy_(gate_up[:, intermediate:])
        block.experts.w2.copy_(down)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, block)
        replaced += 1
    if not replaced:
        raise ValueError(
            f"use_colo_moe_blocks: {type(model).__name__} has no MixtralSparseMoeBlock; pass a transformers 5 Mixtral"
        )
    return model


def load_moe_llama_checkpoint(
    checkpoint: str | os.PathLike, config: MoELlamaConfig, *, device: str | torch.device = "cpu"
) -> MoELlama:
    """A single-process `MoELlama` of ``config`` holding the weights of a colo checkpoint saved under any layout (any
    ``ep`` and data-parallel size: `colo.tensor.checkpoint` assembles the global tensors), in eval mode.

    Raises:
        ValueError: the checkpoint lacks parameters of the model (another config?).
    """
    from colo.tensor.checkpoint import read_index

    from ..models.moe_llama import moe_llama_state_dict_from_hf
    from ..runs.load import read_model_tensors

    path = os.fspath(checkpoint)
    index = read_index(path)
    targets = read_model_tensors(path, index)
    state = moe_llama_state_dict_from_hf(targets, config)
    with torch.device(device):
        model = MoELlama(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(
            f"{path} lacks {missing[:3]} ({len(missing)} parameters of the MoELlama); is it its checkpoint?"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name].to(param.dtype))
    _restore_expert_biases(model, index.metadata, path)
    return model.eval()


@torch.no_grad()
def _restore_expert_biases(model: MoELlama, metadata: dict, path: str) -> None:
    """Copy the routers' aux-loss-free expert biases the ``expert`` plugin saved in the checkpoint metadata (they
    steer which experts a token goes to, so a model loaded without them routes otherwise)."""
    from colo.tensor.moe import moe_blocks

    from ..booster.plugins.expert import EXPERT_BIAS_KEY

    saved = metadata.get(EXPERT_BIAS_KEY)
    if not model.config.expert_bias or saved is None:
        return
    for name, block in moe_blocks(model):
        found = [values for key, values in saved.items() if key == name or key.endswith("." + name)]
        if len(found) != 1:
            raise ValueError(f"{path}: the checkpoint's metadata has no single expert bias for the MoE block {name!r}")
        block.gate.expert_bias.copy_(torch.tensor(found[0], dtype=torch.float32))


def export_moe_llama_checkpoint_as_hf(
    checkpoint: str | os.PathLike, out_dir: str | os.PathLike, config: MoELlamaConfig
) -> list[str]:
    """Write a colo checkpoint of a `MoELlama` (any layout) as a Hugging Face ``MixtralForCausalLM`` directory: the
    MoE half of ``colo convert --to hf`` (`load_moe_llama_checkpoint`, then `save_moe_llama_as_hf`)."""
    mixtral_config_to_hf(config)  # refuse a model with no Mixtral equivalent before reading anything
    return save_moe_llama_as_hf(load_moe_llama_checkpoint(checkpoint, config), out_dir)
