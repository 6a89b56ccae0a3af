"""Splitting a batch (a dict of tensors) into microbatches along dim 0, and calling a model on one."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def split_batch(batch: Mapping[str, torch.Tensor], num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of ``batch`` into ``num_microbatches`` equal parts along dim 0.

    Raises:
        ValueError: the batch is not a dict of tensors, its tensors disagree on dim 0, or dim 0 does not divide
            by ``num_microbatches`` (the message says which sizes would).
    """
    if not isinstance(batch, Mapping) or not batch:
        raise ValueError(f"a batch is a non-empty dict of tensors (name -> tensor), not {type(batch).__name__}")
    sizes = {}
    for name, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(f"batch[{name!r}] must be a tensor with a batch dimension, not {type(value).__name__}")
        sizes[name] = value.shape[0]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the batch's tensors disagree on dim 0: {sizes}; every tensor needs the same batch size")
    rows = next(iter(sizes.values()))
    if rows % num_microbatches:
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        raise ValueError(
            f"batch size {rows} does not divide into num_microbatches={num_microbatches}; use a batch size that is a "
            f"multiple of it, or num_microbatches in {divisors}"
        )
    parts = {name: value.chunk(num_microbatches) for name, value in batch.items()}
    return [{name: parts[name][i] for name in batch} for i in range(num_microbatches)]


def loss_of(output, batch: Mapping[str, torch.Tensor], criterion: Callable | None) -> torch.Tensor:
    """The scalar loss of one microbatch: ``criterion(output, batch)`` when given, else the model's own loss
    (a scalar tensor, an object with ``.loss``, or a dict with ``"loss"``)."""
    if criterion is not None:
        loss = criterion(output, batch)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise ValueError(
            f"the model returned a {type(output).__name__} without a loss; pass criterion=(output, batch) -> loss to "
            "boost(), or have the model return its loss (give it labels)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"the loss must be a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
    return loss.reshape(())
