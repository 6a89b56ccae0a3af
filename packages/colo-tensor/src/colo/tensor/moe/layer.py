"""`MoEBlock`: a mixture-of-experts MLP (router, permutation, experts, combine), optionally expert-parallel.

Drop-in for a transformer's MLP on ``(batch, seq, hidden)`` activations, with Mixtral's module names (``gate``,
``experts``) and DeepSeek-V3's for the optional shared experts (``shared_experts``, added to the routed output).
After each forward it holds ``aux_loss`` (the weighted load-balancing and z-losses, with their graph: the model adds
it to its loss) and ``stats`` (detached router statistics: tokens per expert, the fraction of assignments dropped,
each loss). Expert parallelism is applied from outside by `shard_experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from colo.comm import Group

from .config import MoEConfig
from .dispatch import expert_parallel
from .experts import GroupedExperts, SharedExperts
from .losses import load_balancing_loss, z_loss
from .permute import capacity_mask, expert_capacity, permute, unpermute
from .router import Routing, TopKRouter, recomputing


class MoEBlock(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts (see the module docstring and `MoEConfig`).

    Args:
        hidden_size (int): width of the tokens.
        intermediate_size (int): width of each routed expert's gate and up projections.
        config (MoEConfig): routing, losses and the shared experts.

    Example::

        block = MoEBlock(64, 128, MoEConfig(num_experts=8, top_k=2, aux_loss_coef=0.02))
        y = block(x)                         # (batch, seq, 64)
        loss = task_loss + block.aux_loss
    """

    def __init__(self, hidden_size: int, intermediate_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.gate = TopKRouter(hidden_size, config)
        self.experts = GroupedExperts(config.num_experts, hidden_size, intermediate_size, impl=config.expert_impl)
        self.shared_experts: SharedExperts | None = None
        if config.num_shared_experts:
            shared = config.shared_intermediate_size or config.num_shared_experts * intermediate_size
            self.shared_experts = SharedExperts(hidden_size, shared)
        self.ep_group: Group | None = None
        """The expert-parallel group once `shard_experts` split the experts over it."""
        self.sp_group: Group | None = None
        """The sequence-parallel group once `route_sequence_pieces` set it: the ranks holding the other pieces of
        this rank's sequences, over which the load-balancing loss counts its assignments (`load_balancing_loss`)."""
        self.last_routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert (0 without expert parallelism)."""
        return 0 if self.ep_group is None else self.ep_group.rank * self.experts.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` (``(batch, seq, hidden)``); sets ``aux_loss``, ``stats``, ``last_routing``
        (not when an activation-checkpointing recomputation runs it again: `colo.tensor.moe.router.recomputing`)."""
        batch, seq, hidden = x.shape
        config = self.config
        tokens = x.reshape(-1, hidden)
        routing = self.gate(tokens)
        keep = None
        if config.capacity_factor is not None:
            capacity = expert_capacity(
                tokens.shape[0],
                top_k=config.top_k,
                num_experts=config.num_experts,
                capacity_factor=config.capacity_factor,
            )
            keep = capacity_mask(routing.top_k_index, num_experts=config.num_experts, capacity=capacity)
        rows, permutation = permute(tokens, routing.top_k_index, num_experts=config.num_experts, keep=keep)
        if self.ep_group is None or self.ep_group.size == 1:
            out = self.experts(rows, permutation.counts)
        else:
            out = expert_parallel(rows, permutation.counts, self.experts, self.ep_group)
        y = unpermute(out, permutation, routing.top_k_weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        aux_loss, stats = self._losses(routing, batch, permutation.counts, tokens.shape[0])
        if not recomputing():  # a recomputation computes the same (checkpointing needs the same saved tensors)
            self.last_routing, self.aux_loss, self.stats = routing, aux_loss, stats
        return y.view(batch, seq, hidden)

    def _losses(
        self, routing: Routing, batch: int, counts: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted auxiliary loss and the detached statistics of one forward."""
        config = self.config
        balance = load_balancing_loss(
            routing.scores,
            routing.top_k_index,
            num_experts=config.num_experts,
            batch_size=batch if config.aux_loss_type == "sequence" else None,
            score_func=config.score_func,
            sequence_group=self.sp_group,
        )
        router_z = z_loss(routing.logits)
        aux_loss = config.aux_loss_coef * balance + config.z_loss_coef * router_z
        assignments = num_tokens * config.top_k
        stats = {
            "tokens_per_expert": counts.detach(),
            "drop_fraction": (1 - counts.sum() / max(assignments, 1)).detach().float(),
            "load_balancing_loss": balance.detach(),
            "z_loss": router_z.detach(),
        }
        return aux_loss, stats


def moe_blocks(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    """Every `MoEBlock` of ``model`` with its qualified name, in registration order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoEBlock)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the ``aux_loss`` of every `MoEBlock` of ``model`` from its last forward (``None`` without any)."""
    losses = [block.aux_loss for _, block in moe_blocks(model) if block.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def router_stats(model: nn.Module) -> dict[str, float]:
    """Router statistics of the last forward for a trainer's metrics: per block, the load-balancing loss, the
    z-loss, the drop fraction and the largest share of assignments any expert got (1 / E is perfect balance)."""
    stats: dict[str, float] = {}
    for name, block in moe_blocks(model):
        if not block.stats:
            continue
        counts = block.stats["tokens_per_expert"].float()
        stats[f"{name}.load_balancing_loss"] = float(block.stats["load_balancing_loss"])
        stats[f"{name}.z_loss"] = float(block.stats["z_loss"])
        stats[f"{name}.drop_fraction"] = float(block.stats["drop_fraction"])
        stats[f"{name}.max_expert_share"] = float(counts.max() / counts.sum().clamp(min=1))
    return stats


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: Group | None = None) -> None:
    """`TopKRouter.update_expert_bias` of every MoE block, counts summed over ``group`` (every data rank:
    ``mesh.group("dp", "ep")``); call it after each optimizer step when ``MoEConfig.expert_bias`` is on."""
    for _, block in moe_blocks(model):
        block.gate.update_expert_bias(group)
