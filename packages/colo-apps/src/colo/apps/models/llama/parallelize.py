"""`parallelize_llama`: parallelism for `Llama` applied from outside, one short function per concern.

Tensor parallelism (Megatron-LM, Shoeybi et al., 2019) over one mesh axis, as a `colo.tensor.parallelize` plan:

- ``embed_tokens``: vocabulary-parallel (each rank holds a range of rows; one all-reduce assembles them);
- ``layers.*.self_attn.qkv_proj``: column-parallel by heads (`FusedQKV`), which also rewrites the attention's
  ``num_heads`` / ``num_kv_heads`` to this rank's counts; with fewer kv heads than ranks the kv weights are
  replicated and each rank projects the kv head of its query heads;
- ``o_proj`` and ``down_proj``: row-parallel (one all-reduce each, forward and backward); ``gate_proj`` and
  ``up_proj``: column-parallel;
- ``lm_head``: column-parallel over the vocabulary. With ``loss_parallel`` (the default) the loss is the
  vocabulary-parallel cross-entropy of the local logits (two small all-reduces per token, the ``(tokens, vocab)``
  logits never gathered); without it the logits are all-gathered and the ordinary cross-entropy is used.

Norms and the rotary tables are replicated. Megatron-SP (`llama_sequence_parallel_plan`) changes the layouts of
this plan's linears and adds the norms; on pipeline stages the first stage splits the sequence after the embedding,
the stages pass sequence shards and the last gathers them at ``lm_head``. Ulysses or ring attention wrap or replace
each layer's parameter-free ``self_attn.core`` (its positions come in as ``position_ids``); see
`colo.apps.booster.llama_plan`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from colo.comm import Group, Mesh
from colo.tensor import (
    Colwise,
    FusedQKV,
    ParallelStyle,
    PrepareInput,
    Replicate,
    Rowwise,
    SequenceParallel,
    Shard,
    VocabParallel,
    all_gather_split,
    parallelize,
    valid_tp_sizes,
    vocab_parallel_cross_entropy,
)

from .config import LlamaConfig
from .loss import IGNORE_INDEX, CausalLMObjective, LMHead
from .model import init_llama_module


class VocabParallelCausalLMObjective(CausalLMObjective):
    """The next-token loss of a vocabulary-parallel ``lm_head`` (a `ColumnParallelLinear` without gather).

    The loss is `colo.tensor.vocab_parallel_cross_entropy` of this rank's logit columns, in fp32; logits, when
    asked for, are all-gathered over the group (their gradient split back).

    Args:
        group (Group): the tensor-parallel group the vocabulary is split over.
        vocab_size (int): the true vocabulary size.
        ignore_index (int): label of tokens without a loss. Default: ``-100``.
    """

    def __init__(self, *, group: Group, vocab_size: int, ignore_index: int = IGNORE_INDEX):
        super().__init__(ignore_index=ignore_index, fused=False)
        self.group, self.vocab_size = group, vocab_size
        self.labels_checked = False
        """Whether a call has checked its labels: the same on every rank, in the vocabulary or ``ignore_index``
        (`colo.tensor.vocab_parallel.check_tokens`); later calls skip it unless ``COLO_DEBUG_CHECKS=1``."""

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        labels: torch.Tensor | None = None,
        *,
        return_logits: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """As `CausalLMObjective.forward`; ``lm_head`` returns this rank's columns of the logits."""
        local_logits = lm_head(hidden)
        logits = None
        if labels is None or return_logits:
            logits = all_gather_split(local_logits, group=self.group, dim=-1)
        if labels is None:
            return None, logits
        targets = self.targets(labels)
        total = vocab_parallel_cross_entropy(
            local_logits.float(),
            targets,
            group=self.group,
            ignore_index=self.ignore_index,
            vocab_size=self.vocab_size,
            reduction="sum",
            check=not self.labels_checked,
        )
        if not torch.compiler.is_compiling():  # (a compiled forward does not check: vocab_parallel_cross_entropy)
            self.labels_checked = True
        # the mean over non-ignored targets, 0 when all are ignored (as colo.kernels.cross_entropy)
        return total / (targets != self.ignore_index).sum().clamp(min=1), logits

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, vocab_size={self.vocab_size}, tp={self.group.size}"


