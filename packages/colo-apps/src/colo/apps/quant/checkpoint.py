"""Quantized models in colo's safetensors checkpoint format (`colo.tensor.checkpoint`; no pickle on any path).

A quantized checkpoint is an ordinary colo checkpoint directory: the quantized layers as their stored tensors
(``<layer>.qweight``, ``<layer>.scale``, ``<layer>.zero`` for int4, ``<layer>.bias`` if any), every other
parameter in the model's float dtype, and the index metadata ``"quantization"``: ``{"format": 1, "mode",
"group_size", "skip", "model": "colo-llama" | "hf-llama", "dtype", "layers"}``, plus what rebuilds the model
(`colo.apps.runs.RUN_KEY` for the native Llama, as the trainer writes it; ``"hf_config"`` for Hugging Face's).

Names are those of the model's trainer checkpoints: for the native Llama the fused ``qkv_proj`` is saved as
``q_proj``, ``k_proj`` and ``v_proj`` (its rows split, which is exact: see `colo.apps.quant.model`), and loading
concatenates them back. ``colo convert CKPT OUT --quantize int8|int4 [--group-size N]`` is `quantize_checkpoint`.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
from torch import nn

from colo.tensor.checkpoint import INDEX_FILE, CheckpointError, load_checkpoint, read_index, save_checkpoint

from ..runs import RUN_KEY, load_llama
from .formats import QuantConfig
from .linear import QuantizedLinear
from .model import DEFAULT_SKIP, quantize_model, quantize_structure

QUANT_KEY = "quantization"
"""The checkpoint-metadata key of a quantized checkpoint."""

FORMAT_VERSION = 1
_FUSED_QKV = re.compile(r"^(layers\.\d+\.self_attn)\.qkv_proj$")


def is_quantized_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at ``path`` was written by `save_quantized`."""
    return isinstance(read_index(os.fspath(path)).metadata.get(QUANT_KEY), dict)


def save_quantized(
    model: nn.Module, path: str | os.PathLike, *, run: dict | None = None, overwrite: bool = False
) -> list[str]:
    """Write a model quantized by `quantize_model` as a colo checkpoint at ``path``.

    Args:
        model (nn.Module): a quantized native `Llama` (``run`` needed) or Hugging Face ``LlamaForCausalLM``.
        path (str | os.PathLike): the checkpoint directory to create.
        run (dict | None): the trainer's run metadata of a native Llama (``run["llama_config"]`` rebuilds it).
        overwrite (bool): replace an existing checkpoint at ``path``. Default: ``False``.

    Returns:
        list[str]: the files written.
    """
    path = os.fspath(path)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not layers:
        raise ValueError("save_quantized: the model has no QuantizedLinear layer; quantize it with quantize_model")
    configs = {m.config for m in layers.values()}
    if len(configs) != 1:
        raise ValueError(f"save_quantized: the model mixes quantization configs {sorted(map(str, configs))}")
    config = configs.pop()
    native = _is_native_llama(model)
    if native and not (isinstance(run, dict) and "llama_config" in run):
        raise ValueError("save_quantized: a native Llama needs run= with 'llama_config' (the trainer's run metadata)")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():  # tied weights once (named_parameters removes duplicates)
        seen.add(id(param))
        tensors[name] = param.detach()
    for name, layer in layers.items():
        for part_name, rows in _parts(model, name, native):
            for field in ("qweight", "scale", "zero", "bias"):
                tensor = getattr(layer, field)
                if tensor is not None:
                    tensors[f"{part_name}.{field}"] = tensor[rows]
    if not native:  # Hugging Face: persistent buffers outside the quantized layers
        state = model.state_dict()
        for name, buffer in model.named_buffers():
            owner = name.rpartition(".")[0]
            if owner not in layers and id(buffer) not in seen and name in state:
                tensors[name] = buffer.detach()
    dtype = next(iter(layers.values())).dtype
    metadata = {
        QUANT_KEY: {
            "format": FORMAT_VERSION,
            **config.to_dict(),
            "model": "colo-llama" if native else "hf-llama",
            "dtype": str(dtype).removeprefix("torch."),
            "layers": sorted(part for name in layers for part, _ in _parts(model, name, native)),
        }
    }
    if native:
        metadata[RUN_KEY] = run
    else:
        metadata["hf_config"] = model.config.to_dict()
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
        if not os.path.isfile(os.path.join(path, INDEX_FILE)):
            raise FileExistsError(f"{path} exists and is not a colo checkpoint; not replacing it")
        shutil.rmtree(path)
    save_checkpoint(path, {name: t.contiguous() for name, t in tensors.items()}, metadata=_jsonable(metadata))
    return sorted(os.path.join(path, f) for f in os.listdir(path))


