"""Pretrained weights for a run (``model.init_from``): a Hugging Face Llama directory or a colo trainer checkpoint,
loaded whole (`load_pretrained_llama`) or module by module into a model the plugin materializes shard by shard
(`PretrainedLlamaWeights`)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from safetensors import safe_open
from torch import nn

from colo.tensor.checkpoint import load_checkpoint, read_index

from ..lora import merge_lora_tensors
from ..models.llama import Llama, LlamaConfig, RMSNorm, RotaryEmbedding, llama_config_from_hf
from .load import load_llama
from .metadata import RUN_KEY, has_lora, lora_scaling_of, run_of


def _is_hf_directory(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def pretrained_llama_config(path: str | os.PathLike) -> LlamaConfig:
    """The `LlamaConfig` of ``model.init_from`` (read from its config, no weights loaded).

    Raises:
        ValueError: ``path`` is neither a Hugging Face Llama directory nor a checkpoint of colo's trainer.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"model.init_from={path!r} is not a directory; give a Hugging Face Llama or a colo checkpoint")
    if _is_hf_directory(path):
        from ..hf.llama_io import read_hf_config

        return llama_config_from_hf(SimpleNamespace(**read_hf_config(path)))
    try:
        index = read_index(path)
    except Exception as error:  # not a checkpoint at all
        raise ValueError(
            f"model.init_from={path!r} has no config.json (Hugging Face) and is not a colo checkpoint: {error}"
        ) from None
    return LlamaConfig(**run_of(index, source=f"model.init_from={path!r}")["llama_config"])


def load_pretrained_llama(path: str | os.PathLike, *, device: torch.device | str = "cpu") -> Llama:
    """The `Llama` of ``model.init_from`` with its weights in fp32, in training mode on ``device`` (a checkpoint's
    LoRA adapters merged)."""
    path = os.fspath(path)
    if _is_hf_directory(path):
        from ..hf.llama_io import load_llama_from_hf

        model = load_llama_from_hf(path)
    else:
        model, _ = load_llama(path)
    return model.to(device=device, dtype=torch.float32).train()  # fp32 masters: the plugins cast for compute


class PretrainedLlamaWeights:
    """``init_fn(name, module)`` that fills a materialized module of colo's `Llama` with pretrained weights.

    Given to the Booster's Llama plan (`colo.apps.booster.llama_plan.set_materialize_fn`) for a model built on the
    meta device, it lets each rank read one module's full tensors at a time (safetensors reads only the tensors
    asked for) and keep its shards, instead of every rank loading the whole model first. A fused ``qkv_proj`` is
    concatenated from q, k and v; a tied ``lm_head`` reads the embedding; a checkpoint's LoRA adapters are merged;
    rotary tables are computed.

    Args:
        path: a Hugging Face Llama directory or a colo trainer checkpoint (``model.init_from``).
        config: the model's `LlamaConfig` (`pretrained_llama_config`).
    """

    def __init__(self, path: str | os.PathLike, config: LlamaConfig) -> None:
        self.path, self.config = os.fspath(path), config
        self.hf = _is_hf_directory(self.path)
        if self.hf:
            from ..hf.llama_io import INDEX_FILE, WEIGHTS_FILE

            index = os.path.join(self.path, INDEX_FILE)
            if os.path.isfile(index):
                with open(index, encoding="utf-8") as file:
                    self.files = json.load(file)["weight_map"]
            else:
                with safe_open(os.path.join(self.path, WEIGHTS_FILE), framework="pt") as handle:
                    self.files = dict.fromkeys(handle.keys(), WEIGHTS_FILE)
        else:
            checkpoint = read_index(self.path)
            self.entries = checkpoint.tensors
            run = checkpoint.metadata.get(RUN_KEY) or {}
            self.scaling = lora_scaling_of(run) if has_lora(run) else None

    def _stored(self, name: str) -> torch.Tensor:
        """One tensor by its stored name (Hugging Face's without the ``model.`` prefix)."""
        if self.hf:
            key = name if name.startswith("lm_head.") else f"model.{name}"
            if key not in self.files:
                raise ValueError(f"model.init_from={self.path!r} has no tensor {key!r}")
            with safe_open(os.path.join(self.path, self.files[key]), framework="pt") as handle:
                return handle.get_tensor(key)
        module, _, leaf = name.rpartition(".")
        base = f"{module}.base_layer.{leaf}"
        if base in self.entries:  # a LoRA run's checkpoint: merge this module's adapters
            names = [base] + [n for n in self.entries if n.startswith(f"{module}.lora_")]
            tensors = self._read(names)
            return merge_lora_tensors(tensors, scaling=self.scaling)[name]
        if name not in self.entries:
            raise ValueError(f"model.init_from={self.path!r} has no tensor {name!r}")
        return self._read([name])[name]

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        tensors = {n: torch.empty(self.entries[n].shape, dtype=self.entries[n].dtype) for n in names}
        load_checkpoint(self.path, tensors, strict=False)
        return tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The pretrained value of the native parameter ``name`` (``layers.0.self_attn.qkv_proj.weight``, ...)."""
        prefix, _, leaf = name.rpartition(".qkv_proj.")
        if prefix:
            return torch.cat([self._stored(f"{prefix}.{part}_proj.{leaf}") for part in "qkv"])
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return self._stored("embed_tokens.weight")
        return self._stored(name)

    @torch.no_grad()
    def __call__(self, name: str, module: nn.Module) -> None:
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
            return
        own = list(module.named_parameters(recurse=False))
        if not own:
            return
        if not isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
            raise TypeError(f"PretrainedLlamaWeights: no rule for {name!r} ({type(module).__name__})")
        for param_name, param in own:
            full = f"{name}.{param_name}" if name else param_name
            value = self.tensor(full)
            if value.shape != param.shape:
                raise ValueError(
                    f"model.init_from={self.path!r}: {full} has shape {tuple(value.shape)}, the model expects "
                    f"{tuple(param.shape)}"
                )
            param.copy_(value.to(param.dtype))
