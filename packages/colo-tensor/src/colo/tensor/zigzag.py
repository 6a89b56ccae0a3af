"""How a sequence is split over the ranks of a sequence-parallel axis: the contiguous and the zigzag layout.

The sequence is padded at its end to a multiple of the number of chunks and cut into equal chunks:

- ``"contiguous"``: ``n`` chunks, rank ``r`` holds chunk ``r`` (Megatron sequence parallelism, Ulysses).
- ``"zigzag"``: ``2n`` chunks, rank ``r`` holds chunks ``r`` and ``2n - 1 - r``, in that order (the
  load-balanced split of causal ring attention: an early chunk, whose queries see few keys, pairs with a late
  one, whose queries see many, so every rank has the same attention work).

Padding sits at the end of the global sequence, so the real tokens of every chunk are a prefix of it. Attention
treats positions ``>= seq_len`` as absent (masked keys, zero outputs); the rest of a model is position-wise and
needs only a loss that ignores them. With ``seq_len`` a multiple of the number of chunks there is no padding.

Positions are the ones a rotary embedding must use on a rank: `shard_positions` gives them. The input checks
shared by `ulysses_attention` and `ring_attention` live here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colo.comm import Group

from .comm_ops import all_gather_reduce_scatter, all_gather_split

SEQUENCE_LAYOUTS = ("contiguous", "zigzag")
"""The supported sequence layouts."""


def check_layout(layout: object, where: str) -> str:
    """Return ``layout`` if it is one of `SEQUENCE_LAYOUTS`, else raise a `ValueError` naming ``where``."""
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"{where}: layout={layout!r} is not a sequence layout; use one of {SEQUENCE_LAYOUTS}")
    return layout


def num_sequence_chunks(num_shards: int, layout: str) -> int:
    """Chunks the sequence is cut into: ``num_shards`` (contiguous) or ``2 * num_shards`` (zigzag)."""
    check_layout(layout, "num_sequence_chunks")
    return num_shards if layout == "contiguous" else 2 * num_shards


def shard_chunks(num_shards: int, rank: int, layout: str) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in its local order: ``(rank,)`` or ``(rank, 2 * num_shards - 1 - rank)``."""
    if not 0 <= rank < num_shards:
        raise ValueError(f"shard_chunks: rank={rank} must be in [0, {num_shards})")
    if check_layout(layout, "shard_chunks") == "contiguous":
        return (rank,)
    return (rank, 2 * num_shards - 1 - rank)


def padded_seq_len(seq_len: int, num_shards: int, layout: str) -> int:
    """``seq_len`` rounded up to a multiple of the number of chunks (`num_sequence_chunks`)."""
    chunks = num_sequence_chunks(num_shards, layout)
    return -(-int(seq_len) // chunks) * chunks


def chunk_valid_length(chunk: int, chunk_len: int, seq_len: int) -> int:
    """How many of chunk ``chunk``'s ``chunk_len`` positions are real tokens (``< seq_len``): a prefix of it."""
    return max(0, min(chunk_len, seq_len - chunk * chunk_len))


def shard_positions(seq_len: int, num_shards: int, rank: int, layout: str) -> torch.Tensor:
    """Positions in the padded sequence that rank ``rank`` holds, in its local order (``>= seq_len``: padding).

    Args:
        seq_len: length of the global sequence (real tokens).
        num_shards: ranks of the sequence-parallel axis.
        rank: this rank on that axis.
        layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
        A 1-D ``int64`` tensor of ``padded_seq_len(...) / num_shards`` positions.
    """
    chunk_len = padded_seq_len(seq_len, num_shards, layout) // num_sequence_chunks(num_shards, layout)
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len) for c in shard_chunks(num_shards, rank, layout)])


def _dim(x: torch.Tensor, dim: int, where: str) -> int:
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{where}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard_sequence(
    x: torch.Tensor, *, num_shards: int, rank: int, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """This rank's piece of a full sequence: padded with zeros at the end, then its chunks (no communication).

    Differentiable (the gradient of the piece flows back to its positions of ``x``).

    Args:
        x: the full sequence, e.g. ``(batch, seq, ...)``.
        num_shards: ranks of the sequence-parallel axis (``mesh.size("sp")``).
        rank: this rank on that axis (``mesh.rank("sp")``).
        layout: ``"contiguous"`` or ``"zigzag"``. Default ``"zigzag"``.
        dim: the sequence dimension. Default ``1``.

    Returns:
        ``x`` with ``dim`` replaced by this rank's ``padded_seq_len(seq, num_shards, layout) / num_shards``
        positions (`shard_positions`).
    """
    dim = _dim(x, dim, "shard_sequence")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"shard_sequence: num_shards={num_shards!r} must be a positive int (the sp axis size)")
    seq_len = x.shape[dim]
    positions = shard_positions(seq_len, num_shards, rank, layout).to(x.device)
    padding = padded_seq_len(seq_len, num_shards, layout) - seq_len
    if padding:
        x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, padding])
    return x.index_select(dim, positions)


