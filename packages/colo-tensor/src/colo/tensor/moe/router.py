"""`TopKRouter`: token-choice top-k routing with fp32 scores and an optional aux-loss-free expert bias.

For tokens ``x`` (``(tokens, hidden)``) the router computes logits ``x W^T`` (``W``: ``(num_experts, hidden)``, the
``gate`` of Hugging Face's Mixtral), in fp32 (float64 inputs stay float64); scores ``softmax(logits)`` or
``sigmoid(logits)``; picks the top ``k`` of ``scores + bias`` per token (the bias, DeepSeek-V3's aux-loss-free
balancing, only steers the choice) and weights each chosen expert by its score, renormalized over the k when
``normalize_top_k``, then by ``routed_scaling_factor``. Ties go to the lower expert index (``torch.topk``).

Group-limited routing (``num_groups > 1`` with ``top_k_groups < num_groups``; DeepSeek-V3, as transformers'
``DeepseekV3TopkRouter`` computes it): the choice scores ``scores + bias`` are viewed as ``num_groups`` contiguous
groups, each group is ranked by the sum of its two best choice scores (its best one when a group holds a single
expert), and the experts outside the ``top_k_groups`` best groups are excluded from the top-k choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from colo.comm import Group, all_reduce

from .config import MoEConfig


@dataclass
class Routing:
    """What `TopKRouter.forward` returns, for ``T`` tokens.

    Attributes:
        logits: ``(T, num_experts)`` fp32 router logits (float64 for float64 inputs, as are the others).
        scores: ``(T, num_experts)`` fp32 softmax / sigmoid of the logits (the probabilities of the aux loss).
        top_k_weights: ``(T, k)`` fp32 weights of the chosen experts.
        top_k_index: ``(T, k)`` int64 chosen experts.
    """

    logits: torch.Tensor
    scores: torch.Tensor
    top_k_weights: torch.Tensor
    top_k_index: torch.Tensor


def recomputing() -> bool:
    """Whether this forward is an activation-checkpointing recomputation: it runs inside a backward pass (the
    autograd engine is executing a graph task), as `torch.utils.checkpoint` (reentrant or not, so Hugging Face's
    gradient checkpointing too) recomputes a block. A router counts its assignments and a block records its losses
    and statistics only in the original forward, so a recomputation neither counts them twice (which would skew the
    aux-loss-free bias update) nor replaces them."""
    return torch._C._current_graph_task_id() != -1  # no public API yet; torch.utils.checkpoint itself reads it


def _outside_top_groups_excluded(choice: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """``choice`` (``(T, E)``) with ``-inf`` for the experts outside each token's ``top_k_groups`` best groups, a
    group ranked by the sum of its (up to) two best choice scores (module docstring)."""
    tokens = choice.shape[0]
    grouped = choice.view(tokens, config.num_groups, config.experts_per_group)
    group_scores = grouped.topk(min(2, config.experts_per_group), dim=-1).values.sum(dim=-1)
    best_groups = torch.topk(group_scores, config.groups_per_token, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, -1)


class TopKRouter(nn.Module):
    """The gate of a mixture-of-experts block (see the module docstring).

    Args:
        hidden_size (int): width of the tokens.
        config (MoEConfig): number of experts, k, score function, expert bias.

    Buffers:
        expert_bias: ``(num_experts,)`` fp32, zero; with ``config.expert_bias``, updated by `update_expert_bias`.
        tokens_per_expert: ``(num_experts,)`` fp32 assignments counted by training forwards since the last update.
    """

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32), persistent=False
        )

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` (``(tokens, hidden)``); see the module docstring."""
        config = self.config
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32 (float64 stays float64)
        logits = nn.functional.linear(x.to(dtype), self.weight.to(dtype))
        scores = torch.softmax(logits, dim=-1) if config.score_func == "softmax" else torch.sigmoid(logits)
        limited = config.groups_per_token < config.num_groups
        if config.expert_bias or limited:
            choice = scores.detach() + self.expert_bias if config.expert_bias else scores.detach()
            if limited:
                choice = _outside_top_groups_excluded(choice, config)
            _, top_k_index = torch.topk(choice, config.top_k, dim=-1)
            top_k_weights = scores.gather(1, top_k_index)
        else:
            top_k_weights, top_k_index = torch.topk(scores, config.top_k, dim=-1)
        if config.normalize_top_k:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        if config.routed_scaling_factor != 1.0:
            top_k_weights = top_k_weights * config.routed_scaling_factor
        if self.training and not recomputing():
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(top_k_index.flatten(), minlength=config.num_experts)
        return Routing(logits, scores, top_k_weights, top_k_index)

    @torch.no_grad()
    def update_expert_bias(self, group: Group | None = None) -> torch.Tensor:
        """Aux-loss-free balancing (Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
        2024): ``bias_e += rate * sign(mean_e' count_e' - count_e)`` from the assignments counted since the last
        update, summed over ``group`` (every data rank: ``mesh.group("dp", "ep")``, so all ranks keep one bias).
        Outside autograd; call it after the optimizer step. Resets the counts.

        Returns:
            The global counts the update used.
        """
        counts = self.tokens_per_expert.clone()
        if group is not None and group.size > 1:
            counts = all_reduce(counts, group=group)
        if self.config.expert_bias:
            self.expert_bias += self.config.expert_bias_update_rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()
        return counts
