"""LoRA fine-tuning through Hugging Face ``peft``, composed with colo's plugins.

`add_lora` injects ``peft``'s adapters into colo's `Llama` or a Hugging Face model (before `Booster.boost`) and
freezes the rest; the Booster then trains only the adapters under every plugin (ZeRO keeps optimizer state for
them alone), sharding them to match their layer under tensor parallelism (`colo.apps.lora.tensor_parallel`).
`merge_lora` folds them into the base weights in place (sharded or not); for a saved run,
`merge_lora_tensors` merges a checkpoint's tensors and `write_peft_adapter` writes the adapters as a ``peft``
adapter directory (``colo convert CHECKPOINT --to hf|peft OUT`` does both).

Example::

    model = Llama(config); load_weights(model)            # the pretrained base
    add_lora(model, r=16, alpha=32)                       # only the adapters are trainable now (the same A on
                                                          # every rank: drawn from seed=0 and each layer's name)
    model, optimizer, *_ = Booster(HybridParallel(tp=2, zero_stage=1)).boost(model, AdamW(...))
"""

from .adapters import (
    HF_LLAMA_TARGETS,
    NATIVE_LLAMA_TARGETS,
    add_lora,
    check_plain_lora,
    default_target_modules,
    init_lora_adapter,
    is_lora_layer,
    lora_layers,
    lora_parameters,
    lora_scaling,
    merge_lora,
)
from .export import has_lora_tensors, merge_lora_tensors, peft_adapter_state, write_peft_adapter
from .tensor_parallel import (
    DetachedLora,
    attach_lora_layers,
    detach_lora_layers,
    materialize_lora_adapters,
    restore_lora_layers,
)

__all__ = [
    "HF_LLAMA_TARGETS",
    "NATIVE_LLAMA_TARGETS",
    "DetachedLora",
    "add_lora",
    "attach_lora_layers",
    "check_plain_lora",
    "default_target_modules",
    "detach_lora_layers",
    "has_lora_tensors",
    "init_lora_adapter",
    "is_lora_layer",
    "lora_layers",
    "lora_parameters",
    "lora_scaling",
    "materialize_lora_adapters",
    "merge_lora",
    "merge_lora_tensors",
    "peft_adapter_state",
    "restore_lora_layers",
    "write_peft_adapter",
]
