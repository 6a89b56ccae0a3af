"""A committed trainer checkpoint as a model in one process, whatever layout saved it: the language model
(`load_llama`: LoRA adapters merged, every expert of a mixture-of-experts run) and a reward model
(`load_reward_model`: the Llama with its scalar head)."""

from __future__ import annotations

import os

import torch
from torch import nn

from colo.tensor.checkpoint import load_checkpoint, read_index

from ..lora import has_lora_tensors, merge_lora_tensors
from ..models.llama import Llama, LlamaConfig, llama_state_dict_from_hf
from .metadata import lora_scaling_of, model_config_of, run_of


def read_model_tensors(path: str, index) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint (optimizer states left out), read whole from any saved layout."""
    targets = {
        name: torch.empty(entry.shape, dtype=entry.dtype)
        for name, entry in index.tensors.items()
        if not name.startswith("optim/")
    }
    load_checkpoint(path, targets, strict=False)
    return targets


def load_llama(checkpoint: str | os.PathLike, *, device: str | torch.device = "cpu") -> tuple[Llama, dict]:
    """A single-process `Llama` holding a trainer checkpoint's weights, whatever layout saved it (the adapters of a
    LoRA run merged into the weights; a `MoELlama` with every expert for a mixture-of-experts run, any ``ep``).

    Args:
        checkpoint: a committed checkpoint directory written by the trainer (`colo.apps.train.Trainer`).
        device: where to build the model.

    Returns:
        ``(model, run)``: the model in eval mode, and the run metadata (``run["config"]`` is the `RunConfig` as a
        dict, ``run["llama_config"]`` the model's shape).

    Raises:
        ValueError: the checkpoint was not written by the trainer (no run metadata).
    """
    path = os.fspath(checkpoint)
    index = read_index(path)
    run = run_of(index, source=path)
    config = model_config_of(run)
    if type(config) is not LlamaConfig:  # MoE: the experts' names and layouts are colo.apps.hf.mixtral_io's
        from ..hf.mixtral_io import load_moe_llama_checkpoint

        return load_moe_llama_checkpoint(path, config, device=device), run
    targets = read_model_tensors(path, index)
    if has_lora_tensors(targets):  # a LoRA run: base weights and adapters, merged into plain weights
        targets = merge_lora_tensors(targets, scaling=lora_scaling_of(run))
    state = llama_state_dict_from_hf(targets, config)
    with torch.device(device):
        model = Llama(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"{path} lacks {missing[:3]} ({len(missing)} parameters of the Llama); is it a Llama run?")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name].to(param.dtype))
    model.eval()
    return model, run


def load_reward_model(checkpoint: str | os.PathLike, *, device: str | torch.device = "cpu") -> Llama:
    """The reward model of a ``data.task: rm`` checkpoint as colo's `Llama` whose ``lm_head`` is the scalar head
    (``hidden -> 1``, no bias; its "logits" are ``(rows, seq, 1)`` rewards), frozen, in eval mode (any layout saved
    it).

    Args:
        checkpoint: a committed checkpoint of a reward-model run, saved after its SFT warm-up.
        device: where to build the model.

    Raises:
        ValueError: the checkpoint was not written by the trainer, or its ``lm_head`` is not a scalar head.
    """
    path = os.fspath(checkpoint)
    index = read_index(path)
    config = model_config_of(run_of(index, source=path))
    head = index.tensors.get("lm_head.weight")
    if config.tie_word_embeddings or head is None or tuple(head.shape) != (1, config.hidden_size):
        raise ValueError(
            f"{path} holds no reward head (an untied lm_head of shape (1, {config.hidden_size})): give a checkpoint "
            "of a data.task='rm' run saved after its SFT warm-up"
        )
    state = llama_state_dict_from_hf(read_model_tensors(path, index), config)
    with torch.device(device), torch.random.fork_rng(devices=[]):  # the weights are read: draw nothing globally
        model = Llama(config)
        model.lm_head = nn.Linear(config.hidden_size, 1, bias=False, dtype=model.embed_tokens.weight.dtype)
    model.load_state_dict({name: state[name] for name in model.state_dict()})
    model.requires_grad_(False)
    return model.eval()
