"""Ulysses sequence parallelism: trade the sequence split for a head split around attention (DeepSpeed-Ulysses).

DeepSpeed-Ulysses (Jacobs et al., 2023, https://arxiv.org/abs/2309.14509): outside attention every rank of the
``sp`` group holds a slice of the sequence with all heads; an all-to-all turns q, k and v into the whole
sequence with ``num_heads / sp`` heads, attention runs locally and unchanged on those heads, and a second
all-to-all turns the output back into the sequence slice with all heads. Each all-to-all is `AllToAllResplit`
(forward all-to-all, backward the inverse all-to-all), so per call the forward moves ``(sp - 1) / sp`` of q,
k, v and the output once each, and the backward the same again.

Grouped-query attention: with ``num_kv_heads`` divisible by ``sp`` the kv heads are split like the q heads (rank
``r`` gets the kv heads of its q heads). With fewer kv heads than ranks (``sp`` a multiple of ``num_kv_heads``)
each kv head is repeated ``sp / num_kv_heads`` times before the all-to-all, so every rank receives the one kv
head its q heads use (the repeat's backward sums the copies' gradients); k and v then move as ``sp`` heads. Any
other ``sp`` is rejected with the valid choices.

Sequence layouts and padding are those of `colo.tensor.zigzag`: after the all-to-all the shards are put back in
sequence order and the padding is cut off, so the local attention sees exactly the ``seq_len`` real tokens.
Packed rows: ``document_ids`` of the whole sequence (the same on every rank) go to the local attention with it,
which then attends within each document (`colo.kernels.document_mask`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from colo.comm import Group
from colo.kernels import flash_attention
from colo.kernels.document_mask import check_document_ids

from .comm_ops import all_to_all_resplit
from .qkv import valid_tp_sizes
from .zigzag import check_attention_inputs, check_sequence_shard, natural_order, shard_positions

AttentionFn = Callable[..., torch.Tensor]
"""``attention_fn(q, k, v, causal=..., scale=...)`` on ``(batch, seq, heads, head_dim)`` tensors (with
``document_ids=...`` too for packed rows)."""


def check_ulysses_heads(sp: int, num_heads: int, num_kv_heads: int, where: str) -> None:
    """Raise a `ValueError` listing the valid ``sp`` when the heads cannot be split over ``sp`` ranks."""
    valid = valid_tp_sizes(num_heads, num_kv_heads) if num_kv_heads and num_heads % num_kv_heads == 0 else []
    if num_heads % sp:
        raise ValueError(
            f"{where}: num_heads={num_heads} does not divide by sp={sp} (Ulysses gives each rank num_heads / sp "
            f"heads); choose sp in {valid}, or use ring attention, which has no such constraint"
        )
    if num_kv_heads % sp and sp % num_kv_heads:
        raise ValueError(
            f"{where}: sp={sp} neither divides num_kv_heads={num_kv_heads} nor is a multiple of it, so a rank's q "
            f"heads would need kv heads of two groups; choose sp in {valid}"
        )


def scatter_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Group, layout: str, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence-sharded q, k, v -> the ``seq_len`` real positions, in order, with this rank's heads (all-to-all)."""
    n = group.size
    if k.shape[2] < n:  # fewer kv heads than ranks: one copy per rank
        k, v = (t.repeat_interleave(n // t.shape[2], dim=2) for t in (k, v))
    q, k, v = (all_to_all_resplit(t, group=group, scatter_dim=2, gather_dim=1) for t in (q, k, v))
    if layout == "zigzag":
        order = natural_order(seq_len, n, layout).to(q.device)
        q, k, v = (t.index_select(1, order) for t in (q, k, v))
    if seq_len != q.shape[1]:
        q, k, v = (t.narrow(1, 0, seq_len) for t in (q, k, v))
    return q, k, v


def gather_heads(out: torch.Tensor, *, group: Group, layout: str, local_len: int) -> torch.Tensor:
    """This rank's heads over the real positions -> this rank's sequence shard with all heads (all-to-all)."""
    n = group.size
    seq_len, total = out.shape[1], n * local_len
    if total != seq_len:
        out = F.pad(out, [0, 0, 0, 0, 0, total - seq_len])
    if layout == "zigzag":
        shard_order = torch.cat([shard_positions(seq_len, n, r, layout) for r in range(n)]).to(out.device)
        out = out.index_select(1, shard_order)
    return all_to_all_resplit(out, group=group, scatter_dim=1, gather_dim=2)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    seq_len: int | None = None,
    attention_fn: AttentionFn | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across ``group``, computed on a head split (module docstring).

    Args:
        q: ``(batch, local_seq, num_heads, head_dim)``: this rank's queries (in the layout's local order).
        k: ``(batch, local_seq, num_kv_heads, head_dim)``: this rank's keys.
        v: this rank's values, shaped like ``k``.
        group: the sequence-parallel group, e.g. ``mesh.group("sp")``; every rank holds ``local_seq`` positions.
        causal: causal mask over global positions. Default ``False``.
        scale: score scale; ``None``: ``1 / sqrt(head_dim)``.
        layout: how the sequence is split, ``"contiguous"`` or ``"zigzag"``. Default ``"contiguous"``.
        seq_len: real tokens in the global sequence (later positions are padding); ``None``: no padding.
        attention_fn: the local attention, called as ``attention_fn(q, k, v, causal=causal, scale=scale)`` on the
            whole sequence and this rank's heads; ``None``: `colo.kernels.flash_attention`.
        document_ids: ``(batch, seq_len)`` (or the padded length) integer document ids of the *whole* sequence, in
            sequence order, the same on every rank: passed on as ``attention_fn(..., document_ids=...)``. ``None``:
            one document per row.

    Returns:
        ``(batch, local_seq, num_heads, head_dim)``: this rank's output rows (zero on padding).

    Raises:
        ValueError: ``num_heads`` not divisible by the group size, kv heads that cannot be assigned, shapes that do
            not fit, a ``seq_len`` that does not match or bad ``document_ids``; raised before any communication.
    """
    group = check_attention_inputs(q, k, v, group, "ulysses_attention")
    check_ulysses_heads(group.size, q.shape[2], k.shape[2], "ulysses_attention")
    local_len = q.shape[1]
    seq_len = check_sequence_shard(local_len, group.size, layout, seq_len, "ulysses_attention")
    documents = {}
    if document_ids is not None:
        total = group.size * local_len
        length = document_ids.shape[1] if isinstance(document_ids, torch.Tensor) and document_ids.dim() == 2 else -1
        shape = (q.shape[0], length if length in (seq_len, total) else seq_len)
        ids = check_document_ids(
            "ulysses_attention", "document_ids (of the whole sequence)", document_ids, shape, q.device
        )
        documents["document_ids"] = ids.narrow(1, 0, seq_len)
    q, k, v = scatter_heads(q, k, v, group=group, layout=layout, seq_len=seq_len)
    out = (attention_fn or flash_attention)(q, k, v, causal=causal, scale=scale, **documents)
    return gather_heads(out, group=group, layout=layout, local_len=local_len)
