"""`MoELlamaConfig`: a Llama whose MLPs are mixtures of experts on every k-th layer (Mixtral's shape at k = 1).

Field names follow Hugging Face's ``MixtralConfig`` where the meaning is the same (``num_local_experts``,
``num_experts_per_tok``, ``router_aux_loss_coef``), so Mixtral configs map field by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from colo.tensor.moe import MoEConfig

from ..llama.config import LlamaConfig


@dataclass(frozen=True, kw_only=True)
class MoELlamaConfig(LlamaConfig):
    """`LlamaConfig` plus the mixture of experts (see `colo.tensor.moe.MoEConfig` for the routing settings)."""

    num_local_experts: int = 8
    """Experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Experts each token goes to (top-k)."""
    moe_layer_interval: int = 1
    """Layer ``i`` has an MoE MLP when ``i % moe_layer_interval == 0`` (1: every layer, as Mixtral; 2: layers 0, 2,
    4, ...); the others keep Llama's dense SwiGLU MLP of ``intermediate_size``."""
    router_aux_loss_coef: float = 0.02
    """Weight of the load-balancing loss added to the training loss (Mixtral's 0.02)."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss added to the training loss."""
    aux_loss_type: str = "batch"
    """``"batch"`` (per microbatch and rank, as Hugging Face) or ``"sequence"`` (split-invariant; see
    `colo.tensor.moe.losses`)."""
    capacity_factor: float | None = None
    """``None``: dropless; else the expert capacity factor (`colo.tensor.moe.permute`)."""
    score_func: str = "softmax"
    """Router scores: ``"softmax"`` (Mixtral) or ``"sigmoid"``."""
    expert_bias: bool = False
    """Aux-loss-free balancing bias (DeepSeek-V3), updated after each optimizer step."""
    expert_impl: str = "grouped"
    """``"grouped"`` experts (grouped matmuls) or the ``"loop"`` reference."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive_int("moe_layer_interval", self.moe_layer_interval)
        self.moe_config()  # MoEConfig's checks: top-k <= experts, capacity factor > 0, ...

    def moe_config(self) -> MoEConfig:
        """The `MoEConfig` of every MoE layer."""
        return MoEConfig(
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            score_func=self.score_func,
            capacity_factor=self.capacity_factor,
            aux_loss_type=self.aux_loss_type,
            aux_loss_coef=self.router_aux_loss_coef,
            z_loss_coef=self.router_z_loss_coef,
            expert_bias=self.expert_bias,
            expert_impl=self.expert_impl,
        )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has an MoE MLP."""
        return index % self.moe_layer_interval == 0

    def num_parameters(self, *, embeddings: bool = True) -> int:
        """Parameters of `MoELlama` with this config (every expert counted; a tied matrix once)."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        moe_mlp = self.num_local_experts * dense_mlp + self.num_local_experts * self.hidden_size  # experts + router
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        return super().num_parameters(embeddings=embeddings) + moe_layers * (moe_mlp - dense_mlp)

    def num_active_parameters(self) -> int:
        """Parameters one token uses: ``num_experts_per_tok`` experts per MoE layer, the router, all the rest."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        idle = (self.num_local_experts - self.num_experts_per_tok) * dense_mlp
        return self.num_parameters() - moe_layers * idle


MOE_PRESETS: dict[str, MoELlamaConfig] = {
    # CPU tests: the tiny Llama with 4 experts, top-2, on every layer
    "tiny-moe": MoELlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # CPU demo: 8 experts top-2 on every other layer of a 4-layer model
    "tiny-mixtral": MoELlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        num_local_experts=8,
        num_experts_per_tok=2,
        moe_layer_interval=2,
    ),
    # Mixtral-8x7B (Jiang et al., 2024): 46.7B parameters, 12.9B active
    "mixtral-8x7b": MoELlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # Mixtral-8x22B: 141B parameters, 39B active
    "mixtral-8x22b": MoELlamaConfig(
        vocab_size=32768,
        hidden_size=6144,
        intermediate_size=16384,
        num_hidden_layers=56,
        num_attention_heads=48,
        num_key_value_heads=8,
        max_position_embeddings=65536,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}
"""Named MoE shapes: ``tiny-moe`` (CPU tests), ``tiny-mixtral`` (CPU demo), ``mixtral-8x7b``, ``mixtral-8x22b``."""


def get_moe_preset(name: str, **overrides) -> MoELlamaConfig:
    """The MoE preset ``name`` with some fields changed (validated like any config)."""
    if name not in MOE_PRESETS:
        raise ValueError(f"unknown MoE Llama preset {name!r}; choose one of {sorted(MOE_PRESETS)}")
    unknown = sorted(set(overrides) - {field.name for field in dataclasses.fields(MoELlamaConfig)})
    if unknown:
        raise ValueError(f"get_moe_preset({name!r}): {unknown} are not MoELlamaConfig fields")
    return dataclasses.replace(MOE_PRESETS[name], **overrides)
