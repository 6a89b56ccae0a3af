"""The former home of checkpoint loading and one-prompt generation, now re-exported for the modules that still
import it from here: `colo.apps.runs` (`RUN_KEY`, `load_llama`, `model_config_of`, `lora_scaling_of`,
`chat_template_of`) and `colo.apps.generation` (`continue_prompt`, formerly ``generate``; `complete`). Import them
from there; this module goes once its last importer has moved."""

from ..generation import complete, continue_prompt
from ..runs import RUN_KEY, chat_template_of, load_llama, lora_scaling_of, model_config_of

generate = continue_prompt
"""The former name of `colo.apps.generation.continue_prompt` (``colo.apps.generation.generate`` is the batched
engine)."""

__all__ = [
    "RUN_KEY",
    "chat_template_of",
    "complete",
    "continue_prompt",
    "generate",
    "load_llama",
    "lora_scaling_of",
    "model_config_of",
]
