"""The registry entry of ``data.task: diffusion`` (registered by `colo.apps.recipes`): its section and rules; the
task class (`colo.apps.diffusion.task.DiffusionTask`) is imported only when a run builds it."""

from __future__ import annotations

from ..train.task import TaskSpec
from .config import DiffusionSection


def _diffusion_task():
    from .task import DiffusionTask

    return DiffusionTask


DIFFUSION_TASK = TaskSpec(
    name="diffusion",
    summary="a text-to-image UNet on captioned images (the diffusion section, colo.apps.diffusion)",
    load=_diffusion_task,
    section="diffusion",
    section_type=DiffusionSection,
    trains_llama=False,
    reads_data_files=False,
)
"""The diffusion task's registry entry."""
