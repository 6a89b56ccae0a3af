"""Hugging Face models in colo: ``LlamaForCausalLM`` directories to and from the native `Llama`
(`load_llama_from_hf`, `save_llama_as_hf`; no transformers import), and `HybridParallel` plans for
``transformers``' ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` objects (`HFLlamaPlan`, `HFGPT2Plan`), registered
by class name when `colo.apps.booster` is imported."""

from .llama_io import llama_config_to_hf, load_llama_from_hf, read_hf_config, read_hf_state_dict, save_llama_as_hf
from .pipeline import HFLlamaStage, hf_llama_pipeline_stages
from .plans import HFGPT2Plan, HFLlamaPlan, conv1d_to_linear, transformers_class

__all__ = [
    "HFGPT2Plan",
    "HFLlamaPlan",
    "HFLlamaStage",
    "conv1d_to_linear",
    "hf_llama_pipeline_stages",
    "llama_config_to_hf",
    "load_llama_from_hf",
    "read_hf_config",
    "read_hf_state_dict",
    "save_llama_as_hf",
    "transformers_class",
]
