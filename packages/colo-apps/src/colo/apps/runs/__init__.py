"""colo.apps.runs: a trainer run's checkpoint opened as a model, in one place for the CLI, serving, quantization
and the recipes.

- `metadata.py`: `RUN_KEY` (where the trainer records the run in a checkpoint's metadata), `run_of` (that record,
  or an error naming the checkpoint), `model_config_of` (a `LlamaConfig`, or a `MoELlamaConfig`),
  `lora_scaling_of`, `chat_template_of` (an SFT run's `ChatTemplate`).
- `load.py`: `load_llama(checkpoint)`: any layout into one process, a LoRA run's adapters merged, every expert of a
  mixture-of-experts run; `load_reward_model(checkpoint)`: a ``data.task: rm`` run's Llama with its scalar head,
  frozen.
- `pretrained.py`: ``model.init_from`` (a Hugging Face Llama directory or a colo checkpoint):
  `pretrained_llama_config`, `load_pretrained_llama` (whole), `PretrainedLlamaWeights` (module by module, for a
  model the plugin materializes shard by shard).
- `export.py`: `export_llama_hf` (``colo convert --to hf``: a ``LlamaForCausalLM`` directory, a LoRA run merged, a
  ``MixtralForCausalLM`` for an MoE run), `export_lora_adapter` (``--to peft``).

The trainer (`colo.apps.train`) writes these checkpoints and imports this package; this package imports neither
the trainer nor a recipe.

Example::

    from colo.apps.runs import chat_template_of, load_llama

    model, run = load_llama("runs/tiny-llama/checkpoints/step-00000300")
    template = chat_template_of(run)  # None unless data.task was sft
"""

from .export import export_llama_hf, export_lora_adapter
from .load import load_llama, load_reward_model
from .metadata import RUN_KEY, chat_template_of, has_lora, lora_scaling_of, model_config_of, run_of
from .pretrained import PretrainedLlamaWeights, load_pretrained_llama, pretrained_llama_config

__all__ = [
    "RUN_KEY",
    "PretrainedLlamaWeights",
    "chat_template_of",
    "export_llama_hf",
    "export_lora_adapter",
    "has_lora",
    "load_llama",
    "load_pretrained_llama",
    "load_reward_model",
    "lora_scaling_of",
    "model_config_of",
    "pretrained_llama_config",
    "run_of",
]
