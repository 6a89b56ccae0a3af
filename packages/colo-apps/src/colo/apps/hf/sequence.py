"""Sequence parallelism for Hugging Face's ``LlamaForCausalLM`` (used by `colo.apps.hf.plans.HFLlamaPlan`).

- **Megatron-SP** over ``tp`` (Korthikanti et al., 2022): `hf_llama_sequence_parallel_plan`. Between the
  tensor-parallel regions the hidden states are split along the sequence: the first decoder layer's input is split
  after the embedding, the norms run on sequence shards (their weight gradients summed over tp), ``o_proj`` and
  ``down_proj`` reduce-scatter onto the sequence, ``gate_proj`` / ``up_proj`` all-gather it, and ``lm_head``
  gathers it again. transformers 5's attention reshapes q, k and v with its *input's* sequence length, so the
  sequence is gathered once at the attention module's input (`GatherSequence`: all-gather forward, this rank's
  slice of the gradient backward) rather than inside each of q, k and v; the causal mask and the rotary tables
  that ``LlamaModel`` computes for the whole sequence then fit. q, k and v stay ordinary column-parallel linears,
  whose backward all-reduces their input's gradient, as under plain tensor parallelism: the attention's backward
  moves what plain TP moves (three all-reduces) where Megatron's fused projection would reduce-scatter once.
- **Ulysses and ring attention** over ``sp``: each rank feeds the model its piece of every sequence (zigzag for
  ring attention) with its tokens' *global* ``position_ids``, so the rotary embedding is that of the whole
  sequence. The attention runs through transformers 5's ``AttentionInterface``: `use_sequence_parallel_attention`
  registers `sequence_parallel_attention` under `ATTENTION_NAME`, points the model's config at it and gives every
  attention module its group and layout; it calls `colo.tensor.ulysses_attention` or `colo.tensor.ring_attention`
  over global positions. transformers builds no mask for an implementation it has no mask function for, so the
  positions of a zigzag shard (which jump, as packed documents' would) are never taken for document boundaries;
  packed rows' document ids of the whole sequence are passed explicitly (`DOCUMENT_IDS_KEY`).

Only the model's ``"eager"`` and ``"sdpa"`` attention (plain causal softmax attention, which these compute
exactly) are replaced; others are refused (`SUPPORTED_ATTENTION`).
"""

from __future__ import annotations

import torch
from torch import nn

from colo.comm import Mesh
from colo.tensor import (
    Colwise,
    ParallelStyle,
    PrepareInput,
    Replicate,
    Rowwise,
    SequenceParallel,
    Shard,
    VocabParallel,
    all_gather_split,
    ring_attention,
    ulysses_attention,
)

ATTENTION_NAME = "colo_sequence_parallel"
"""The ``attn_implementation`` key `sequence_parallel_attention` is registered under."""

SUPPORTED_ATTENTION = ("eager", "sdpa")
"""The model attention implementations Ulysses and ring attention replace (plain causal softmax attention)."""

DOCUMENT_IDS_KEY = "colo_document_ids"
"""The keyword under which a sequence-parallel batch of packed rows carries the whole sequence's document ids: the
model's forward hands its keyword arguments on to the attention function."""

_SETTINGS = "_colo_sequence_parallel"


