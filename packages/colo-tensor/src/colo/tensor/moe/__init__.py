"""colo.tensor.moe: mixture of experts with expert parallelism.

A token-choice top-k router with fp32 scores and an optional aux-loss-free expert bias (`TopKRouter`), the
load-balancing and z-losses (`load_balancing_loss`, `z_loss`), dropless or capacity routing with a deterministic
drop rule and the permutation by expert (`permute`, `unpermute`, `capacity_mask`), SwiGLU experts as grouped
matrix products with a loop reference (`GroupedExperts`), DeepSeek's always-on shared experts (`SharedExperts`), the
block putting them together (`MoEBlock`, Mixtral- or DeepSeek-V3-shaped by its `MoEConfig`), and expert
parallelism over an ``ep`` mesh axis: all-to-all dispatch and combine with the split sizes exchanged first
(`expert_parallel`), `shard_experts`, and the gradient groups (`dense_data_axes`, `expert_data_axes`).

Example::

    block = MoEBlock(64, 128, MoEConfig(num_experts=8, top_k=2))
    shard_experts(model_with_blocks, mesh=Mesh(dp=2, ep=2))
"""

from .config import MoEConfig
from .dispatch import AllToAllRows, dispatch_bytes, exchange_counts, expert_parallel
from .experts import GroupedExperts, SharedExperts
from .layer import MoEBlock, moe_aux_loss, moe_blocks, router_stats, update_expert_biases
from .losses import AuxLossScaler, attach_aux_loss, load_balancing_loss, z_loss
from .parallel import (
    check_expert_parallel,
    dense_data_axes,
    expert_data_axes,
    is_expert_param,
    route_sequence_pieces,
    shard_experts,
    split_expert_ffns,
)
from .permute import Permutation, capacity_mask, expert_capacity, permute, unpermute
from .router import Routing, TopKRouter, recomputing

__all__ = [
    "AllToAllRows",
    "AuxLossScaler",
    "GroupedExperts",
    "MoEBlock",
    "MoEConfig",
    "Permutation",
    "Routing",
    "SharedExperts",
    "TopKRouter",
    "attach_aux_loss",
    "capacity_mask",
    "check_expert_parallel",
    "dense_data_axes",
    "dispatch_bytes",
    "exchange_counts",
    "expert_capacity",
    "expert_data_axes",
    "expert_parallel",
    "is_expert_param",
    "load_balancing_loss",
    "moe_aux_loss",
    "moe_blocks",
    "permute",
    "recomputing",
    "router_stats",
    "route_sequence_pieces",
    "shard_experts",
    "split_expert_ffns",
    "unpermute",
    "update_expert_biases",
    "z_loss",
]
