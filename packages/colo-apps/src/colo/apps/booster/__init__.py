"""The Booster and its plugins: one object that applies a parallelism plan and runs whole training steps."""

from .booster import Booster
from .microbatch import split_batch
from .plugins.base import Engine, Plugin, StepResult
from .plugins.ddp import DDP
from .plugins.zero import Zero

__all__ = ["DDP", "Booster", "Engine", "Plugin", "StepResult", "Zero", "split_batch"]
