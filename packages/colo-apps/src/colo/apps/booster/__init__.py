"""The Booster and its plugins: one object that applies a parallelism plan and runs whole training steps."""

from ..hf.plans import register_hf_plans  # the HF plans, by class name
from . import llama_plan, moe_plan  # noqa: F401  (register the native Llama's plan, and MoELlama's: tp / sp / pp refused)
from .booster import Booster
from .microbatch import split_batch
from .plans import ModelPlan, PipelinePart, plan_for, register_plan
from .plugins.base import Engine, Plugin, StepResult
from .plugins.ddp import DDP
from .plugins.expert import ExpertParallel
from .plugins.gemini import Gemini
from .plugins.hybrid import HybridParallel
from .plugins.zero import Zero

register_hf_plans()  # by class name: transformers is not imported

__all__ = [
    "DDP",
    "Booster",
    "Engine",
    "ExpertParallel",
    "Gemini",
    "HybridParallel",
    "ModelPlan",
    "PipelinePart",
    "Plugin",
    "StepResult",
    "Zero",
    "plan_for",
    "register_plan",
    "split_batch",
]
