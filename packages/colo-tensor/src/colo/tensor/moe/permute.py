"""Permutation of routed tokens by expert, the capacity rule, and the weighted combine back.

A forward routes ``T`` tokens to ``k`` experts each: ``T * k`` *assignments*, numbered token-major
(``a = t * k + j``: token ``t``'s ``j``-th choice). `permute` orders the kept assignments by expert, stably (within
an expert in assignment order), and copies each one's token there; `unpermute` multiplies each expert output by its
routing weight and adds it to its token's row: every kept assignment is combined back exactly once, and a token whose
assignments were all dropped gets zeros (the residual connection around the block carries it).

**Capacity rule** (`capacity_mask`, with ``capacity_factor``): each expert takes at most
``C = ceil(capacity_factor * T * k / E)`` assignments. Priority goes by choice rank first, then token position: all
first choices in token order, then all second choices in token order, and so on (Switch / GShard's order, so a
token's top choice is dropped only when its expert is full of other tokens' top choices). An expert keeps its first
``C`` assignments in that order and drops the rest. Deterministic: it depends only on the routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def expert_capacity(num_tokens: int, *, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * num_tokens * top_k / num_experts)``: assignments one expert takes at most."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_mask(top_k_index: torch.Tensor, *, num_experts: int, capacity: int) -> torch.Tensor:
    """``(T, k)`` bool: which assignments the capacity rule (module docstring) keeps."""
    num_tokens, top_k = top_k_index.shape
    by_priority = top_k_index.t().reshape(-1)  # choice-major: all first choices, then all second choices, ...
    one_hot = torch.nn.functional.one_hot(by_priority, num_experts)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # position of each in its expert's queue
    return (position < capacity).view(top_k, num_tokens).t()


@dataclass
class Permutation:
    """How `permute` ordered the assignments, for `unpermute`.

    Attributes:
        token_index: ``(N,)`` the token of each permuted row (``N`` kept assignments, grouped by expert).
        assignment_index: ``(N,)`` each row's assignment number ``t * k + j``.
        counts: ``(E,)`` int64 rows per expert.
        num_tokens: ``T``.
    """

    token_index: torch.Tensor
    assignment_index: torch.Tensor
    counts: torch.Tensor
    num_tokens: int


def permute(
    x: torch.Tensor, top_k_index: torch.Tensor, *, num_experts: int, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, Permutation]:
    """Rows of ``x`` (``(T, hidden)``), one per kept assignment, grouped by expert (see the module docstring).

    Args:
        x (torch.Tensor): ``(T, hidden)`` tokens.
        top_k_index (torch.Tensor): ``(T, k)`` chosen experts.
        num_experts (int): ``E``.
        keep (torch.Tensor | None): ``(T, k)`` bool from `capacity_mask`; ``None`` keeps every assignment.

    Returns:
        ``(rows, permutation)``: ``(N, hidden)`` rows and what `unpermute` needs.
    """
    top_k = top_k_index.shape[1]
    experts = top_k_index.reshape(-1)
    assignments = torch.arange(experts.numel(), device=experts.device)
    if keep is not None:
        kept = keep.reshape(-1)
        experts, assignments = experts[kept], assignments[kept]
    order = torch.argsort(experts, stable=True)
    assignments = assignments[order]
    token_index = torch.div(assignments, top_k, rounding_mode="floor")
    counts = torch.bincount(experts, minlength=num_experts)
    return x[token_index], Permutation(token_index, assignments, counts, x.shape[0])


def unpermute(rows: torch.Tensor, permutation: Permutation, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Combine expert outputs back into ``(T, hidden)`` token rows: row ``i`` times its routing weight is added to
    its token (``index_add``); the weights' dtype (fp32) is kept through the product, then cast to ``rows``'."""
    weights = top_k_weights.reshape(-1)[permutation.assignment_index]
    weighted = (rows * weights[:, None]).to(rows.dtype)
    out = rows.new_zeros(permutation.num_tokens, rows.shape[-1])
    return out.index_add(0, permutation.token_index, weighted)
