"""Pretrained weights for a run (``model.init_from``): a Hugging Face Llama directory or a colo trainer checkpoint."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from colo.tensor.checkpoint import read_index

from ..models.llama import Llama, LlamaConfig, llama_config_from_hf
from .generate import RUN_KEY, load_llama


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
        run = read_index(path).metadata.get(RUN_KEY)
    except Exception as error:  # not a checkpoint at all
        raise ValueError(
            f"model.init_from={path!r} has no config.json (Hugging Face) and is not a colo checkpoint: {error}"
        ) from None
    if not isinstance(run, dict) or "llama_config" not in run:
        raise ValueError(f"model.init_from={path!r} is a checkpoint without colo trainer metadata (no model shape)")
    return LlamaConfig(**run["llama_config"])


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
