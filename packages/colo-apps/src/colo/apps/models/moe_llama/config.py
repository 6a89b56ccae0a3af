"""`MoELlamaConfig`: a Llama whose MLPs are mixtures of experts on every k-th layer (Mixtral's shape at k = 1), or
DeepSeek-V3-style blocks (shared experts, many small routed experts, group-limited sigmoid routing) after
``first_k_dense_replace`` dense layers.

Field names follow Hugging Face's ``MixtralConfig`` where the meaning is the same (``num_local_experts``,
``num_experts_per_tok``, ``router_aux_loss_coef``), so Mixtral configs map field by field, and its
``DeepseekV3Config`` for the DeepSeek settings (``moe_intermediate_size``, ``n_shared_experts``, ``n_group``,
``topk_group``, ``routed_scaling_factor``, ``first_k_dense_replace``). The attention stays Llama's (grouped-query,
not DeepSeek-V3's multi-head latent attention).
"""

from __future__ import annotations

import dataclasses
import re
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
    moe_intermediate_size: int | None = None
    """Width of each routed expert (DeepSeek's fine-grained experts are narrow); ``None``: ``intermediate_size``
    (Mixtral). The dense layers keep ``intermediate_size``."""
    n_shared_experts: int = 0
    """Always-on shared experts per MoE layer (`colo.tensor.moe.SharedExperts`), together one SwiGLU MLP of
    ``n_shared_experts * moe_intermediate_size`` (DeepSeek-V3: 1); 0: none."""
    n_group: int = 1
    """Group-limited routing: the experts form ``n_group`` contiguous groups (`MoEConfig.num_groups`); under the
    ``expert`` plugin with ``n_group == ep`` a group is one ep rank's experts."""
    topk_group: int | None = None
    """Groups each token may use (`MoEConfig.top_k_groups`); ``None``: all."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3: 2.5)."""
    first_k_dense_replace: int = 0
    """The first ``first_k_dense_replace`` layers keep the dense MLP (DeepSeek-V3: 3); later layers follow
    ``moe_layer_interval``."""
    kv_lora_rank: int | None = None
    """``None``: Llama's grouped-query attention. A width: DeepSeek-V3's multi-head latent attention
    (`colo.apps.models.moe_llama.mla.MultiHeadLatentAttention`) with keys and values compressed to this latent;
    then ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim`` are required, ``num_key_value_heads`` equals
    ``num_attention_heads`` and the rotary tables have ``qk_rope_head_dim``. No KV cache (no incremental decoding)."""
    q_lora_rank: int | None = None
    """Multi-head latent attention: width of the queries' low-rank path; ``None``: one ``q_proj``."""
    qk_nope_head_dim: int | None = None
    """Multi-head latent attention: per-head query/key dims without position."""
    qk_rope_head_dim: int | None = None
    """Multi-head latent attention: per-head rotary query/key dims (even; one rotary key shared by the heads)."""
    v_head_dim: int | None = None
    """Multi-head latent attention: per-head value dims."""
    rope_interleave: bool = True
    """Multi-head latent attention: the rotary dims are adjacent pairs (DeepSeek's layout, transformers' default)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive_int("moe_layer_interval", self.moe_layer_interval)
        dense = self.first_k_dense_replace
        if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense < self.num_hidden_layers:
            raise ValueError(
                f"MoELlamaConfig: first_k_dense_replace={dense!r} must be an integer in 0..num_hidden_layers - 1 = "
                f"{self.num_hidden_layers - 1} (0: every layer may be MoE), so that some layer has experts"
            )
        if self.moe_intermediate_size is not None:
            self._check_positive_int("moe_intermediate_size", self.moe_intermediate_size)
        self._check_latent_attention()
        try:
            self.moe_config()  # MoEConfig's checks: top-k <= experts, capacity factor > 0, groups, ...
        except ValueError as error:
            raise ValueError(_in_llama_names(str(error))) from None

    @property
    def latent_attention(self) -> bool:
        """Whether the attention is multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    def _check_latent_attention(self) -> None:
        names = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.latent_attention:
            given = [name for name in names if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"MoELlamaConfig: {given[0]}={getattr(self, given[0])} configures multi-head latent attention, "
                    "which is off (kv_lora_rank=None); set kv_lora_rank or drop it"
                )
            return
        self._check_positive_int("kv_lora_rank", self.kv_lora_rank)
        for name in names:
            value = getattr(self, name)
            if name == "q_lora_rank" and value is None:
                continue
            if value is None:
                raise ValueError(
                    f"MoELlamaConfig: {name} is required with multi-head latent attention (kv_lora_rank="
                    f"{self.kv_lora_rank}); DeepSeek-V3 uses qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128"
                )
            self._check_positive_int(name, value)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MoELlamaConfig: qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary dims come in pairs)"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"MoELlamaConfig: num_key_value_heads={self.num_key_value_heads} with multi-head latent attention: "
                f"every head expands its own keys and values from the latent; set num_key_value_heads="
                f"{self.num_attention_heads} (num_attention_heads)"
            )

    def _llama_attention_parameters(self) -> int:
        """Parameters of one layer's grouped-query attention (what `LlamaConfig.num_parameters` counts)."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        return hidden * (heads + 2 * self.num_key_value_heads) * self.head_dim + heads * self.head_dim * hidden

    def _attention_parameters(self) -> int:
        """Parameters of one layer's attention."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        if not self.latent_attention:
            return self._llama_attention_parameters()
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            queries = hidden * heads * qk
        else:
            queries = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        latent = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        expand = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return queries + latent + expand + heads * self.v_head_dim * hidden

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """Per-head (query / key, value) sizes: ``(qk_nope_head_dim + qk_rope_head_dim, v_head_dim)`` with
        multi-head latent attention, else Llama's."""
        if not self.latent_attention:
            return super().attention_head_dims
        return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim

    @property
    def num_norm_parameters(self) -> int:
        """Llama's RMSNorm scales plus multi-head latent attention's latent norms (``kv_a_layernorm``,
        ``q_a_layernorm``) in every layer."""
        latent = 0
        if self.latent_attention:
            latent = self.num_hidden_layers * (self.kv_lora_rank + (self.q_lora_rank or 0))
        return super().num_norm_parameters + latent

    @property
    def expert_intermediate_size(self) -> int:
        """Width of each routed expert: ``moe_intermediate_size``, or ``intermediate_size``."""
        return self.moe_intermediate_size or self.intermediate_size

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
            num_shared_experts=self.n_shared_experts,
            num_groups=self.n_group,
            top_k_groups=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has an MoE MLP: past the first ``first_k_dense_replace`` layers, every
        ``moe_layer_interval``-th."""
        return index >= self.first_k_dense_replace and index % self.moe_layer_interval == 0

    def _moe_mlp_parameters(self, *, active: bool) -> int:
        """Parameters of one MoE MLP (all experts, or the ``num_experts_per_tok`` one token uses) with its router and
        shared experts."""
        expert = 3 * self.hidden_size * self.expert_intermediate_size
        routed = self.num_experts_per_tok if active else self.num_local_experts
        shared = self.n_shared_experts * expert
        return routed * expert + shared + self.num_local_experts * self.hidden_size

    def num_parameters(self, *, embeddings: bool = True) -> int:
        """Parameters of `MoELlama` with this config (every expert counted; a tied matrix once)."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        moe_mlp = self._moe_mlp_parameters(active=False)
        attention = self.num_hidden_layers * (self._attention_parameters() - self._llama_attention_parameters())
        return super().num_parameters(embeddings=embeddings) + moe_layers * (moe_mlp - dense_mlp) + attention

    def num_active_parameters(self) -> int:
        """Parameters one token uses: ``num_experts_per_tok`` routed experts per MoE layer, the shared experts, the
        router, all the rest."""
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        idle = self._moe_mlp_parameters(active=False) - self._moe_mlp_parameters(active=True)
        return self.num_parameters() - moe_layers * idle


