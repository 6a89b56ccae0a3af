"""colo.apps: the Booster and its plugins, native models and their plans, Hugging Face plans, the trainer, configs,
the `colo` CLI and the recipes.

`Booster(plugin)` with the `DDP`, `Zero`, `Gemini` and `HybridParallel` plugins (`colo.apps.booster`) applies a
parallelism and runs whole training steps. Native models live in `colo.apps.models` (the Llama: config and
presets, the model, `parallelize_llama`, pipeline stages, FLOPs per token); MFU helpers in `colo.apps.mfu`;
activation checkpointing applied from outside the model in `colo.apps.checkpointing`. The trainer and its run
config live in `colo.apps.train` (`RunConfig`, `load_config`, `Trainer`, and the function `colo.apps.train.train`),
the ``colo`` command in `colo.apps.cli`. The main names are re-exported here.
"""

from .booster import DDP, Booster, Gemini, HybridParallel, Plugin, StepResult, Zero
from .checkpointing import apply_activation_checkpointing
from .mfu import PEAK_FLOPS, format_mfu, mfu, peak_flops
from .models import (
    Llama,
    LlamaConfig,
    LlamaOutput,
    LlamaStage,
    flops_per_token,
    get_preset,
    llama_pipeline_stages,
    parallelize_llama,
)

__version__ = "0.1.0"

_FROM_TRAIN = ("RunConfig", "Trainer", "TrainResult", "load_config")


def __getattr__(name: str):
    """The trainer's names, imported on first use (importing the run config loads every recipe's section)."""
    if name in _FROM_TRAIN:
        from . import train

        return getattr(train, name)
    raise AttributeError(f"module 'colo.apps' has no attribute {name!r}")


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