def check_tp_size(config: LlamaConfig, tp: int) -> None:
    """Raise a `ValueError` naming the config field when ``tp`` ranks cannot shard a model of this shape.

    Args:
        config (LlamaConfig): the model's shape.
        tp (int): the tensor-parallel size.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    valid = valid_tp_sizes(heads, kv_heads)
    if tp not in valid:
        raise ValueError(
            f"tp={tp} cannot shard num_attention_heads={heads} with num_key_value_heads={kv_heads} (tp must divide "
            f"the query heads and either divide the kv heads or be a multiple of them); choose tp in {valid}"
        )
    for field in ("intermediate_size", "vocab_size"):
        extent = getattr(config, field)
        if extent % tp:
            raise ValueError(
                f"tp={tp} does not divide {field}={extent}; choose tp in "
                f"{[d for d in valid if extent % d == 0]} or make {field} a multiple of {tp}"
            )


def llama_tp_plan(*, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of `Llama` (see the module docstring).

    Args:
        loss_parallel (bool): keep ``lm_head``'s output split over the vocabulary (for the vocabulary-parallel
            loss); ``False`` all-gathers the logits. Default: ``True``.

    Returns:
        dict[str, ParallelStyle]: module-name pattern -> style, for `colo.tensor.parallelize`.
    """
    return {
        "embed_tokens": VocabParallel(),
        "layers.*.self_attn.qkv_proj": FusedQKV(head_attrs=("num_heads", "num_kv_heads")),
        "layers.*.self_attn.o_proj": Rowwise(),
        "layers.*.mlp.gate_proj": Colwise(),
        "layers.*.mlp.up_proj": Colwise(),
        "layers.*.mlp.down_proj": Rowwise(),
        "lm_head": Colwise(gather_output=not loss_parallel),
    }


def llama_sequence_parallel_plan(*, loss_parallel: bool = True, first_layer: str | None = "0") -> dict:
    """`llama_tp_plan` with Megatron sequence parallelism (Korthikanti et al., 2022) over the same axis.

    Between the tensor-parallel regions the activations are split along the sequence (dim 1): the first decoder
    layer's input is split after the embedding (`PrepareInput`, no communication forward, all-gather backward),
    the q/k/v and gate/up projections all-gather the sequence on entry (their backward re-gathers the saved shard),
    ``o_proj`` and ``down_proj`` reduce-scatter onto the sequence instead of all-reducing, the RMSNorms run on
    sequence shards (their weight gradients summed over the axis), and ``lm_head`` gathers the sequence again.

    Args:
        loss_parallel (bool): as in `llama_tp_plan`. Default: ``True``.
        first_layer (str | None): the name of the first decoder layer (where the sequence is split); ``None`` when
            the model holds no embedding (a pipeline stage after the first, whose input arrives split). Default:
            ``"0"``.
    """
    sequence = Shard(1)
    plan = {
        "embed_tokens": VocabParallel(),
        "layers.*.input_layernorm": SequenceParallel(),
        "layers.*.self_attn.qkv_proj": FusedQKV(head_attrs=("num_heads", "num_kv_heads"), input_layout=sequence),
        "layers.*.self_attn.o_proj": Rowwise(output_layout=sequence),
        "layers.*.post_attention_layernorm": SequenceParallel(),
        "layers.*.mlp.gate_proj": Colwise(input_layout=sequence),
        "layers.*.mlp.up_proj": Colwise(input_layout=sequence),
        "layers.*.mlp.down_proj": Rowwise(output_layout=sequence),
        "norm": SequenceParallel(),
        "lm_head": Colwise(gather_output=not loss_parallel, input_layout=sequence),
    }
    if first_layer is not None:
        plan[f"layers.{first_layer}"] = PrepareInput((Replicate(), None, None), (sequence, None, None))
    return plan


