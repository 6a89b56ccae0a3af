"""LoRA in saved tensors: merge a checkpoint's adapters into its weights, or write them as a ``peft`` adapter.

A checkpoint of a LoRA run holds, for each adapted linear ``X``, ``X.base_layer.weight`` and the adapters
``X.lora_A.<adapter>.weight`` (``(r, in)``) and ``X.lora_B.<adapter>.weight`` (``(out, r)``), unsharded, whatever
layout saved them. `merge_lora_tensors` turns them into ``X.weight = base + scaling * B A`` (what a model without
adapters loads); `peft_adapter_state` renames the adapters the way ``peft``'s ``save_pretrained`` does, so
``PeftModel.from_pretrained`` loads them onto the Hugging Face base model (`write_peft_adapter`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

import torch

_ADAPTER = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")
_BASE = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<leaf>weight|bias)$")


def has_lora_tensors(tensors: Mapping[str, object]) -> bool:
    """Whether ``tensors`` (names, or a name-keyed mapping) hold LoRA adapters."""
    return any(_ADAPTER.match(name) for name in tensors)


def _adapters(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``{module: {adapter: {"A": tensor, "B": tensor}}}``, checking that every adapter has both halves."""
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _ADAPTER.match(name)
        if match:
            found.setdefault(match["module"], {}).setdefault(match["adapter"], {})[match["which"]] = tensor
    for module, adapters in found.items():
        for adapter, halves in adapters.items():
            if set(halves) != {"A", "B"}:
                raise ValueError(f"{module}: adapter {adapter!r} has lora_{''.join(halves)} but not both A and B")
    return found


@torch.no_grad()
def merge_lora_tensors(tensors: Mapping[str, torch.Tensor], *, scaling: float) -> dict[str, torch.Tensor]:
    """The state without adapters: ``X.weight = X.base_layer.weight + scaling * sum_adapters(B A)``.

    Args:
        tensors: unsharded tensors by name (a checkpoint's, or a state dict of a model with ``peft`` adapters).
        scaling: ``alpha / r`` of the run (`colo.apps.lora.lora_scaling`).

    Returns:
        Names -> tensors: every base weight merged and renamed, adapters dropped, everything else as given.

    Raises:
        ValueError: an adapter without its base weight, or of the wrong shape.
    """
    adapters = _adapters(tensors)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if _ADAPTER.match(name):
            continue
        base = _BASE.match(name)
        if base is None:
            merged[name] = tensor
            continue
        module = base["module"]
        if base["leaf"] == "weight" and module in adapters:
            update = torch.zeros(tensor.shape, dtype=torch.float32)
            for adapter, halves in adapters[module].items():
                a, b = halves["A"].float(), halves["B"].float()
                if (b.shape[0], a.shape[1]) != tuple(tensor.shape) or b.shape[1] != a.shape[0]:
                    raise ValueError(
                        f"{module}: adapter {adapter!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, which do not "
                        f"make an update of the base weight's shape {tuple(tensor.shape)}"
                    )
                update += b @ a
            tensor = (tensor.float() + scaling * update).to(tensor.dtype)
        merged[f"{module}.{base['leaf']}"] = tensor
    orphans = sorted(module for module in adapters if f"{module}.weight" not in merged)
    if orphans:
        raise ValueError(f"adapters without a base weight ({module}.base_layer.weight): {orphans[:3]}")
    return merged


def peft_adapter_state(tensors: Mapping[str, torch.Tensor], *, prefix: str = "base_model.model.") -> dict:
    """The adapters of ``tensors`` under the names ``peft``'s ``save_pretrained`` writes
    (``base_model.model.<module>.lora_A.weight``: the adapter name dropped); one adapter only."""
    adapters = _adapters(tensors)
    names = {adapter for per_module in adapters.values() for adapter in per_module}
    if len(names) > 1:
        raise ValueError(f"the tensors hold adapters {sorted(names)}; a peft adapter file holds one")
    return {
        f"{prefix}{module}.lora_{which}.weight": halves[which].contiguous()
        for module, per_module in adapters.items()
        for halves in per_module.values()
        for which in "AB"
    }


def write_peft_adapter(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
    target_modules: Sequence[str] | None = None,
    base_model_name_or_path: str | None = None,
) -> list[str]:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` as ``peft`` does, for the adapters in
    ``tensors`` (named as the Hugging Face base model names its modules).

    Args:
        directory: where to write (created).
        tensors: Hugging Face names -> tensors, including ``<module>.lora_A.<adapter>.weight`` / ``lora_B``.
        r, alpha, dropout, use_rslora: the adapters' settings.
        target_modules: module-name suffixes for the config; ``None``: the adapted modules' last names.
        base_model_name_or_path: recorded in the config (where the base model is).

    Returns:
        The files written.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    state = peft_adapter_state(tensors)
    if not state:
        raise ValueError("no LoRA adapters to write (no '<module>.lora_A.<adapter>.weight' tensors)")
    if target_modules is None:
        target_modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in state})
    os.makedirs(directory, exist_ok=True)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        use_rslora=use_rslora,
        target_modules=list(target_modules),
        bias="none",
        base_model_name_or_path=base_model_name_or_path,
    )
    config.save_pretrained(os.fspath(directory))
    weights = os.path.join(directory, "adapter_model.safetensors")
    save_file(state, weights, metadata={"format": "pt"})
    return [os.path.join(directory, "adapter_config.json"), weights]
