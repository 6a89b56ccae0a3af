"""Hugging Face ``LlamaForCausalLM`` directories to and from colo's native `Llama`, without importing transformers.

A directory holds ``config.json`` and the weights as ``model.safetensors``, or as several safetensors files named
by ``model.safetensors.index.json`` (its ``weight_map``). Loading reads the config into a `LlamaConfig`
(`llama_config_from_hf`, which rejects what the native model does not implement) and the tensors with
``safetensors``; names map by `llama_state_dict_from_hf` (q, k and v fused into ``qkv_proj``). Saving writes the
reverse: Hugging Face names, q, k and v apart, a ``config.json`` that ``transformers.LlamaForCausalLM`` reads, and
one file or shards plus an index. Values are copied, never converted: a round trip is exact in any dtype.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..models.llama import Llama, LlamaConfig, llama_config_from_hf, llama_state_dict_from_hf, llama_state_dict_to_hf

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_hf_config(directory: str | os.PathLike) -> dict:
    """The ``config.json`` of a Hugging Face model directory, as a dict.

    Args:
        directory (str | os.PathLike): the model directory.

    Returns:
        dict: the parsed config.

    Raises:
        FileNotFoundError: the directory has no ``config.json``.
    """
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}; is this a Hugging Face model directory?")
    return json.loads(path.read_text())


def read_hf_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory (one ``model.safetensors`` or the sharded index's files).

    Args:
        directory (str | os.PathLike): the model directory.

    Returns:
        dict[str, torch.Tensor]: Hugging Face names -> CPU tensors, in their stored dtypes.

    Raises:
        FileNotFoundError: neither ``model.safetensors`` nor ``model.safetensors.index.json`` is there, or the
            index names a missing file.
        ValueError: a file of the index lacks a tensor the index assigns to it.
    """
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():
        weight_map: dict[str, str] = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
    elif (directory / WEIGHTS_FILE).is_file():
        files = {WEIGHTS_FILE: None}
    else:
        raise FileNotFoundError(
            f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE}; only safetensors weights are read (convert "
            "pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        path = directory / file
        if not path.is_file():
            raise FileNotFoundError(f"{directory / INDEX_FILE} names {file}, which is missing")
        with safe_open(path, framework="pt") as handle:
            keys = set(handle.keys())
            for name in keys if names is None else names:
                if name not in keys:
                    raise ValueError(f"{directory / INDEX_FILE} puts {name!r} in {file}, which does not hold it")
                tensors[name] = handle.get_tensor(name)
    return tensors


def load_llama_from_hf(directory: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Llama:
    """Build colo's native `Llama` from a Hugging Face ``LlamaForCausalLM`` directory.

    The model is built on the meta device and takes the stored tensors as its parameters (no random
    initialization); the rotary tables are computed, in the parameters' dtype when that is not fp32.

    Args:
        directory (str | os.PathLike): holds ``config.json`` and ``model.safetensors`` (or the sharded index).
        dtype (torch.dtype | None): convert the parameters to this dtype; ``None`` keeps the stored dtype.
            Default: ``None``.

    Returns:
        Llama: the model, on the CPU, in training mode.

    Raises:
        ValueError: the config uses a feature the native Llama lacks (named in the message), or tensors are
            missing or unexpected (named).
    """
    config = llama_config_from_hf(SimpleNamespace(**read_hf_config(directory)))
    state = llama_state_dict_from_hf(read_hf_state_dict(directory), config)
    with torch.device("meta"):
        model = Llama(config)
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"load_llama_from_hf({str(directory)!r}): the weights do not fit a Llama of this config: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    if dtype is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.rotary_emb.to_empty(device="cpu")
    model.rotary_emb.reset_parameters()
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) == 1 and (param_dtype := dtypes.pop()) != torch.float32:
        model.rotary_emb.to(param_dtype)  # as model.to(dtype) would round the tables
    return model


def llama_config_to_hf(config: LlamaConfig, *, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` dict of ``transformers.LlamaForCausalLM`` for a `LlamaConfig`.

    Args:
        config (LlamaConfig): the native config.
        dtype (torch.dtype): the weights' dtype, recorded as ``torch_dtype``. Default: ``torch.float32``.

    Returns:
        dict: JSON-able; RoPE is written both as ``rope_theta`` and as transformers 5's ``rope_parameters``.
    """
    fields = (
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
        "head_dim",
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        **{field: getattr(config, field) for field in fields},
    }


def save_llama_as_hf(model: Llama, directory: str | os.PathLike, *, max_shard_bytes: int | None = None) -> list[str]:
    """Write an unsharded native `Llama` as a Hugging Face ``LlamaForCausalLM`` directory.

    Tensors keep their dtype and values; a tied ``lm_head.weight`` is left out (transformers ties it again).
    With ``max_shard_bytes`` the tensors go to ``model-0000i-of-0000n.safetensors`` files of at most that size
    (a tensor larger than it gets a file of its own) and ``model.safetensors.index.json`` maps names to files.

    Args:
        model (Llama): a whole, unsharded model (gather a parallel one first, or use ``colo convert --to hf`` on a
            checkpoint).
        directory (str | os.PathLike): created if missing; existing files of the same names are replaced.
        max_shard_bytes (int | None): the largest file; ``None`` writes one ``model.safetensors``. Default:
            ``None``.

    Returns:
        list[str]: the files written, relative to ``directory``.

    Raises:
        TypeError: ``model`` is not a `Llama`.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"save_llama_as_hf: model must be a colo Llama, not {type(model).__name__}")
    config = model.config
    native = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    state = llama_state_dict_to_hf(native, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {name: tensor.contiguous().cpu() for name, tensor in state.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state.values())).dtype
    (directory / CONFIG_FILE).write_text(json.dumps(llama_config_to_hf(config, dtype=dtype), indent=2) + "\n")
    written = [CONFIG_FILE]
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(state, directory / WEIGHTS_FILE, metadata=metadata)
        return [*written, WEIGHTS_FILE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
        written.append(file)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*written, INDEX_FILE]