def apply_tp(
    model: nn.Module,
    *,
    mesh: Mesh,
    axis: str = "tp",
    loss_parallel: bool = True,
    sequence_parallel: bool = False,
    materialize: torch.device | str | None = None,
    seed: int = 0,
    init_fn=None,
) -> None:
    """Shard ``model`` (a `Llama`, or a pipeline stage of one) over ``axis`` with `llama_tp_plan`, in place.

    A tied embedding and ``lm_head`` are untied for the plan (each is replaced by its own parallel layer) and tied
    again afterwards: both hold the same vocabulary rows on a rank, so they share this rank's shard.

    Args:
        model (nn.Module): the unsharded model (eager or on the meta device).
        mesh (Mesh): the mesh.
        axis (str): the tensor-parallel mesh axis. Default: ``"tp"``.
        loss_parallel (bool): vocabulary-parallel loss (see `llama_tp_plan`). Default: ``True``.
        sequence_parallel (bool): Megatron sequence parallelism too (`llama_sequence_parallel_plan`). Default:
            ``False``.
        materialize (torch.device | str | None): initialize meta-device parameters here, module by module, each
            rank only its shards (see `colo.tensor.parallelize`). Default: ``None``.
        seed (int): the model seed for materialization (`Llama.init_weights` gives the full model the same
            values). Default: ``0``.
        init_fn: ``init_fn(name, module)`` fills a materialized module's own tensors instead of the seeded
            `init_llama_module` (e.g. pretrained weights, module by module). Default: ``None``.
    """
    config: LlamaConfig = model.config
    embed, lm_head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if sequence_parallel:
        # a pipeline stage splits the sequence only where it holds the embedding and keeps it split otherwise:
        # its hidden states travel to the next stage as sequence shards
        first_layer = next(iter(model.layers)) if embed is not None else None
        plan = llama_sequence_parallel_plan(loss_parallel=loss_parallel, first_layer=first_layer)
        if not hasattr(model, "norm"):  # a pipeline stage before the last
            del plan["norm"]
    else:
        plan = llama_tp_plan(loss_parallel=loss_parallel)
    if not any(hasattr(layer.mlp, "gate_proj") for layer in model.layers.values()):
        # only mixture-of-experts MLPs here (MoELlama, or one of its stages): they stay whole on every tp rank
        for name in [name for name in plan if name.startswith("layers.*.mlp.")]:
            del plan[name]
    latent = _latent_attention(model)
    if latent is not None:  # DeepSeek's multi-head latent attention: its heads split, its latents replicated
        from ..moe_llama.parallelize import latent_attention_tp_plan

        if sequence_parallel:
            raise ValueError(
                "Megatron sequence parallelism is not implemented for multi-head latent attention (its replicated "
                "latent projections would need the whole sequence); use sp_mode=None with tp"
            )
        del plan["layers.*.self_attn.qkv_proj"]
        plan.update(latent_attention_tp_plan(q_lora=latent.q_lora_rank is not None))
    if embed is None:  # a pipeline stage without the embedding
        del plan["embed_tokens"]
    if lm_head is None:  # a pipeline stage without the head
        del plan["lm_head"]
    elif lm_head.out_features == 1:  # a reward model's hidden -> 1 head: replicated, reading the replicated hidden
        if sequence_parallel:
            raise ValueError(
                "a scalar (reward) head cannot follow Megatron sequence parallelism: the final hidden states are "
                "sequence shards there; use sp_mode=None with tp"
            )
        del plan["lm_head"]
        lm_head = None  # nothing of the head for the objective below: it reads rewards, not a vocabulary
    if isinstance(lm_head, LMHead):  # its fused-loss forward is for the unsharded head: shard a plain linear
        plain = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False, device="meta")
        plain.weight = lm_head.weight
        model.lm_head = lm_head = plain
    tied = config.tie_word_embeddings and embed is not None and lm_head is not None
    if tied and lm_head.weight is embed.weight:
        lm_head.weight = nn.Parameter(embed.weight.detach(), requires_grad=embed.weight.requires_grad)
    if init_fn is None:
        init_fn = functools.partial(init_llama_module, config=config, seed=seed)
    parallelize(model, mesh, plan, axis=axis, materialize=materialize, init_fn=init_fn)
    if latent is not None:
        from ..moe_llama.parallelize import finish_latent_attention_tp

        finish_latent_attention_tp(model, mesh=mesh, axis=axis)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    if lm_head is not None:
        ignore_index = model.objective.ignore_index
        if loss_parallel:
            model.objective = VocabParallelCausalLMObjective(
                group=mesh.group(axis), vocab_size=config.vocab_size, ignore_index=ignore_index
            )
        else:
            model.objective = CausalLMObjective(ignore_index=ignore_index, fused=False)


