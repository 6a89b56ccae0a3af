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
    DeepSeek-V3's block (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024) is these settings: many small experts
    (``num_experts=256, top_k=8``), ``num_shared_experts=1``, ``score_func="sigmoid"`` with ``expert_bias``,
    ``num_groups=8, top_k_groups=4`` and ``routed_scaling_factor=2.5``; Hugging Face's ``DeepseekV3Config`` names
    them ``n_routed_experts``, ``num_experts_per_tok``, ``n_shared_experts``, ``n_group``, ``topk_group``,
    ``routed_scaling_factor``.
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
    num_shared_experts: int = 0
    """Always-on experts beside the routed ones (DeepSeek-MoE's shared experts; ``n_shared_experts``): every token
    goes through them, unweighted, and their output is added to the routed experts'. They are one SwiGLU MLP of
    ``shared_intermediate_size`` (``MoEBlock.shared_experts``), a dense part of the model (replicated over ``ep``).
    0: none (Mixtral)."""
    shared_intermediate_size: int | None = None
    """Width of the shared experts' MLP; ``None``: ``num_shared_experts`` times the routed experts' intermediate
    size (DeepSeek-V3's rule; Qwen-MoE sets its own ``shared_expert_intermediate_size``)."""
    num_groups: int = 1
    """Group-limited routing (DeepSeek-V3's node-limited routing; ``n_group``): the experts are split into
    ``num_groups`` contiguous groups of ``num_experts / num_groups``; each token ranks the groups by the sum of the
    top-2 choice scores (``scores + expert_bias``) in each, keeps the best ``top_k_groups`` and picks its ``top_k``
    experts among those only. Under expert parallelism with ``num_groups == ep`` a group is exactly one ep rank's
    experts, so each token's rows go to at most ``top_k_groups`` ranks. 1: no grouping."""
    top_k_groups: int | None = None
    """Groups each token may use (``topk_group``); ``None``: all ``num_groups`` (no limit)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights after the top-k normalization (DeepSeek-V3: 2.5), so the routed part
    keeps its scale beside the shared experts."""

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
        self._check_shared_experts()
        self._check_groups()
        if not self.routed_scaling_factor > 0:
            raise ValueError(
                f"MoEConfig.routed_scaling_factor={self.routed_scaling_factor} must be > 0 (1.0: the normalized "
                "weights as they are; DeepSeek-V3 uses 2.5)"
            )

    @property
    def experts_per_group(self) -> int:
        """``num_experts / num_groups``."""
        return self.num_experts // self.num_groups

    @property
    def groups_per_token(self) -> int:
        """The groups a token may use: ``top_k_groups``, or every group."""
        return self.num_groups if self.top_k_groups is None else self.top_k_groups

    def _check_shared_experts(self) -> None:
        shared = self.num_shared_experts
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(f"MoEConfig.num_shared_experts={shared!r} must be an integer >= 0 (0: no shared experts)")
        size = self.shared_intermediate_size
        if size is None:
            return
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"MoEConfig.shared_intermediate_size={size!r} must be a positive integer, or None for "
                "num_shared_experts times the routed experts' intermediate size"
            )
        if shared == 0:
            raise ValueError(
                f"MoEConfig.shared_intermediate_size={size} is set but num_shared_experts=0; set num_shared_experts "
                ">= 1 or leave shared_intermediate_size None"
            )

    def _check_groups(self) -> None:
        groups, experts = self.num_groups, self.num_experts
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"MoEConfig.num_groups={groups!r} must be a positive integer (1: no grouping)")
        if experts % groups:
            choices = [d for d in range(1, experts + 1) if experts % d == 0]
            raise ValueError(
                f"MoEConfig.num_groups={groups} does not divide num_experts={experts}: the experts are split into "
                f"equal groups; choose num_groups in {choices}"
            )
        chosen = self.top_k_groups
        if chosen is not None and (
            not isinstance(chosen, int) or isinstance(chosen, bool) or not 1 <= chosen <= groups
        ):
            raise ValueError(
                f"MoEConfig.top_k_groups={chosen!r} must be an integer in 1..num_groups={groups}, or None for every "
                "group"
            )
        reachable = self.groups_per_token * self.experts_per_group
        if self.top_k > reachable:
            needed = -(-self.top_k // self.experts_per_group)
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} is more than the {reachable} experts in the top_k_groups="
                f"{self.groups_per_token} groups of {self.experts_per_group} a token may use; set top_k_groups >= "
                f"{needed} or top_k <= {reachable}"
            )
