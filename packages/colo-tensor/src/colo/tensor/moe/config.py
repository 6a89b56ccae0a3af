"""`MoEConfig`: the settings of a mixture-of-experts block, validated before anything is built or communicated."""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("batch", "sequence")
EXPERT_IMPLS = ("grouped", "loop")


@dataclass(kw_only=True)
class MoEConfig:
    """A token-choice top-k mixture of experts (Shazeer et al., 2017; Fedus et al., "Switch Transformers", 2021;
    Jiang et al., "Mixtral of Experts", 2024): which experts a token goes to, how many, and the auxiliary losses.

    The defaults are Mixtral's: softmax scores over 8 experts, the top 2 renormalized to sum to one, dropless.
    """

    num_experts: int = 8
    """Experts per MoE block (``num_local_experts`` in Hugging Face's ``MixtralConfig``)."""
    top_k: int = 2
    """Experts each token is sent to (``num_experts_per_tok``)."""
    score_func: str = "softmax"
    """``"softmax"`` (Mixtral, Switch) or ``"sigmoid"`` (DeepSeek-V3) of the router logits, computed in fp32."""
    normalize_top_k: bool = True
    """Renormalize the k selected scores to sum to one (Mixtral and DeepSeek-V3 do)."""
    capacity_factor: float | None = None
    """``None``: dropless, every assignment is computed. A number > 0: each expert takes at most
    ``ceil(capacity_factor * tokens * top_k / num_experts)`` assignments of a forward's local tokens; the rest are
    dropped by the rule in `colo.tensor.moe.permute.capacity_mask`."""
    aux_loss_type: str = "batch"
    """Load-balancing loss form (`colo.tensor.moe.losses.load_balancing_loss`): ``"batch"`` over all tokens of a
    forward (a microbatch on one rank, as Switch and Hugging Face compute it) or ``"sequence"`` (per sequence, then
    averaged: independent of how sequences are split over ranks and microbatches)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in the training loss (Mixtral: 0.02; 0 leaves it out)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (Zoph et al., "ST-MoE", 2022: 1e-3 there; 0 leaves it out)."""
    expert_bias: bool = False
    """Aux-loss-free balancing (Wang et al., 2024; DeepSeek-V3): a per-expert bias added to the scores for the
    top-k choice only, updated outside autograd by `TopKRouter.update_expert_bias`."""
    expert_bias_update_rate: float = 1e-3
    """Step of the bias update: ``bias += rate * sign(mean count - count)`` per expert."""
    expert_impl: str = "grouped"
    """``"grouped"``: one grouped matrix product per projection over all local experts
    (``torch.nn.functional.grouped_mm``); ``"loop"``: one matmul per expert, the reference."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} is larger than num_experts={self.num_experts}; a token cannot go to "
                f"more experts than there are: choose top_k <= {self.num_experts}"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEConfig.score_func={self.score_func!r}; choose one of {SCORE_FUNCS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"MoEConfig.capacity_factor={self.capacity_factor} must be > 0 (1.0 is an even share per expert), or "
                "None for dropless routing"
            )
        if self.aux_loss_type not in AUX_LOSS_TYPES:
            raise ValueError(f"MoEConfig.aux_loss_type={self.aux_loss_type!r}; choose one of {AUX_LOSS_TYPES}")
        for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)} must be >= 0")
        if self.expert_impl not in EXPERT_IMPLS:
            raise ValueError(f"MoEConfig.expert_impl={self.expert_impl!r}; choose one of {EXPERT_IMPLS}")
