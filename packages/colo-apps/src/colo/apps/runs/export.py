"""Exporting a trainer checkpoint as a Hugging Face ``LlamaForCausalLM`` directory (``colo convert --to hf``; a LoRA
run's adapters merged into the weights; a mixture-of-experts run as ``MixtralForCausalLM`` or, with multi-head latent
attention, ``DeepseekV3ForCausalLM``), or a LoRA run's adapters alone as a ``peft`` adapter directory
(``colo convert --to peft``)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from colo.tensor.checkpoint import CheckpointError, export_hf, load_checkpoint, read_index

from ..hf.llama_io import llama_config_to_hf, save_llama_as_hf
from ..lora import has_lora_tensors, write_peft_adapter
from ..models.llama import Llama, LlamaConfig
from .load import load_llama
from .metadata import RUN_KEY, model_config_of, run_of

_INDEX = "model.safetensors.index.json"


def hf_name(name: str) -> str:
    """The Hugging Face name of a checkpoint tensor: ``model.`` prefixed, except ``lm_head``."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def check_llama_weights(index, config: LlamaConfig, *, where: str) -> None:
    """Raise a `CheckpointError` naming what is missing when ``index`` does not hold every weight of a Llama of
    ``config`` with its shape (the names a model built from ``config`` saves; checkpoints of any age)."""
    with torch.device("meta"):
        model = Llama(config)
    expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
    expected = {
        name.replace("qkv_proj", f"{part}_proj"): (rows, *shape[1:])
        for name, shape in expected.items()
        for part, rows in (_qkv_rows(config) if name.endswith("qkv_proj.weight") else [("", shape[0])])
    }
    wrong = sorted(
        name for name, shape in expected.items() if name not in index.tensors or index.tensors[name].shape != shape
    )
    if wrong:
        raise CheckpointError(
            f"{where}: the checkpoint lacks {len(wrong)} weights of its Llama config ({config.num_hidden_layers} "
            f"layers): {', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}; it is incomplete and cannot be "
            "converted"
        )


def _qkv_rows(config: LlamaConfig) -> list[tuple[str, int]]:
    """``[("q", rows), ("k", rows), ("v", rows)]`` of a fused q/k/v weight."""
    heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
    return [(part, n * config.head_dim) for part, n in zip("qkv", heads)]


