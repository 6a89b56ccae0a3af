"""The run's optimizer and learning-rate schedule: AdamW with weight-decay and layer-wise LR groups, and linear
warmup followed by cosine decay (Loshchilov & Hutter, 2017) to a floor."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch import nn

from .config import OptimizerSection, ScheduleSection

_LAYER = re.compile(r"^layers\.(\d+)\.")


def layer_id(name: str, num_layers: int) -> int:
    """The depth of parameter ``name`` for layer-wise LR decay: 0 for the embedding, ``i + 1`` for ``layers.i``,
    ``num_layers + 1`` for what follows the last layer (final norm, ``lm_head``)."""
    match = _LAYER.match(name)
    if match:
        return int(match.group(1)) + 1
    return 0 if name.startswith("embed_tokens") else num_layers + 1


def param_groups(
    model: nn.Module,
    settings: OptimizerSection,
    *,
    num_layers: int,
    depth: Callable[[str], int] | None = None,
) -> list[dict]:
    """AdamW parameter groups of ``model``: weight decay or not (1-D parameters: norms and biases) x LR scale.

    Each group carries ``lr = settings.lr * scale`` (the LR schedule multiplies it) and a ``"name"`` for logs.
    Tied parameters appear once.

    Args:
        model: the model, before boosting.
        settings: the ``optimizer`` section.
        num_layers: the model's layers for layer-wise LR decay (a depth runs from 0, the input side, to
            ``num_layers + 1``, the output side, which gets the full LR).
        depth: a parameter name's depth in ``0 .. num_layers + 1``; ``None``: `layer_id` (a Llama's names).
    """
    depth_of = depth if depth is not None else lambda name: layer_id(name, num_layers)
    groups: dict[tuple[bool, int], dict] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        decay = not (settings.no_decay_norms_and_biases and param.dim() < 2)
        level = depth_of(name) if settings.layerwise_lr_decay != 1.0 else num_layers + 1
        key = (decay, level)
        if key not in groups:
            scale = settings.layerwise_lr_decay ** (num_layers + 1 - level)
            groups[key] = {
                "params": [],
                "weight_decay": settings.weight_decay if decay else 0.0,
                "lr": settings.lr * scale,
                "name": f"{'decay' if decay else 'no_decay'}/depth{level}",
            }
        groups[key]["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def build_optimizer(
    model: nn.Module,
    settings: OptimizerSection,
    *,
    num_layers: int,
    depth: Callable[[str], int] | None = None,
    device: torch.device | str | None = None,
) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters with `param_groups`.

    ``settings.fused`` None means torch's fused kernel when the run computes on CUDA (one kernel per parameter
    group; torch's default there, ``foreach``, runs several passes over the states: on one H200 it took 37 ms of a
    234 ms ZeRO-2 Llama-1b step) and torch's default elsewhere.

    Args:
        model: the model, before boosting.
        settings: the ``optimizer`` section.
        num_layers: the model's layers (for layer-wise LR decay): a Llama's decoder layers.
        depth: a parameter name's depth for layer-wise LR decay (`param_groups`); ``None``: a Llama's (`layer_id`).
        device: where the run computes (`TaskContext.device`); ``None``: unknown (torch's default kernel).
    """
    kwargs = {"betas": tuple(settings.betas), "eps": settings.eps}
    if settings.fused is not None:
        kwargs["fused"] = settings.fused
    elif device is not None and torch.device(device).type == "cuda":
        kwargs["fused"] = True
    groups = param_groups(model, settings, num_layers=num_layers, depth=depth)
    return torch.optim.AdamW(groups, lr=settings.lr, **kwargs)


class WarmupCosine:
    """LR multiplier of step ``t``: ``t / warmup`` during warmup, then a cosine from 1 down to ``min_ratio`` at
    ``total_steps``, flat after it.

    A callable object of plain numbers, so `torch.optim.lr_scheduler.LambdaLR` puts it in its JSON-able
    ``state_dict`` (colo checkpoints hold no pickle).
    """

    def __init__(self, *, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: ScheduleSection, *, peak_lr: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine to ``schedule.min_lr`` (as a fraction of ``peak_lr``, so layer-wise scales are kept)."""
    multiplier = WarmupCosine(
        warmup_steps=schedule.warmup_steps, total_steps=schedule.total_steps, min_ratio=schedule.min_lr / peak_lr
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
