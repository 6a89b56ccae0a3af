"""colo.apps: the Booster and its plugins, native models and their plans, Hugging Face plans, the trainer, configs,
the `colo` CLI and the recipes.

`Booster(plugin)` with the `DDP`, `Zero`, `Gemini` and `HybridParallel` plugins (`colo.apps.booster`) applies a
parallelism and runs whole training steps. Native models live in `colo.apps.models` (the Llama: config and
presets, the model, `parallelize_llama`, pipeline stages, FLOPs per token); MFU helpers in `colo.apps.mfu`;
activation checkpointing applied from outside the model in `colo.apps.checkpointing`. The trainer and its run
config live in `colo.apps.train` (`RunConfig`, `load_config`, `Trainer`, and the function `colo.apps.train.train`),
the ``colo`` command in `colo.apps.cli`. The main names are re-exported here.
"""

from ._lazy import lazy_exports
from .mfu import PEAK_FLOPS, format_mfu, mfu, peak_flops  # torch-free; imported here: `mfu` is also a module name

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("DDP", "Booster", "Gemini", "HybridParallel", "Plugin", "StepResult", "Zero"), "booster"),
    "apply_activation_checkpointing": "checkpointing",
    **dict.fromkeys(
        (
            "Llama",
            "LlamaConfig",
            "LlamaOutput",
            "LlamaStage",
            "flops_per_token",
            "get_preset",
            "llama_pipeline_stages",
            "parallelize_llama",
        ),
        "models",
    ),
    **dict.fromkeys(("RunConfig", "Trainer", "TrainResult", "load_config"), "train"),
}
"""Where each re-exported name lives: imported on first use (PEP 562), so importing a torch-free part of colo.apps
(``colo.apps.data``'s tokenizers and shard writers, which ``colo data prepare``'s worker processes import) does not
import torch, the models and the booster (seconds per process)."""


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__: list[str] = [
    "DDP",
    "PEAK_FLOPS",
    "Booster",
    "Gemini",
    "HybridParallel",
    "Plugin",
    "StepResult",
    "Zero",
    "Llama",
    "RunConfig",
    "TrainResult",
    "Trainer",
    "LlamaConfig",
    "LlamaOutput",
    "LlamaStage",
    "__version__",
    "apply_activation_checkpointing",
    "flops_per_token",
    "format_mfu",
    "get_preset",
    "llama_pipeline_stages",
    "load_config",
    "mfu",
    "parallelize_llama",
    "peak_flops",
]