def natural_order(seq_len: int, num_shards: int, layout: str) -> torch.Tensor:
    """Indices that put the shards, concatenated in rank order, back in sequence order (the padded sequence)."""
    if check_layout(layout, "natural_order") == "contiguous":
        return torch.arange(padded_seq_len(seq_len, num_shards, layout))
    order = torch.cat([shard_positions(seq_len, num_shards, r, layout) for r in range(num_shards)])
    return torch.argsort(order)


def gather_sequence(
    x: torch.Tensor,
    *,
    group: Group,
    layout: str = "zigzag",
    seq_len: int | None = None,
    dim: int = 1,
    sum_grad: bool = False,
) -> torch.Tensor:
    """The full sequence from every rank's piece: all-gather along ``dim``, back into order, padding dropped.

    By default the gradient of the result is taken to be replicated (every rank computes the same thing from it):
    the backward keeps this rank's positions, without communication (`all_gather_split`). With ``sum_grad`` the
    backward sums the ranks' gradients of the result and keeps this rank's positions (a reduce-scatter,
    `all_gather_reduce_scatter`): the adjoint when each rank's loss of the result is one term of a sum or mean over
    the group, e.g. a loss every sequence-parallel rank computes whole while data parallelism averages the
    gradients over those ranks.

    Args:
        x: this rank's piece (as `shard_sequence` gives it), the same extent along ``dim`` on every rank.
        group: the sequence-parallel group, e.g. ``mesh.group("sp")``.
        layout: ``"contiguous"`` or ``"zigzag"``. Default ``"zigzag"``.
        seq_len: real tokens in the global sequence; ``None``: all of it (no padding).
        dim: the sequence dimension. Default ``1``.
        sum_grad: reduce-scatter (sum) the gradient instead of keeping this rank's part of it. Default ``False``.

    Returns:
        ``x`` with ``dim`` holding the ``seq_len`` positions in order.
    """
    dim = _dim(x, dim, "gather_sequence")
    check_layout(layout, "gather_sequence")
    n = group.size
    total = n * x.shape[dim]
    seq_len = total if seq_len is None else int(seq_len)
    if padded_seq_len(seq_len, n, layout) != total:
        raise ValueError(
            f"gather_sequence: {n} pieces of {x.shape[dim]} positions do not hold a {layout} split of seq_len="
            f"{seq_len} (that needs {padded_seq_len(seq_len, n, layout) // n} positions a piece); pass the seq_len "
            "the pieces were made from"
        )
    full = all_gather_reduce_scatter(x, group=group, dim=dim) if sum_grad else all_gather_split(x, group=group, dim=dim)
    if layout == "zigzag":
        full = full.index_select(dim, natural_order(seq_len, n, layout).to(full.device))
    return full.narrow(dim, 0, seq_len) if seq_len != total else full


# --- checks shared by the sequence-parallel attention functions -------------------------------------------------


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: object, where: str) -> Group:
    """Validate self-attention inputs on sequence shards, ``(batch, local_seq, heads, head_dim)``; return the group."""
    if not isinstance(group, Group):
        raise TypeError(f"{where}: group must be a colo.comm.Group, e.g. mesh.group('sp'), not {type(group).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be a 4-D (batch, seq, heads, head_dim) tensor, got {shape}")
    if k.shape != v.shape:
        raise ValueError(f"{where}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{where}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, local sequence and head_dim "
            "(self-attention over the same sequence shards)"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{where}: num_heads={q.shape[2]} is not a multiple of num_kv_heads={k.shape[2]}; grouped-query "
            "attention shares each kv head among the same number of query heads"
        )
    return group


def check_sequence_shard(local_len: int, num_shards: int, layout: str, seq_len: int | None, where: str) -> int:
    """Validate a rank's local sequence length against the layout; return the real global length ``seq_len``."""
    check_layout(layout, where)
    if layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"{where}: the local sequence has {local_len} positions, which do not split into the 2 chunks of the "
            "zigzag layout; pad the global sequence to a multiple of 2 * sp (shard_sequence does)"
        )
    total = num_shards * local_len
    if seq_len is None:
        return total
    valid = isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 0
    if not valid or padded_seq_len(seq_len, num_shards, layout) != total:
        raise ValueError(
            f"{where}: seq_len={seq_len!r} does not match {num_shards} shards of {local_len} positions "
            f"({layout}): the padded length of seq_len must be {total}; pass the length before padding"
        )
    return seq_len
