"""The registry of the built-in training tasks: importing this module registers them
(`colo.apps.train.task.register_task`); `colo.apps.train.task.task_specs` imports it on its first lookup.

Adding a recipe: write its `TrainTask` subclass and its `TaskSpec` (section, rules, loader) next to the recipe's
code, and add the spec here (or call `register_task` from your own package before the first run config is
validated). See the colo-apps README, "Adding a recipe".
"""

from __future__ import annotations

from .diffusion.spec import DIFFUSION_TASK
from .rlhf.specs import RLHF_TASKS
from .train.language_model import LANGUAGE_MODEL_TASKS
from .train.task import register_task

for _spec in (*LANGUAGE_MODEL_TASKS, *RLHF_TASKS, DIFFUSION_TASK):
    register_task(_spec)
