"""Quantizing a model's linear layers in place: the native `Llama` and Hugging Face's ``LlamaForCausalLM``.

Every ``nn.Linear`` of the decoder layers becomes a `QuantizedLinear`: for the native Llama the fused ``qkv_proj``,
``o_proj``, ``gate_proj``, ``up_proj`` and ``down_proj``; for Hugging Face's, ``q_proj``, ``k_proj``, ``v_proj`` and
the same four. Quantizing the fused q/k/v weight gives exactly the codes and scales of quantizing q, k and v apart:
both formats work row by row (int8 scales are per row, int4 groups run along a row's inputs), and the fused rows
are q's, k's and v's rows stacked. The output projection (``lm_head``) and the embeddings stay in their float
dtype by default: they are the layers most sensitive to quantization, and a tied ``lm_head`` is the embedding.

Tensor-parallel layers (`colo.tensor` ``ColumnParallelLinear``, ``RowParallelLinear``, ``QKVParallelLinear``) are
refused: quantize the unsharded model. (Row-parallel shards would get per-shard int8 scales that differ from the
unsharded model's.) LoRA layers are refused too: merge the adapters first (`colo.apps.runs.load_llama`
merges them).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .formats import QuantConfig
from .linear import QuantizedLinear, check_backend

DEFAULT_SKIP = ("lm_head",)
"""Module names (last component) left in float by default."""


def quantize_model(
    model: nn.Module,
    config: QuantConfig | str,
    *,
    group_size: int | None = None,
    backend: str = "reference",
    skip: Sequence[str] = DEFAULT_SKIP,
) -> list[str]:
    """Replace ``model``'s ``nn.Linear`` layers (not those named in ``skip``) by `QuantizedLinear` ones, in place.

    Args:
        model (nn.Module): a `colo.apps.models.llama.Llama` or a Hugging Face ``LlamaForCausalLM`` (any module whose
            linear layers are plain ``nn.Linear``), unsharded, off the meta device.
        config (QuantConfig | str): the format, or its mode (``"int8"``, ``"int4"``) with ``group_size``.
        group_size (int | None): int4 group size when ``config`` is a mode string. Default: ``None`` (32 for int4).
        backend (str): the `QuantizedLinear` backend. Default: ``"reference"``.
        skip (Sequence[str]): last name components of linear layers to leave in float. Default: ``("lm_head",)``.

    Returns:
        list[str]: the qualified names of the quantized layers.

    Raises:
        ValueError: a bad config, an int4 group size not dividing a layer's ``in_features`` (nothing is replaced
            then), or a model holding nothing to quantize.
        TypeError: a tensor-parallel or LoRA layer.
    """
    config = config if isinstance(config, QuantConfig) else QuantConfig(mode=config, group_size=group_size)
    check_backend(backend, config)
    targets = quantizable_linears(model, skip=skip)
    for name, linear in targets:  # check every layer before replacing any
        config.check_in_features(linear.in_features, name=name)
    for name, linear in targets:
        _replace(model, name, QuantizedLinear.from_linear(linear, config, backend=backend, name=name))
    return [name for name, _ in targets]


def quantizable_linears(model: nn.Module, *, skip: Sequence[str] = DEFAULT_SKIP) -> list[tuple[str, nn.Linear]]:
    """The ``(name, layer)`` pairs `quantize_model` replaces (see its docstring for what it refuses)."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ("ColumnParallelLinear", "RowParallelLinear", "QKVParallelLinear") or kind.startswith(
            "SequenceParallel"
        ):
            raise TypeError(
                f"{name} is a tensor-parallel {kind}: weight-only quantization takes the unsharded model; quantize "
                "before parallelizing, or load the checkpoint into one process"
            )
        if hasattr(module, "lora_A") or kind.startswith("Lora"):
            raise TypeError(f"{name} holds LoRA adapters; merge them into the weights before quantizing")
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] not in skip:
            if module.weight.is_meta:
                raise ValueError(f"{name} is on the meta device; materialize the model before quantizing it")
            found.append((name, module))
    if not found:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantize (skip={tuple(skip)})")
    return found


def quantize_structure(
    model: nn.Module, config: QuantConfig, names: Sequence[str], *, backend: str = "reference"
) -> None:
    """Replace the ``nn.Linear`` layers ``names`` by empty `QuantizedLinear` ones (zeros, same device and compute
    dtype), to be filled from a quantized checkpoint; works on the meta device too.

    Raises:
        ValueError: a name that is not an ``nn.Linear`` of ``model``.
    """
    check_backend(backend, config)
    for name in names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is a {type(linear).__name__}, not an nn.Linear the checkpoint can fill")
        config.check_in_features(linear.in_features, name=name)
        layer = QuantizedLinear(
            linear.in_features,
            linear.out_features,
            config=config,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            backend=backend,
        )
        _replace(model, name, layer)


def set_backend(model: nn.Module, backend: str) -> None:
    """Switch every `QuantizedLinear` of ``model`` to ``backend`` (the stored tensors are unchanged)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.backend = check_backend(backend, module.config)


def storage_report(model: nn.Module) -> dict:
    """Bytes of the quantized linear weights against the same weights in bf16, and the ratio.

    Returns:
        dict: ``{"quantized_bytes", "bf16_bytes", "ratio", "num_layers"}`` over the model's `QuantizedLinear`s.
    """
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    quantized = sum(layer.storage_bytes() for layer in layers)
    bf16 = sum(2 * layer.in_features * layer.out_features for layer in layers)
    return {
        "quantized_bytes": quantized,
        "bf16_bytes": bf16,
        "ratio": quantized / bf16 if bf16 else float("nan"),
        "num_layers": len(layers),
    }


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, layer)
