"""Exporting a trainer checkpoint as a Hugging Face ``LlamaForCausalLM`` directory (``colo convert --to hf``)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from colo.tensor.checkpoint import export_hf, read_index

from .generate import RUN_KEY

_INDEX = "model.safetensors.index.json"


def hf_name(name: str) -> str:
    """The Hugging Face name of a checkpoint tensor: ``model.`` prefixed, except ``lm_head``."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def hf_config(llama_config: dict, *, dtype: str) -> dict:
    """The ``config.json`` of ``transformers.LlamaForCausalLM`` for a colo `LlamaConfig` (as a dict)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        **{
            key: llama_config[key]
            for key in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "rms_norm_eps",
                "rope_theta",
                "tie_word_embeddings",
                "initializer_range",
            )
        },
    }


def export_llama_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Write ``out_dir`` as a Hugging Face Llama: ``config.json`` and safetensors with Hugging Face names.

    Uses `colo.tensor.checkpoint.export_hf` (streamed, CRC-checked, any saved layout; q, k and v are already
    stored apart), then renames the tensors with the ``model.`` prefix, one file at a time.

    Args:
        checkpoint: a checkpoint written by the trainer.
        out_dir: the output directory.
        dtype: convert floating-point tensors (e.g. ``torch.bfloat16``); ``None`` keeps fp32.
        overwrite: replace an earlier export in ``out_dir``.

    Returns:
        The files written.
    """
    checkpoint, out_dir = os.fspath(checkpoint), os.fspath(out_dir)
    run = read_index(checkpoint).metadata.get(RUN_KEY)
    if not isinstance(run, dict) or "llama_config" not in run:
        raise ValueError(f"{checkpoint} has no '{RUN_KEY}' metadata: only checkpoints of colo's trainer convert")
    report = export_hf(checkpoint, out_dir, dtype=dtype, overwrite=overwrite)
    files = sorted({os.path.basename(path) for path in report.files if path.endswith(".safetensors")})
    for file in files:
        path = os.path.join(out_dir, file)
        tensors = {hf_name(name): tensor for name, tensor in load_file(path).items()}
        save_file(tensors, path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
    index_path = os.path.join(out_dir, _INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as file:
            index = json.load(file)
        index["weight_map"] = {hf_name(name): shard for name, shard in index["weight_map"].items()}
        with open(index_path, "w", encoding="utf-8") as file:
            json.dump(index, file, indent=2)
    dtype_name = str(dtype or torch.float32).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as file:
        json.dump(hf_config(run["llama_config"], dtype=dtype_name), file, indent=2)
    return [os.path.join(out_dir, name) for name in (*files, "config.json")]
