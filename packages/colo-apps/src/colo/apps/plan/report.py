"""The planner's output: a ranked table of layouts with their memory and time breakdowns, and the best layout as a
run config that `colo train` accepts (validated by the trainer's own config loader)."""

from __future__ import annotations

import copy
import dataclasses

from .search import PlanResult, Workload

GiB = 1 << 30

MODEL_PRESETS = {
    "llama-1b": "1b",
    "llama-7b": "7b",
    "llama-70b": "70b",
    "tiny": "tiny",
    "tiny-llama": "tiny-llama",
    "bench-25m": "bench-25m",
    "1b": "1b",
    "7b": "7b",
    "70b": "70b",
}
"""Planner model names -> `colo.apps.models.llama` presets (the ``llama-*`` names are the trainer's run presets)."""

MOE_MODEL_PRESETS = {
    "tiny-moe": "tiny-moe",
    "tiny-mixtral": "tiny-mixtral",
    "mixtral-8x7b": "mixtral-8x7b",
    "mixtral-8x22b": "mixtral-8x22b",
    "tiny-deepseek": "tiny-deepseek",
    "deepseek-v3": "deepseek-v3",
}
"""Planner model names -> `colo.apps.models.moe_llama.MOE_PRESETS` (mixture of experts, planned under the ``expert``
plugin or ``hybrid`` with ``ep``; ``tiny-moe`` is also the trainer's MoE run preset, whose optimizer and data
settings a written config keeps)."""


def model_preset(name: str):
    """The model config of planner preset ``name`` (`MODEL_PRESETS` or `MOE_MODEL_PRESETS`)."""
    from ..models.llama import get_preset
    from ..models.moe_llama import get_moe_preset

    if name in MOE_MODEL_PRESETS:
        return get_moe_preset(MOE_MODEL_PRESETS[name])
    if name in MODEL_PRESETS:
        return get_preset(MODEL_PRESETS[name])
    raise ValueError(
        f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)} or a mixture of experts: "
        f"{sorted(MOE_MODEL_PRESETS)} (or --hf-config)"
    )


def table_rows(results: list[PlanResult], peak: float) -> list[dict]:
    """One dict per result: layout, per-device memory terms (GiB), step time terms (s), tokens/s/device, MFU."""
    rows = []
    for rank, result in enumerate(results, start=1):
        memory, time = result.memory, result.time
        terms = memory.terms()
        rows.append(
            {
                "rank": rank,
                "layout": result.layout.describe(),
                "memory_gib": memory.device_total / GiB,
                "states_gib": (terms["params"] + terms["grads"] + terms["masters"] + terms["optimizer"] - terms["host"])
                / GiB,
                "buffers_gib": (terms["pooled buffers"] + terms["step gradients"]) / GiB,
                "activations_gib": terms["activations"] / GiB,
                "step_s": time.total,
                "compute_s": time.compute,
                "mp_comm_s": time.model_parallel_comm,
                "bubble_s": time.pipeline_bubble,
                "dp_exposed_s": time.data_parallel_exposed,
                "optimizer_s": time.optimizer,
                "tokens_per_s_per_device": time.tokens_per_second_per_device,
                "mfu": time.mfu(peak),
            }
        )
    return rows


def print_table(results: list[PlanResult], peak: float, *, title: str) -> None:
    """Print the ranked table with rich."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = [
        ("#", "rank", "{}"),
        ("layout", "layout", "{}"),
        ("mem GiB", "memory_gib", "{:.1f}"),
        ("states", "states_gib", "{:.1f}"),
        ("buffers", "buffers_gib", "{:.1f}"),
        ("activ.", "activations_gib", "{:.1f}"),
        ("step s", "step_s", "{:.3f}"),
        ("compute", "compute_s", "{:.3f}"),
        ("tp/sp", "mp_comm_s", "{:.3f}"),
        ("bubble", "bubble_s", "{:.3f}"),
        ("dp exp.", "dp_exposed_s", "{:.3f}"),
        ("optim", "optimizer_s", "{:.3f}"),
        ("tok/s/dev", "tokens_per_s_per_device", "{:,.0f}"),
        ("MFU", "mfu", "{:.1%}"),
    ]
    for header, _, _ in columns:
        table.add_column(header, justify="left" if header == "layout" else "right")
    for row in table_rows(results, peak):
        table.add_row(*[fmt.format(row[key]) for _, key, fmt in columns])
    import sys

    Console(width=None if sys.stdout.isatty() else 200).print(table)


def run_config(result: PlanResult, workload: Workload, *, base_preset: str | None = None) -> dict:
    """The run config (a `colo train` YAML mapping) of ``result``'s layout for ``workload``.

    Starts from the trainer's run preset ``base_preset`` when given (optimizer, schedule and checkpoint settings),
    and sets the model, the plugin section, ``schedule.num_microbatches`` and the data shape. Validated with the
    trainer's loader (`colo.apps.train.loading.validate_config`); a `ConfigError` means the planner proposed
    something the trainer rejects.
    """
    from ..plan.memory import is_moe
    from ..train.presets import RUN_PRESETS

    layout = result.layout
    data = copy.deepcopy(RUN_PRESETS[base_preset]) if base_preset in RUN_PRESETS else {"name": "planned"}
    if base_preset in RUN_PRESETS:
        data["name"] = f"{data['name']}-planned"
    name = workload.model_name
    presets = MOE_MODEL_PRESETS if is_moe(workload.config) else MODEL_PRESETS
    if name in presets and model_preset(name) == workload.config:
        data["model"] = {"preset": presets[name]}
    else:  # a shape of its own (a Hugging Face config): every field as an override of a preset
        base = "tiny-moe" if is_moe(workload.config) else "tiny"
        data["model"] = {"preset": base, **dataclasses.asdict(workload.config)}
    plugin = layout.plugin_fields()
    plugin.setdefault("max_grad_norm", 1.0)
    data["plugin"] = plugin
    schedule = dict(data.get("schedule", {}))
    schedule["num_microbatches"] = layout.num_microbatches
    data["schedule"] = schedule
    section = dict(data.get("data", {}))
    section.update(seq_len=workload.seq_len, global_batch_size=workload.global_batch_size)
    data["data"] = section
    if "eval" in data:  # the eval batch splits into the same microbatches
        evaluation = dict(data["eval"])
        evaluation["batch_size"] = layout.num_microbatches * max(1, 32 // layout.num_microbatches)
        data["eval"] = evaluation
    return data


def validate_run_config(data: dict):
    """The trainer's `RunConfig` for ``data`` (raises `colo.apps.train.ConfigError` naming the field)."""
    from ..train.loading import validate_config

    return validate_config(data)