def load_quantized(
    path: str | os.PathLike, *, backend: str = "reference", device: str | torch.device = "cpu"
) -> tuple[nn.Module, dict]:
    """Rebuild the quantized model a `save_quantized` checkpoint holds, its stored tensors exactly as saved.

    Args:
        path (str | os.PathLike): the checkpoint directory.
        backend (str): the `QuantizedLinear` backend. Default: ``"reference"``.
        device (str | torch.device): where to build the model. Default: ``"cpu"``.

    Returns:
        tuple[nn.Module, dict]: the model in eval mode (a `Llama` or a ``LlamaForCausalLM``) and the checkpoint
        metadata.

    Raises:
        CheckpointError: not a quantized checkpoint, or a tensor missing or mismatched.
    """
    path = os.fspath(path)
    metadata = read_index(path).metadata
    info = metadata.get(QUANT_KEY)
    if not isinstance(info, dict) or info.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} is not a quantized colo checkpoint (no '{QUANT_KEY}' metadata of format {FORMAT_VERSION}); "
            "write one with `colo convert CKPT OUT --quantize int8|int4`"
        )
    config = QuantConfig(mode=info["mode"], group_size=info["group_size"])
    dtype = getattr(torch, info["dtype"])
    native = info["model"] == "colo-llama"
    with torch.device("meta"):
        model = _build_native(metadata) if native else _build_hf(metadata)
    model.to(dtype)
    quantize_structure(model, config, _module_names(info["layers"], native), backend=backend)
    model.to_empty(device=device)
    _reset_non_persistent(model, device)
    if hasattr(model, "tie_weights"):  # to_empty unties a tied lm_head; the checkpoint holds the weight once
        model.tie_weights()
    targets: dict[str, torch.Tensor] = {}
    fused: list[tuple[QuantizedLinear, str, list[str]]] = []
    for name, param in model.named_parameters():
        targets[name] = param.data
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)):
        parts = _parts(model, name, native)
        for field in ("qweight", "scale", "zero", "bias"):
            tensor = getattr(layer, field)
            if tensor is None:
                continue
            if len(parts) == 1:
                targets[f"{name}.{field}"] = tensor
            else:
                for part_name, rows in parts:
                    targets[f"{part_name}.{field}"] = torch.empty_like(tensor[rows])
                fused.append((layer, field, [part for part, _ in parts]))
    if not native:
        state = model.state_dict()
        for name, buffer in model.named_buffers():
            owner = name.rpartition(".")[0]
            if name in state and name not in targets and not isinstance(model.get_submodule(owner), QuantizedLinear):
                targets[name] = buffer
    load_checkpoint(path, targets, strict=True)
    with torch.no_grad():
        for layer, field, part_names in fused:
            getattr(layer, field).copy_(torch.cat([targets[f"{part}.{field}"] for part in part_names]))
    return model.eval(), metadata


def quantize_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    mode: str,
    group_size: int | None = None,
    dtype: torch.dtype | None = None,
    keep_float: tuple[str, ...] = (),
    overwrite: bool = False,
) -> list[str]:
    """``colo convert CKPT OUT --quantize MODE``: load a trainer checkpoint (any layout; LoRA adapters merged),
    quantize its Llama's linear layers, and write the quantized checkpoint.

    Args:
        checkpoint: a checkpoint written by the trainer.
        out: the output directory.
        mode: ``"int8"`` or ``"int4"``.
        group_size: the int4 group size (32, 64 or 128; ``None``: 32).
        dtype: the float dtype of the unquantized tensors and the compute dtype; ``None``: the checkpoint's (fp32).
        keep_float: last name components of further linear layers to keep in float (``"down_proj"``), besides
            ``lm_head``.
        overwrite: replace an earlier quantized checkpoint at ``out``.

    Returns:
        The files written.
    """
    from ..models.llama import Llama

    config = QuantConfig(mode=mode, group_size=group_size)  # a bad mode or group size fails before any read
    model, run = load_llama(checkpoint)
    if type(model) is not Llama:
        raise ValueError(
            f"{checkpoint} holds a {type(model).__name__}; weight-only quantization supports the dense Llama only"
        )
    if dtype is not None:
        model = model.to(dtype)
    quantize_model(model, config, skip=(*DEFAULT_SKIP, *keep_float))
    return save_quantized(model, out, run=run, overwrite=overwrite)


def _is_native_llama(model: nn.Module) -> bool:
    from ..models.llama import Llama

    return isinstance(model, Llama)


def _parts(model: nn.Module, name: str, native: bool) -> list[tuple[str, slice]]:
    """The checkpoint names of a quantized layer with the rows each holds: q, k and v of a native fused q/k/v."""
    match = _FUSED_QKV.match(name) if native else None
    if not match:
        return [(name, slice(None))]
    config = model.config
    rows = [n * config.head_dim for n in (config.num_attention_heads, config.num_key_value_heads)]
    bounds = [0, rows[0], rows[0] + rows[1], rows[0] + 2 * rows[1]]
    return [(f"{match.group(1)}.{part}_proj", slice(bounds[i], bounds[i + 1])) for i, part in enumerate("qkv")]


def _module_names(layers: list[str], native: bool) -> list[str]:
    """The model's module names of a checkpoint's quantized layers (q, k and v of a native Llama: its qkv_proj)."""
    if not native:
        return list(layers)
    names = [re.sub(r"\.(q|k|v)_proj$", ".qkv_proj", name) if ".self_attn." in name else name for name in layers]
    return list(dict.fromkeys(names))


def _build_native(metadata: dict) -> nn.Module:
    from ..models.llama import Llama, LlamaConfig

    run = metadata.get(RUN_KEY) or {}
    fields = run.get("llama_config")
    if not isinstance(fields, dict) or "num_local_experts" in fields:
        raise CheckpointError("the quantized checkpoint's run metadata has no dense 'llama_config'")
    return Llama(LlamaConfig(**fields))


def _build_hf(metadata: dict) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig.from_dict(metadata["hf_config"]))


def _reset_non_persistent(model: nn.Module, device) -> None:
    """Recompute the buffers a checkpoint does not hold (rotary tables) after ``to_empty``."""
    from ..models.llama import Llama

    if isinstance(model, Llama):
        model.rotary_emb.reset_parameters()
        return
    rotary = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(model.config)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value