def export_llama_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Write ``out_dir`` as a Hugging Face Llama: ``config.json`` and safetensors with Hugging Face names.

    Uses `colo.tensor.checkpoint.export_hf` (streamed, CRC-checked, any saved layout; q, k and v are already
    stored apart), then renames the tensors with the ``model.`` prefix, one file at a time. A LoRA run's checkpoint
    is loaded whole instead, its adapters merged (``W + (alpha / r) B A``), and written as a plain model. A
    mixture-of-experts run (`MoELlama`, any ``ep``) is loaded whole too and written as a Hugging Face
    ``MixtralForCausalLM`` (`colo.apps.hf.mixtral_io`: one tensor per expert, ``block_sparse_moe.experts.{e}.w1``;
    only models whose every layer is MoE have that form), or, with multi-head latent attention, as a
    ``DeepseekV3ForCausalLM`` (`colo.apps.hf.deepseek_io`: ``mlp.experts.{e}.gate_proj``, the expert biases from the
    checkpoint's metadata as ``e_score_correction_bias``).

    Args:
        checkpoint: a checkpoint written by the trainer.
        out_dir: the output directory.
        dtype: convert floating-point tensors (e.g. ``torch.bfloat16``); ``None`` keeps fp32.
        overwrite: replace an earlier export in ``out_dir``.

    Returns:
        The files written.
    """
    checkpoint, out_dir = os.fspath(checkpoint), os.fspath(out_dir)
    index = read_index(checkpoint)
    run = run_of(index, source=checkpoint)
    if "num_local_experts" in run["llama_config"]:  # MoE: Mixtral / DeepseekV3, the model whole in host memory
        return _export_mixtral(checkpoint, out_dir, model_config_of(run), dtype=dtype, overwrite=overwrite)
    if has_lora_tensors(index.tensors):  # merge in one process (the whole model in host memory), then write
        return _export_merged_lora(checkpoint, out_dir, dtype=dtype, overwrite=overwrite)
    check_llama_weights(index, LlamaConfig(**run["llama_config"]), where=checkpoint)
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
    config = llama_config_to_hf(LlamaConfig(**run["llama_config"]), dtype=dtype or torch.float32)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    return [os.path.join(out_dir, name) for name in (*files, "config.json")]


def _export_mixtral(checkpoint: str, out_dir: str, config, *, dtype: torch.dtype | None, overwrite: bool) -> list[str]:
    """A Mixtral, or a DeepseekV3 for a model with multi-head latent attention."""
    from ..hf.deepseek_io import check_deepseek_v3_form, save_moe_llama_as_deepseek_v3
    from ..hf.mixtral_io import load_moe_llama_checkpoint, mixtral_config_to_hf, save_moe_llama_as_hf

    deepseek = config.latent_attention
    if deepseek:  # a model with no such form is refused before anything is read
        check_deepseek_v3_form(config)
    else:
        mixtral_config_to_hf(config)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (--overwrite) to replace an earlier export")
    model = load_moe_llama_checkpoint(checkpoint, config)
    if dtype is not None:
        model = model.to(dtype)
    save = save_moe_llama_as_deepseek_v3 if deepseek else save_moe_llama_as_hf
    return [os.path.join(out_dir, name) for name in save(model, out_dir)]


def _export_merged_lora(checkpoint: str, out_dir: str, *, dtype: torch.dtype | None, overwrite: bool) -> list[str]:
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (--overwrite) to replace an earlier export")
    model, _ = load_llama(checkpoint)
    if dtype is not None:
        model = model.to(dtype)
    return [os.path.join(out_dir, name) for name in save_llama_as_hf(model, out_dir)]


def export_lora_adapter(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Write a LoRA run's adapters as a ``peft`` adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) for the Hugging Face export of its base model: ``PeftModel.from_pretrained(
    LlamaForCausalLM.from_pretrained(BASE), out_dir)`` computes what the run's model computes.

    The adapters of the native model's fused q/k/v projection are written as q_proj, k_proj and v_proj adapters
    (the shared ``A`` with each projection's rows of ``B``), as the checkpoint stores them. The base is the run's
    ``model.init_from`` (recorded as ``base_model_name_or_path``); a run from scratch has no other copy of its base
    weights than the checkpoint: export it with ``--to hf`` from a checkpoint without adapters, or use the merged
    export.

    Args:
        checkpoint: a checkpoint of a colo trainer run with ``lora.enabled``.
        out_dir: the output directory (created).

    Returns:
        The files written.
    """
    checkpoint = os.fspath(checkpoint)
    index = read_index(checkpoint)
    run = index.metadata.get(RUN_KEY) or {}
    settings = (run.get("config") or {}).get("lora") or {}
    if not settings.get("enabled") or not has_lora_tensors(index.tensors):
        raise ValueError(f"{checkpoint} is not a checkpoint of a LoRA run (lora.enabled); use --to hf")
    names = [name for name in index.tensors if ".lora_A." in name or ".lora_B." in name]
    tensors = {name: torch.empty(index.tensors[name].shape, dtype=index.tensors[name].dtype) for name in names}
    load_checkpoint(checkpoint, tensors, strict=False)
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names})
    return write_peft_adapter(
        out_dir,
        {hf_name(name): tensor for name, tensor in tensors.items()},
        r=settings["r"],
        alpha=settings["alpha"],
        dropout=settings.get("dropout", 0.0),
        use_rslora=settings.get("use_rslora", False),
        target_modules=targets,
        base_model_name_or_path=(run["config"].get("model") or {}).get("init_from"),
    )
