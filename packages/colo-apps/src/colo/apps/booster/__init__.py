"""The Booster and its plugins: one object that applies a parallelism plan and runs whole training steps."""

from .booster import Booster
from .microbatch import split_batch
from .parallel_dims import LayoutError, ParallelDims, UnsupportedLayout
from .plans import BUILTIN_PLANS, ModelPlan, PipelinePart, plan_for, register_plan
from .plugins.base import Engine, Plugin, StepResult
from .plugins.ddp import DDP
from .plugins.expert import ExpertParallel
from .plugins.gemini import Gemini
from .plugins.hybrid import HybridParallel
from .plugins.runner import PipelineCriterion
from .plugins.zero import Zero

__all__ = [
    "BUILTIN_PLANS",
    "DDP",
    "Booster",
    "Engine",
    "ExpertParallel",
    "Gemini",
    "HybridParallel",
    "LayoutError",
    "ModelPlan",
    "ParallelDims",
    "PipelineCriterion",
    "PipelinePart",
    "Plugin",
    "StepResult",
    "UnsupportedLayout",
    "Zero",
    "plan_for",
    "register_plan",
    "split_batch",
]
