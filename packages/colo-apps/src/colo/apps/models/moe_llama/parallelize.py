"""Tensor parallelism of multi-head latent attention (`MultiHeadLatentAttention`), applied from outside.

The heads are split over the tp axis, as DeepSeek-V3's reference model code splits them (``wq_b`` and ``wkv_b``
column-parallel, ``wo`` row-parallel, ``wq_a`` / ``wkv_a`` replicated; transformers' ``DeepseekV3`` tp plan leaves the
attention unsplit): the per-head projections ``q_proj`` (or ``q_b_proj`` after the query latent) and ``kv_b_proj`` by
columns (each rank its heads' rows), ``o_proj`` by rows (its heads' value columns, the outputs summed over tp). The
compressing projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and the latents' norms stay replicated: every tp rank
computes the same latents from the same tokens. Their gradients must then be the sums over all heads, which the
column-parallel layers give the latents (their input's gradient is all-reduced in backward); the decoupled rotary key,
shared by every head and consumed by this rank's heads only, goes through a copy whose backward all-reduces its
gradient (`colo.tensor.comm_ops.copy_all_reduce`, a forward hook on ``kv_a_proj_with_mqa``). Replicated weights then
get equal gradients on every tp rank.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from colo.comm import Group, Mesh
from colo.tensor import Colwise, ParallelStyle, Rowwise, copy_all_reduce


def latent_attention_tp_plan(*, q_lora: bool) -> dict[str, ParallelStyle]:
    """The plan entries of multi-head latent attention in a decoder (`colo.tensor.parallelize` patterns).

    Args:
        q_lora (bool): the queries go through a latent (``q_lora_rank`` set: ``q_b_proj`` is split), else
            ``q_proj`` is.
    """
    queries = "layers.*.self_attn.q_b_proj" if q_lora else "layers.*.self_attn.q_proj"
    return {queries: Colwise(), "layers.*.self_attn.kv_b_proj": Colwise(), "layers.*.self_attn.o_proj": Rowwise()}


def check_latent_attention_tp(num_heads: int, tp: int) -> None:
    """Raise a `ValueError` when ``tp`` does not divide the heads (each rank computes whole heads)."""
    if num_heads % tp:
        choices = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"tp={tp} does not divide num_attention_heads={num_heads} of multi-head latent attention; choose tp in "
            f"{choices}"
        )


def finish_latent_attention_tp(model: nn.Module, *, mesh: Mesh, axis: str = "tp") -> None:
    """After `latent_attention_tp_plan` was applied: every latent attention computes its local heads, and its rotary
    key's gradient is summed over ``axis`` (module docstring)."""
    group, size = mesh.group(axis), mesh.size(axis)
    for layer in model.layers.values():
        attention = layer.self_attn
        check_latent_attention_tp(attention.num_heads, size)
        attention.num_heads //= size
        attention.num_kv_heads = attention.num_heads
        hook = functools.partial(_sum_rotary_key_gradient, latent=attention.kv_lora_rank, group=group)
        attention.kv_a_proj_with_mqa.register_forward_hook(hook)


def _sum_rotary_key_gradient(module: nn.Module, args, output: torch.Tensor, *, latent: int, group: Group):
    """Forward hook of ``kv_a_proj_with_mqa``: the rotary key's columns through copy / all-reduce (the latent's
    gradient is summed by ``kv_b_proj``'s column-parallel input)."""
    compressed, rotary = output.split([latent, output.shape[-1] - latent], dim=-1)
    return torch.cat([compressed, copy_all_reduce(rotary, group=group)], dim=-1)
