"""A Mixtral-style mixture-of-experts Llama: config and presets (tiny to Mixtral-8x7B's shape), the model
(architecture only; the MoE machinery is `colo.tensor.moe`), and the mapping to Hugging Face Mixtral names.

Example::

    from colo.apps.models.moe_llama import MoELlama, get_moe_preset
    from colo.tensor.moe import shard_experts

    model = MoELlama(get_moe_preset("tiny-moe"))
    shard_experts(model, mesh=Mesh(dp=1, ep=2))          # experts split over ep, tokens by all-to-all
"""

from .config import MOE_PRESETS, MoELlamaConfig, get_moe_preset
from .hf import (
    mixtral_config_from_hf,
    moe_llama_state_dict_from_hf,
    moe_llama_state_dict_to_deepseek_v3,
    moe_llama_state_dict_to_hf,
)
from .mla import MultiHeadLatentAttention
from .model import MoELlama, init_moe_llama_module

__all__ = [
    "MOE_PRESETS",
    "MoELlama",
    "MoELlamaConfig",
    "MultiHeadLatentAttention",
    "get_moe_preset",
    "init_moe_llama_module",
    "mixtral_config_from_hf",
    "moe_llama_state_dict_from_hf",
    "moe_llama_state_dict_to_deepseek_v3",
    "moe_llama_state_dict_to_hf",
]
