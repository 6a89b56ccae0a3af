"""LoRA adapters through Hugging Face ``peft``: add them to a model, find them, merge them back.

LoRA (Hu et al., 2021, https://arxiv.org/abs/2106.09685) freezes a pretrained weight ``W`` and trains a low-rank
update: ``y = x W^T + scaling * (x A^T) B^T`` with ``A`` of shape ``(r, in)``, ``B`` of shape ``(out, r)`` and
``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). `add_lora` injects ``peft``'s LoRA layers in place
(the module names stay; each target linear becomes a ``peft`` ``lora.Linear`` holding the original as
``base_layer`` and the adapters as ``lora_A.<adapter>`` / ``lora_B.<adapter>``) and freezes everything else, so
the Booster's plugins see only the adapters as trainable: DDP reduces only their gradients and ZeRO puts only
them into the optimizer. Under tensor parallelism the adapters are sharded to match their base layer
(`colo.apps.lora.tensor_parallel`). `merge_lora` folds ``scaling * B A`` into the base weights, sharded or not,
and puts the base layers back in place of the wrappers.

``peft`` is an optional dependency (``pip install colo-apps[lora]``); nothing imports it until `add_lora` is called.
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

NATIVE_LLAMA_TARGETS = ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linears of colo's native `Llama` that get adapters by default: every projection of every decoder layer."""

HF_LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The same projections in Hugging Face Llama models (q, k and v apart)."""

LORA_SEEDS_ATTR = "colo_lora_seeds"
"""The attribute of a ``peft`` LoRA layer holding ``{adapter name: seed}`` for the adapters `add_lora` added, so
that adapters added on the meta device are materialized from the same seed (`materialize_lora_adapters`)."""


def _require_peft():
    try:
        import peft
    except ImportError as error:  # pragma: no cover - peft is in the testing extras
        raise ImportError("LoRA needs the peft package: pip install 'colo-apps[lora]' (or pip install peft)") from error
    return peft


def default_target_modules(model: nn.Module) -> tuple[str, ...] | str:
    """The linears `add_lora` targets when none are named: every projection of the decoder layers of colo's
    `Llama` or a Hugging Face Llama; ``peft``'s ``"all-linear"`` for other models."""
    from ..models.llama import Llama, LlamaStage

    if isinstance(model, (Llama, LlamaStage)):
        return NATIVE_LLAMA_TARGETS
    if type(model).__name__ == "LlamaForCausalLM":
        return HF_LLAMA_TARGETS
    return "all-linear"


