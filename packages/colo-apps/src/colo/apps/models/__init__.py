"""Native models with their parallelize plans (`colo.apps.models.llama` first). A model file holds architecture
only; each model's ``parallelize.py`` applies parallelism from outside."""

from .llama import (
    Llama,
    LlamaConfig,
    LlamaOutput,
    LlamaStage,
    flops_per_token,
    get_preset,
    llama_pipeline_stages,
    parallelize_llama,
)

__all__ = [
    "Llama",
    "LlamaConfig",
    "LlamaOutput",
    "LlamaStage",
    "flops_per_token",
    "get_preset",
    "llama_pipeline_stages",
    "parallelize_llama",
]
