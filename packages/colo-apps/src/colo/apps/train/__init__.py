"""The trainer and its run config: ``colo train`` in Python.

- `RunConfig` (`config.py`): the pydantic run config (model preset + overrides, plugin, optimizer, schedule, data,
  checkpoint, logging, eval, sample); `load_config` reads YAML / TOML files, run presets (`RUN_PRESETS`) and
  ``a.b=c`` overrides, raising `ConfigError` with the field's name.
- `Trainer` / `train` (`trainer.py`): the training loop with checkpoints, exact resume, eval and a final sample.
- `optim.py` (AdamW groups, warmup + cosine), `state.py` (RNG states as JSON, checkpoint pruning and resume),
  `metrics.py` (progress bar, JSONL, TensorBoard), `generate.py` (`load_llama`, `generate`).

Example::

    from colo.apps.train import load_config, train

    result = train(load_config("run.yaml", overrides=["optimizer.lr=1e-3"]))  # on every rank of the job
"""

from .config import RunConfig
from .generate import generate, load_llama
from .loading import ConfigError, apply_overrides, load_config, read_config_file, validate_config
from .optim import WarmupCosine, build_optimizer, build_scheduler, param_groups
from .presets import RUN_PRESETS
from .pretrained import PretrainedLlamaWeights, load_pretrained_llama, pretrained_llama_config
from .state import committed_checkpoints, prune_checkpoints, resolve_resume, rng_state, set_rng_state
from .trainer import Trainer, TrainResult, train

__all__ = [
    "RUN_PRESETS",
    "PretrainedLlamaWeights",
    "ConfigError",
    "RunConfig",
    "TrainResult",
    "Trainer",
    "WarmupCosine",
    "apply_overrides",
    "build_optimizer",
    "build_scheduler",
    "committed_checkpoints",
    "generate",
    "load_config",
    "load_llama",
    "load_pretrained_llama",
    "param_groups",
    "pretrained_llama_config",
    "prune_checkpoints",
    "read_config_file",
    "resolve_resume",
    "rng_state",
    "set_rng_state",
    "train",
    "validate_config",
]
