"""Gradient clipping by the global norm of gradients sharded over a data-parallel group."""

from __future__ import annotations

import math

import torch

from colo.comm import Group, all_reduce


def global_grad_norm(grad_shards: list[torch.Tensor], *, group: Group | None, norm_type: float = 2.0) -> float:
    """The norm of the full gradient, from each rank's disjoint flat shards.

    Shards of one chunk are disjoint and padding is zero, so summing ``|g|^p`` over shards and ranks counts
    every element once (a tied parameter lives in one chunk, so it is counted once, as
    ``torch.nn.utils.clip_grad_norm_`` counts it).

    Args:
        grad_shards: this rank's fp32 gradient shards.
        group: the group the shards are spread over; ``None``: they are all here (no communication).
        norm_type: p of the p-norm, or ``math.inf``.
    """
    device = grad_shards[0].device if grad_shards else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.zeros(1, device=device, dtype=torch.float32)
        for shard in grad_shards:
            if shard.numel():
                local = torch.maximum(local, shard.abs().max().reshape(1).float().to(device))
        if group is not None:
            all_reduce(local, op="max", group=group)
        return float(local.item())
    local = torch.zeros(1, device=device, dtype=torch.float64)
    if grad_shards:
        # one fused norm kernel per shard in the shard's own precision (no full-size float64 temporaries), the
        # per-shard norms raised to p and summed in float64
        # (shards may live on different tiers: the norms are brought to the first one's device)
        norms = torch.stack([torch.linalg.vector_norm(shard, ord=norm_type).to(device) for shard in grad_shards])
        local += norms.double().pow(norm_type).sum()
    if group is not None:
        all_reduce(local, op="sum", group=group)
    return float(local.item() ** (1.0 / norm_type))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` scales gradients by: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (total_norm + 1e-6))
