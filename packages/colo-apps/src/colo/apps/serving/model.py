"""What `colo serve` serves: a checkpoint loaded as `colo generate` loads it, optionally quantized, optionally
sharded over a tensor-parallel group, wrapped in a `ServingEngine`.

A checkpoint is one of

- a colo run checkpoint (`colo.apps.runs.load_llama`: any layout, LoRA adapters merged);
- a quantized colo checkpoint written by ``colo convert --quantize`` (`colo.apps.quant.load_quantized`);
- a Hugging Face ``LlamaForCausalLM`` directory, e.g. one ``colo convert --to hf`` wrote
  (`colo.apps.hf.llama_io.load_llama_from_hf`); its tokenizer is the directory's ``tokenizer.json`` when it has one.

Quantized weights are not sharded: ``--quantize`` and quantized checkpoints serve on one rank (``tp=1``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from colo.tensor.checkpoint.index import INDEX_FILE

from ..runs import RUN_KEY, load_llama
from .engine import ServingEngine


@dataclass(kw_only=True)
class EngineOptions:
    """The engine's sizes (``colo serve`` options)."""

    max_batch_size: int = 16
    """Requests decoded together."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_bytes: int | None = None
    """The KV-cache budget per rank; ``None``: room for ``max_batch_size`` requests of ``max_model_len`` tokens."""
    max_model_len: int | None = None
    """Prompt plus generated tokens per request; ``None``: the model's ``max_position_embeddings``."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of prompts' common leading full blocks and skip their prefill."""
    max_tokens_per_step: int | None = None
    """Tokens one engine step feeds (chunked prefill); ``None``: prompts are prefilled whole."""


def load_for_serving(
    checkpoint: str | os.PathLike,
    *,
    quantize: str | None = None,
    group_size: int | None = None,
    tokenizer: str | None = None,
    device: str | torch.device = "cpu",
):
    """The model, its run metadata and its tokenizer.

    Args:
        checkpoint: a colo run checkpoint, a quantized colo checkpoint or a Hugging Face Llama directory.
        quantize (str | None): ``"int8"`` or ``"int4"``: quantize the loaded float model's linear layers
            (`colo.apps.quant.quantize_model`). Default: ``None``.
        group_size (int | None): the int4 group size. Default: ``None`` (32).
        tokenizer (str | None): a tokenizer path; ``None``: the run's (a Hugging Face directory's own). Default:
            ``None``.
        device: where to build the model. Default: ``"cpu"``.

    Returns:
        ``(model, run, tokenizer)``: the model in eval mode, the run metadata (``{}`` for a Hugging Face
        directory), the loaded tokenizer.

    Raises:
        ValueError: not a checkpoint colo can serve, or ``quantize`` on an already quantized checkpoint.
    """
    from ..data import load_tokenizer
    from ..quant import is_quantized_checkpoint, load_quantized, quantize_model

    path = os.fspath(checkpoint)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory; give a colo checkpoint or a Hugging Face Llama directory")
    if not os.path.isfile(os.path.join(path, INDEX_FILE)) and os.path.isfile(os.path.join(path, "config.json")):
        from ..hf.llama_io import load_llama_from_hf

        model = load_llama_from_hf(path).to(device).eval()
        own = os.path.join(path, "tokenizer.json")
        run = {"tokenizer": path if os.path.isfile(own) else None}
    elif is_quantized_checkpoint(path):
        if quantize is not None:
            raise ValueError(f"{path} is already quantized; leave out --quantize")
        model, metadata = load_quantized(path, device=device)
        run = metadata.get(RUN_KEY) or {}
    else:
        model, run = load_llama(path, device=device)
    if quantize is not None:
        quantize_model(model, quantize, group_size=group_size)
    tok = load_tokenizer(tokenizer if tokenizer is not None else run.get("tokenizer"))
    return model.eval(), run, tok


def is_quantized_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds `colo.apps.quant.QuantizedLinear` layers."""
    from ..quant import QuantizedLinear

    return any(isinstance(module, QuantizedLinear) for module in model.modules())


def build_engine(model, tokenizer, options: EngineOptions, *, group=None):
    """A `ServingEngine` over ``model`` with the tokenizer's eos as the stop token.

    Args:
        model: the (tp-sharded under ``group``) model.
        tokenizer: the run's tokenizer.
        options (EngineOptions): sizes.
        group: the tensor-parallel group, or ``None``.
    """
    return ServingEngine(
        model,
        tokenizer=tokenizer,
        eos_token_id=tokenizer.eos_id,
        max_batch_size=options.max_batch_size,
        block_size=options.block_size,
        kv_cache_bytes=options.kv_cache_bytes,
        max_model_len=options.max_model_len,
        enable_prefix_caching=options.enable_prefix_caching,
        max_tokens_per_step=options.max_tokens_per_step,
        vocab_limit=min(int(tokenizer.vocab_size), int(model.config.vocab_size)),  # a padded embedding's extra rows
        group=group,
    )


def shard_for_tp(model, *, tp: int):
    """Shard ``model`` (a native `Llama`, the same on every rank) over a ``Mesh(tp=tp)`` of the whole job;
    returns the mesh's tensor-parallel group.

    Raises:
        ValueError: a quantized model (its weights are not sharded), or a ``tp`` the model's shape does not allow.
    """
    from colo.comm import Mesh

    from ..models.llama import parallelize_llama

    if is_quantized_model(model):
        raise ValueError(
            "--tp > 1 does not shard quantized weights; serve a quantized model with --tp 1, or a float one with --tp"
        )
    mesh = Mesh(tp=tp)
    parallelize_llama(model, mesh=mesh)
    return mesh.group("tp")


def load_rank(spec: dict):
    """This rank's engine, run metadata and tokenizer, from the settings ``colo serve`` passes every rank.

    ``spec``: ``checkpoint``, ``quantize``, ``group_size``, ``tokenizer``, ``tp`` and ``engine`` (the
    `EngineOptions` fields). With ``tp > 1`` the process group is initialised from the environment first (set by
    `colo.apps.serving.server.start_followers`) and the model is sharded over all ranks.
    """
    tp = int(spec.get("tp", 1))
    device: str | torch.device = "cuda" if torch.cuda.is_available() else "cpu"
    if tp > 1:
        from colo.comm import init_distributed

        device = init_distributed().device
    model, run, tokenizer = load_for_serving(
        spec["checkpoint"],
        quantize=spec.get("quantize"),
        group_size=spec.get("group_size"),
        tokenizer=spec.get("tokenizer"),
        device=device,
    )
    group = shard_for_tp(model, tp=tp) if tp > 1 else None
    engine = build_engine(model, tokenizer, EngineOptions(**spec.get("engine", {})), group=group)
    return engine, run, tokenizer
