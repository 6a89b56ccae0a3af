"""colo's native Llama: config and presets, the model (architecture only), its KV cache for incremental decoding,
its parallelize plan, pipeline stages, FLOPs per token and the mapping to Hugging Face names.

Example::

    import torch
    from colo.apps.models.llama import Llama, get_preset, parallelize_llama
    from colo.comm import Mesh

    config = get_preset("bench-25m")
    with torch.device("meta"):
        model = Llama(config)                      # no memory, no initialization
    parallelize_llama(model, mesh=Mesh(tp=2), materialize="cuda", seed=0)   # each rank: only its shards
    loss = model(input_ids, labels=input_ids).loss
"""

from .config import PRESETS, LlamaConfig, get_preset
from .flops import flops_per_token, matmul_parameters
from .hf import llama_config_from_hf, llama_state_dict_from_hf, llama_state_dict_to_hf
from .kv_cache import KVCache, LayerKVCache
from .layers import (
    AttentionCore,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from .loss import IGNORE_INDEX, CausalLMObjective, causal_lm_loss, shift_labels
from .model import Llama, LlamaOutput, init_llama_module, module_seed
from .parallelize import (
    VocabParallelCausalLMObjective,
    apply_tp,
    check_tp_size,
    llama_tp_plan,
    parallelize_llama,
)
from .pipeline import LlamaStage, llama_pipeline_stages

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "AttentionCore",
    "CausalLMObjective",
    "KVCache",
    "LayerKVCache",
    "Llama",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaMLP",
    "LlamaOutput",
    "LlamaStage",
    "RMSNorm",
    "RotaryEmbedding",
    "VocabParallelCausalLMObjective",
    "apply_rotary",
    "apply_tp",
    "causal_lm_loss",
    "check_tp_size",
    "flops_per_token",
    "get_preset",
    "init_llama_module",
    "llama_config_from_hf",
    "llama_pipeline_stages",
    "llama_state_dict_from_hf",
    "llama_state_dict_to_hf",
    "llama_tp_plan",
    "matmul_parameters",
    "module_seed",
    "parallelize_llama",
    "shift_labels",
]