_LLAMA_NAMES = {
    "num_experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
    "aux_loss_coef": "router_aux_loss_coef",
    "z_loss_coef": "router_z_loss_coef",
    "num_shared_experts": "n_shared_experts",
    "num_groups": "n_group",
    "top_k_groups": "topk_group",
}
"""`MoEConfig` fields under their `MoELlamaConfig` names (the others are the same)."""


def _in_llama_names(message: str) -> str:
    """A `MoEConfig` error message with the fields named as `MoELlamaConfig` names them."""
    message = message.replace("MoEConfig.", "MoELlamaConfig: ")
    pattern = re.compile(r"\b(" + "|".join(_LLAMA_NAMES) + r")\b")
    return pattern.sub(lambda match: _LLAMA_NAMES[match.group(1)], message)


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
    # CPU demo of DeepSeek-V3's shape: multi-head latent attention, a dense first layer, then 16 narrow experts
    # (top-4) beside a shared one, sigmoid routing with the aux-loss-free bias, limited to one of two expert groups
    # (the two ranks at ep2), routed scaling; a small sequence-wise balance loss as DeepSeek-V3's
    "tiny-deepseek": MoELlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=256,
        num_local_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=48,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        score_func="sigmoid",
        expert_bias=True,
        first_k_dense_replace=1,
        router_aux_loss_coef=1e-4,
        aux_loss_type="sequence",
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
    # DeepSeek-V3 (DeepSeek-AI, 2024; transformers' DeepseekV3Config defaults, without the multi-token prediction
    # module): 671B parameters, 37.6B active; for `colo plan`
    "deepseek-v3": MoELlamaConfig(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        num_local_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        score_func="sigmoid",
        expert_bias=True,
        first_k_dense_replace=3,
        router_aux_loss_coef=1e-4,
        aux_loss_type="sequence",
    ),
}
"""Named MoE shapes: ``tiny-moe`` (CPU tests), ``tiny-mixtral`` and ``tiny-deepseek`` (CPU demos), ``mixtral-8x7b``,
``mixtral-8x22b``, ``deepseek-v3`` (planning)."""


def get_moe_preset(name: str, **overrides) -> MoELlamaConfig:
    """The MoE preset ``name`` with some fields changed (validated like any config)."""
    if name not in MOE_PRESETS:
        raise ValueError(f"unknown MoE Llama preset {name!r}; choose one of {sorted(MOE_PRESETS)}")
    unknown = sorted(set(overrides) - {field.name for field in dataclasses.fields(MoELlamaConfig)})
    if unknown:
        raise ValueError(f"get_moe_preset({name!r}): {unknown} are not MoELlamaConfig fields")
    return dataclasses.replace(MOE_PRESETS[name], **overrides)
