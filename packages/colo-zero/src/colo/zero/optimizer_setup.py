"""Checks shared by the sharded optimizers (`ZeroOptimizer`, colo.gemini's `GeminiOptimizer`) on the torch
optimizer they are built around."""

from __future__ import annotations

from collections.abc import Callable

import torch

OptimizerLike = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None


def resolve_optimizer(
    optimizer: OptimizerLike,
    params: list[torch.nn.Parameter],
    *,
    default: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    owner: str,
) -> torch.optim.Optimizer:
    """The torch optimizer to shard: ``optimizer`` itself, built by it (a callable), or ``default`` for ``None``.

    Raises:
        TypeError: ``optimizer`` is none of those.
        ValueError: it has already stepped (its state would not be sharded).
    """
    if optimizer is None:
        optimizer = default
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch optimizer, a callable or None, not {type(optimizer)}")
        optimizer = optimizer([p for p in params if p.requires_grad])
    if len(optimizer.state):
        raise ValueError(
            f"the optimizer already holds state for {len(optimizer.state)} parameters (it has stepped); build "
            f"{owner} around a fresh optimizer, before the first step"
        )
    return optimizer


def param_group_index(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], *, owner: str
) -> dict[int, int]:
    """``id(parameter) -> index of its param group``, after checking that the optimizer holds only the model's
    parameters, every trainable one, and that they are floating point."""
    group_of: dict[int, int] = {}
    model_ids = {id(p) for p in params.values()}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in model_ids:
                raise ValueError(
                    "the optimizer holds a tensor that is not a parameter of the model; build it from "
                    "model.parameters()"
                )
            group_of[id(p)] = index
    for name, p in params.items():
        if p.requires_grad and id(p) not in group_of:
            raise ValueError(
                f"trainable parameter {name!r} is in no optimizer param group; add it to one or set requires_grad=False"
            )
        if not p.is_floating_point():
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; {owner} handles floating-point parameters only")
    return group_of
