"""The trainer and its run config: ``colo train`` in Python.

- `RunConfig` (`config.py`): the pydantic run config (model preset + overrides, plugin, optimizer, schedule, data,
  checkpoint, logging, eval, sample); `load_config` reads YAML / TOML files, run presets (`RUN_PRESETS`) and
  ``a.b=c`` overrides, raising `ConfigError` with the field's name.
- `Trainer` / `train` (`trainer.py`): the one training loop of every task, with checkpoints, exact resume, eval and
  the task's final samples.
- `TrainTask`, `TaskContext`, `TaskSpec`, `TaskRule`, `register_task` (`task.py`): the seam a recipe plugs into and
  the registry ``data.task`` is looked up in; `LanguageModelTask` (`language_model.py`): ``pretrain`` / ``sft``.
- `optim.py` (AdamW groups, warmup + cosine), `state.py` (RNG states as JSON, checkpoint pruning and resume),
  `metrics.py` (progress bar, JSONL, TensorBoard).
- Re-exported from `colo.apps.runs` (where a run's checkpoint is opened as a model): `load_llama`,
  `pretrained_llama_config`, `load_pretrained_llama`, `PretrainedLlamaWeights`.

Example::

    from colo.apps.train import load_config, train

    result = train(load_config("run.yaml", overrides=["optimizer.lr=1e-3"]))  # on every rank of the job
"""

from ..runs import PretrainedLlamaWeights, load_llama, load_pretrained_llama, pretrained_llama_config
from .config import RunConfig
from .language_model import ChatTask, LanguageModelTask
from .loading import ConfigError, apply_overrides, load_config, read_config_file, validate_config
from .optim import WarmupCosine, build_optimizer, build_scheduler, param_groups
from .presets import RUN_PRESETS
from .state import committed_checkpoints, prune_checkpoints, resolve_resume, rng_state, set_rng_state
from .task import TaskContext, TaskRule, TaskSpec, TrainTask, register_task, task_specs
from .trainer import Trainer, TrainResult, train

__all__ = [
    "RUN_PRESETS",
    "ChatTask",
    "LanguageModelTask",
    "TaskContext",
    "TaskRule",
    "TaskSpec",
    "TrainTask",
    "register_task",
    "task_specs",
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
