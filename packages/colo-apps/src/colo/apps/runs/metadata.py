"""What the trainer records about a run in its checkpoints (``index.json`` metadata under `RUN_KEY`), and what a
reader derives from it: the model config, the LoRA scaling, the chat template."""

from __future__ import annotations

from colo.tensor.checkpoint import CheckpointIndex

from ..lora import lora_scaling
from ..models.llama import LlamaConfig

RUN_KEY = "run"
"""The checkpoint-metadata key under which the trainer saves the run (its config, the Llama config, the step)."""


def run_of(index: CheckpointIndex, *, source: str) -> dict:
    """The run metadata of a checkpoint written by colo's trainer: ``run["config"]`` (the `RunConfig` as a dict),
    ``run["llama_config"]`` (the model's shape), ``run["tokenizer"]``, the step and what the run's task adds.

    Args:
        index: the checkpoint's index (`colo.tensor.checkpoint.read_index`).
        source: what named the checkpoint, for the error (its path, or the setting that gave it).

    Raises:
        ValueError: the checkpoint holds no run metadata with a model shape (another writer saved it).
    """
    run = index.metadata.get(RUN_KEY)
    if isinstance(run, dict) and "llama_config" not in run:
        task = ((run.get("config") or {}).get("data") or {}).get("task")
        raise ValueError(
            f"{source} is a checkpoint of a data.task={task!r} run, which holds no Llama (a diffusion run exports "
            "with colo convert --to diffusers)"
        )
    if not isinstance(run, dict):
        raise ValueError(
            f"{source} has no '{RUN_KEY}' metadata: it was not written by colo's trainer, so the model shape is unknown"
        )
    return run


def lora_scaling_of(run: dict) -> float:
    """The LoRA scaling (``alpha / r``) of a trainer run's metadata; a `ValueError` when the run had no LoRA."""
    if not has_lora(run):
        raise ValueError("the checkpoint holds LoRA adapters but its run config has no lora section enabled")
    settings = run["config"]["lora"]
    return lora_scaling(settings["r"], settings["alpha"], use_rslora=settings.get("use_rslora", False))


def has_lora(run: dict) -> bool:
    """Whether a trainer run's metadata records ``lora.enabled``."""
    return bool(((run.get("config") or {}).get("lora") or {}).get("enabled"))


def model_config_of(run: dict) -> LlamaConfig:
    """The model config a trainer run's metadata records: a `MoELlamaConfig` for a mixture-of-experts run (its
    ``llama_config`` holds the MoE fields), else a `LlamaConfig`."""
    fields = run["llama_config"]
    if "num_local_experts" in fields:
        from ..models.moe_llama import MoELlamaConfig

        return MoELlamaConfig(**fields)
    return LlamaConfig(**fields)


def chat_template_of(run: dict):
    """The `ChatTemplate` a chat run (``data.task='sft'``) trained with, from its checkpoint metadata; ``None``
    for other runs.

    The trainer records a chat task's template as ``run["chat_template"]``; checkpoints written before it did name
    it in their config, and then only ``data.task='sft'`` read it.
    """
    from ..data import ChatTemplate

    if "chat_template" in run:
        return ChatTemplate(**run["chat_template"])
    data = (run.get("config") or {}).get("data") or {}
    if data.get("task") == "sft":  # an older checkpoint of a chat run
        return ChatTemplate(**data.get("chat_template", {}))
    return None
