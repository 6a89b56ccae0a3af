"""`TopKRouter`: token-choice top-k routing with fp32 scores and an optional aux-loss-free expert bias.

For tokens ``x`` (``(tokens, hidden)``) the router computes logits ``x W^T`` (``W``: ``(num_experts, hidden)``, the
``gate`` of Hugging Face's Mixtral), in fp32 (float64 inputs stay float64); scores ``softmax(logits)`` or
``sigmoid(logits)``; picks the top ``k`` of ``scores + bias`` per token (the bias, DeepSeek-V3's aux-loss-free
balancing, only steers the choice) and weights each chosen expert by its score, renormalized over the k when
``normalize_top_k``. Ties go to the lower expert index (``torch.topk``).
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
        if config.expert_bias:
            _, top_k_index = torch.topk(scores.detach() + self.expert_bias, config.top_k, dim=-1)
            top_k_weights = scores.gather(1, top_k_index)
        else:
            top_k_weights, top_k_index = torch.topk(scores, config.top_k, dim=-1)
        if config.normalize_top_k:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        if self.training:
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