class GatherSequence(ParallelStyle):
    """Gather a module's ``hidden_states`` (its first positional argument or that keyword) over the sequence dim 1:
    all-gather forward, this rank's slice of the gradient backward (`colo.tensor.all_gather_split`). For a module
    whose inputs feed column-parallel linears: their backward has already summed the input's gradient over the
    ranks (all-reduce), so the slice is this rank's shard's whole gradient.

    Args:
        axis: mesh axis; default: `parallelize`'s.
    """

    def __init__(self, *, axis: str | None = None):
        self.axis = axis

    def apply(self, target) -> nn.Module:
        group = target.mesh.group(target.axis)

        def gather(module, args, kwargs):
            if args:
                return (all_gather_split(args[0], group=group, dim=1), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise ValueError(f"GatherSequence on {target.name!r}: the module got no hidden_states to gather")
            hidden = all_gather_split(kwargs["hidden_states"], group=group, dim=1)
            return args, {**kwargs, "hidden_states": hidden}

        target.module.register_forward_pre_hook(gather, with_kwargs=True)
        return target.module

    def __repr__(self) -> str:
        return "GatherSequence()"


def hf_llama_sequence_parallel_plan(*, first_layer: str | None = "0") -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of ``LlamaForCausalLM`` with Megatron sequence parallelism over the same axis.

    Args:
        first_layer (str | None): the first decoder layer's index (where the sequence is split after the
            embedding). Default: ``"0"``.

    Returns:
        dict[str, ParallelStyle]: module-name pattern -> style (logits gathered whole: Hugging Face's loss runs on
        them).
    """
    sequence = Shard(1)
    plan: dict[str, ParallelStyle] = {"model.embed_tokens": VocabParallel()}
    if first_layer is not None:
        plan[f"model.layers.{first_layer}"] = PrepareInput((Replicate(),), (sequence,))
    plan["model.layers.*.input_layernorm"] = SequenceParallel()
    plan["model.layers.*.self_attn"] = GatherSequence()
    plan.update({f"model.layers.*.self_attn.{p}_proj": Colwise() for p in "qkv"})
    plan["model.layers.*.self_attn.o_proj"] = Rowwise(output_layout=sequence)
    plan["model.layers.*.post_attention_layernorm"] = SequenceParallel()
    plan["model.layers.*.mlp.gate_proj"] = Colwise(input_layout=sequence)
    plan["model.layers.*.mlp.up_proj"] = Colwise(input_layout=sequence)
    plan["model.layers.*.mlp.down_proj"] = Rowwise(output_layout=sequence)
    plan["model.norm"] = SequenceParallel()
    plan["lm_head"] = Colwise(gather_output=True, input_layout=sequence)
    return plan


def sequence_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over a sequence split across the module's sp group.

    ``query`` / ``key`` / ``value``: ``(batch, heads, local_seq, head_dim)`` of this rank's tokens (rotated with
    their global positions). Causal attention over the whole sequence with Ulysses (all-to-all to a head split) or
    ring attention (key/value blocks passed around the ring), as `use_sequence_parallel_attention` set the module
    up; within documents only when the keyword `DOCUMENT_IDS_KEY` holds the whole sequence's document ids (packed
    rows). Returns ``(batch, local_seq, heads, head_dim)`` and no weights. ``attention_mask`` must be ``None``
    (transformers builds none for this implementation); dropout is refused.
    """
    settings = getattr(module, _SETTINGS, None)
    if settings is None:
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} runs only on attention modules set up by "
            "use_sequence_parallel_attention (HybridParallel with sp_mode='ulysses' or 'ring')"
        )
    mode, group, layout = settings
    if dropout:
        raise ValueError(f"{ATTENTION_NAME}: attention dropout={dropout} is not supported; set attention_dropout=0")
    if attention_mask is not None:
        raise ValueError(f"{ATTENTION_NAME}: got an attention mask; sequence-parallel attention is causal only")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    attend = ulysses_attention if mode == "ulysses" else ring_attention
    document_ids = kwargs.get(DOCUMENT_IDS_KEY)
    out = attend(q, k, v, group=group, causal=True, scale=scaling, layout=layout, document_ids=document_ids)
    return out, None


def check_attention_implementation(model: nn.Module, sp_mode: str) -> None:
    """Raise a `ValueError` naming the fix unless the model's attention is one `SUPPORTED_ATTENTION` names."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION and implementation != ATTENTION_NAME:
        raise ValueError(
            f"HybridParallel.sp_mode={sp_mode!r} replaces the model's attention by colo's sequence-parallel "
            f"attention, which computes what attn_implementation in {SUPPORTED_ATTENTION} computes, but the model "
            f"has attn_implementation={implementation!r}; load it with attn_implementation='sdpa' (or 'eager')"
        )


def use_sequence_parallel_attention(model: nn.Module, *, mesh: Mesh, mode: str, layout: str, axis: str = "sp") -> None:
    """Run every attention module of ``model`` through `sequence_parallel_attention` over ``axis``.

    Args:
        model: the ``LlamaForCausalLM``.
        mesh (Mesh): the mesh.
        mode (str): ``"ulysses"`` or ``"ring"``.
        layout (str): how the sequence is split, ``"contiguous"`` or ``"zigzag"``.
        axis (str): the sequence-parallel mesh axis. Default: ``"sp"``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, sequence_parallel_attention)
    group = mesh.group(axis)
    for name, module in model.named_modules():
        if name.endswith(".self_attn"):
            setattr(module, _SETTINGS, (mode, group, layout))
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