def _latent_attention(model: nn.Module):
    """The first decoder layer's attention when it is multi-head latent attention (it has ``kv_b_proj``), else
    ``None``."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    attention = next(iter(layers.values())).self_attn
    return attention if hasattr(attention, "kv_b_proj") else None


def parallelize_llama(
    model: nn.Module,
    *,
    mesh: Mesh,
    tp_axis: str = "tp",
    loss_parallel: bool = True,
    sequence_parallel: bool = False,
    materialize: torch.device | str | None = None,
    seed: int = 0,
    init_fn=None,
) -> nn.Module:
    """Apply colo's parallelisms to a `Llama` (or a `LlamaStage`) from outside, in place.

    Every size is checked against the config first, so a bad combination fails with a message naming the field
    before any collective runs. Then tensor parallelism over ``tp_axis`` (`apply_tp`).

    Args:
        model (nn.Module): a `Llama` or `LlamaStage`, eager or built under ``torch.device("meta")``; the same on
            every rank.
        mesh (Mesh): the mesh; must have ``tp_axis``.
        tp_axis (str): the tensor-parallel mesh axis. Default: ``"tp"``.
        loss_parallel (bool): vocabulary-parallel loss instead of gathered logits. Default: ``True``.
        sequence_parallel (bool): Megatron sequence parallelism over ``tp_axis`` as well (the sequence length must
            divide by its size). Default: ``False``.
        materialize (torch.device | str | None): for a meta-device model, initialize it on this device, each rank
            only its shards (peak memory: its shards plus one module's full weights). Default: ``None``.
        seed (int): the model seed used when materializing; ``Llama.init_weights(seed)`` gives the unsharded
            model exactly the values these shards are slices of. Default: ``0``.
        init_fn: ``init_fn(name, module)`` fills each materialized module's own tensors instead of the seeded
            initialization, e.g. `colo.apps.train.PretrainedLlamaWeights` (pretrained weights: each rank reads one
            module's full tensors at a time and keeps its shards). Default: ``None``.

    Returns:
        nn.Module: ``model``.

    Raises:
        TypeError: ``model`` has no `LlamaConfig` or ``mesh`` is not a `Mesh`.
        ValueError: ``tp_axis`` is not on the mesh, or its size does not fit the heads, ``intermediate_size`` or
            ``vocab_size``.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"parallelize_llama: model must be a Llama or LlamaStage, not {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"parallelize_llama: mesh must be a colo.comm.Mesh, e.g. Mesh(tp=2), not {type(mesh)}")
    if tp_axis not in mesh.axis_names:
        raise ValueError(
            f"parallelize_llama: the mesh has axes {mesh.axis_names} and no {tp_axis!r}; build it with "
            f"Mesh(..., {tp_axis}=N) or pass tp_axis= naming its tensor-parallel axis"
        )
    check_tp_size(config, mesh.size(tp_axis))
    apply_tp(
        model,
        mesh=mesh,
        axis=tp_axis,
        loss_parallel=loss_parallel,
        sequence_parallel=sequence_parallel,
        materialize=materialize,
        seed=seed,
        init_fn=init_fn,
    )
    return model