def add_lora(
    model: nn.Module,
    *,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
    use_rslora: bool = False,
    adapter_name: str = "default",
    seed: int = 0,
) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (``peft.inject_adapter_in_model``) and freeze the rest.

    Call it on the unsharded model, the same way on every rank, before `colo.apps.Booster.boost`. ``A`` is drawn
    as ``peft`` draws it (Kaiming-uniform, ``a=sqrt(5)``) but from a generator seeded by ``seed`` and the layer's
    name (`init_lora_adapter`), not from the torch RNG, and ``B`` is zero, so the model is unchanged until trained:
    every rank of a job, and one process, get the same adapters whatever their torch RNG states (the ranks of a
    launched job are seeded differently), on the CPU or a GPU, on an eager or a meta-device model (the
    `HybridParallel` plugin then draws them from the same seed when it materializes the model).

    Args:
        model (nn.Module): colo's `Llama`, a Hugging Face model, or any module with ``nn.Linear`` targets.
        r (int): the adapters' rank. Default: ``8``.
        alpha (float): the LoRA scale numerator: ``scaling = alpha / r``. Default: ``16.0``.
        dropout (float): dropout on the adapters' input. Default: ``0.0``.
        target_modules (Sequence[str] | str | None): module names (or name suffixes, or a regex) to adapt, as
            ``peft`` reads them; ``None``: `default_target_modules`. Default: ``None``.
        use_rslora (bool): rank-stabilized scaling ``alpha / sqrt(r)`` (Kalajdzievski, 2023). Default: ``False``.
        adapter_name (str): the adapter's name in the ``lora_A`` / ``lora_B`` dicts. Default: ``"default"``.
        seed (int): the seed the adapters' ``A`` is drawn from, with each layer's name. Default: ``0``.

    Returns:
        nn.Module: ``model``, with only the adapters trainable.

    Raises:
        ValueError: ``r`` or ``alpha`` not positive, ``dropout`` outside ``[0, 1)``, the model already has
            adapters, or no module matches ``target_modules``.
    """
    if r < 1:
        raise ValueError(f"add_lora: r={r} must be a positive rank, e.g. 8 or 16")
    if alpha <= 0:
        raise ValueError(f"add_lora: alpha={alpha} must be positive (scaling = alpha / r)")
    if not 0 <= dropout < 1:
        raise ValueError(f"add_lora: dropout={dropout} must be in [0, 1)")
    if any(True for _ in lora_layers(model)):
        raise ValueError("add_lora: the model already has LoRA adapters; add them once (or merge_lora first)")
    peft = _require_peft()
    targets = default_target_modules(model) if target_modules is None else target_modules
    if isinstance(targets, (list, tuple)):
        targets = list(targets)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, use_rslora=use_rslora, bias="none"
    )
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=adapter_name)
    except ValueError as error:
        raise ValueError(f"add_lora: target_modules={targets!r}: {error}") from None
    layers = list(lora_layers(model))
    if not layers:  # pragma: no cover - peft raises first
        raise ValueError(f"add_lora: no module of the model matches target_modules={targets!r}")
    for name, layer in layers:
        if adapter_name not in layer.lora_A:  # an embedding's adapters (lora_embedding_A): peft's own init
            continue
        seeds = getattr(layer, LORA_SEEDS_ATTR, None) or {}
        setattr(layer, LORA_SEEDS_ATTR, {**seeds, adapter_name: seed})
        if not layer.lora_A[adapter_name].weight.is_meta:
            init_lora_adapter(layer, name, adapter_name, seed=seed)
    return model


@torch.no_grad()
def init_lora_adapter(layer: nn.Module, name: str, adapter: str, *, seed: int) -> None:
    """Give ``layer``'s adapter ``adapter`` the values `add_lora` starts it from: ``A`` as ``peft`` initializes it
    (Kaiming-uniform, ``a=sqrt(5)``), drawn in fp32 on the CPU from a generator seeded by ``seed`` and ``name`` (the
    layer's qualified name in the model), then cast and copied to where ``A`` lives; ``B`` zero. A function of
    ``(seed, name)`` only, as the native Llama's initialization is: the same on every rank and device."""
    lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    values = torch.empty(lora_a.weight.shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
    lora_a.weight.copy_(values)
    nn.init.zeros_(lora_b.weight)


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a ``peft`` LoRA layer (False for everything when peft was never imported)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, peft LoRA layer)`` for every adapted module of ``model``."""
    for name, module in model.named_modules():
        if is_lora_layer(module):
            yield name, module


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter parameters of ``model`` by qualified name (``...lora_A.default.weight``, ...)."""
    return {name: p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}


def lora_scaling(r: int, alpha: float, *, use_rslora: bool = False) -> float:
    """``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA): the factor of ``B A`` in the adapted weight."""
    return alpha / (r**0.5 if use_rslora else r)


def check_plain_lora(name: str, layer: nn.Module) -> None:
    """Raise a `ValueError` naming ``name`` unless its adapters are plain LoRA on a linear layer (colo merges and
    shards those; not DoRA, ``lora_bias`` or a Conv1D's ``fan_in_fan_out`` adapters)."""
    if getattr(layer, "fan_in_fan_out", False):
        raise ValueError(f"{name!r}: adapters of a fan_in_fan_out (Conv1D) layer are not supported; convert it first")
    if any(getattr(layer, "use_dora", {}).values()) or any(getattr(layer, "lora_bias", {}).values()):
        raise ValueError(f"{name!r}: DoRA and lora_bias adapters are not supported by colo; use plain LoRA")


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every active adapter into its base weights and put the base layers back, in place.

    Works on unsharded models and on models sharded by a tensor-parallel plan (each rank adds its own block of
    ``scaling * B A``: with a column-parallel base ``B`` holds this rank's rows, with a row-parallel base ``A``
    holds its columns, with a fused q/k/v base ``B`` holds the same q, k and v rows), so the merged shards are
    slices of the unsharded merge. Merge a model that is not boosted (or whose parameters are its own tensors,
    not ZeRO-3 shards); to export a trained run, merge its checkpoint (`colo.apps.lora.merge_lora_tensors`).

    Returns:
        nn.Module: ``model`` without adapters (its base weights still frozen).
    """
    for name, layer in list(lora_layers(model)):
        check_plain_lora(name, layer)
        base = layer.get_base_layer()
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            lora_a, lora_b, scaling = layer.lora_A[adapter], layer.lora_B[adapter], layer.scaling[adapter]
            a = lora_a.weight.float()
            for param_name, b in lora_b.named_parameters(recurse=False):
                target = getattr(base, param_name)  # weight, or q_weight / k_weight / v_weight of a fused q/k/v
                target.add_((b.float() @ a * scaling).to(target.dtype))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, base)
    return model
