"""Ring attention: key/value blocks go around the sequence-parallel ring while each rank attends to the one it holds.

Ring attention (Liu et al., 2023, https://arxiv.org/abs/2310.01889) keeps every rank's queries at home and
passes the key/value blocks around the ring of the ``sp`` group: in step ``s`` rank ``r`` holds the block of
rank ``r - s``, computes attention of its queries over it with `colo.kernels.attention_block_forward` and
merges the result into its running output with the log-sum-exp (the online softmax of FlashAttention). The
send of the block to rank ``r + 1`` and the receive of the next one from ``r - 1`` are posted before the block
is computed, so communication overlaps computation wherever the backend runs p2p in the background (NCCL; on
gloo the transfer runs on gloo's threads). The backward passes the blocks around again and sends each block's
dK/dV accumulator along with it, every rank adding its queries' share (`attention_block_backward` with the
merged output and log-sum-exp); after ``n`` shifts the accumulator is back at the block's owner.

Causal attention uses the sequence layouts of `colo.tensor.zigzag`. A rank's queries and a block's keys are
each one or two chunks of the sequence, and chunk ``i``'s queries see all of an earlier chunk ``j < i``, their
own chunk under the causal mask and nothing of a later one; every (query chunk, key chunk) pair is computed
once, or skipped when nothing is visible. With the ``"zigzag"`` layout every rank computes the same number of
such pairs (``2n - 1`` full ones and 2 diagonal ones for causal attention); with ``"contiguous"`` rank ``r``
computes ``r`` full ones and 1 diagonal, so the last rank sets the pace.

Packed rows (several documents per row): ``document_ids`` holds the ids of the *whole* sequence, the same on every
rank; each block step gets the ids of its query chunk and of the key chunks it sees (the zigzag split cuts the ids
as it cuts the tokens), so attention stays within each document exactly as in the single process. A key chunk whose
documents cannot meet the query chunk's in any row (ids are non-decreasing, so each chunk covers one interval of ids
per row, read once per call from the ids' first and last entries per chunk) is left out of the block step, forward
and backward, and a block step left with no key chunk is skipped: every query would have masked all of those keys,
so the output, the log-sum-exp and the gradients are the same as computing them (packed long responses then cost the
attention of their own documents, not of the whole row). The blocks still travel the whole ring: a block passes
through ranks that skip it on its way to ranks that need it.

Sequences that are not a multiple of the number of chunks are padded at the end (`shard_sequence`) and
``seq_len`` tells ring attention where the real tokens stop: padded keys are cut off each block and padded
queries get a zero output and zero gradients.

Communication per call, with ``B`` the bytes of this rank's k and v together: forward ``n - 1`` sends of ``B``;
backward ``n - 1`` sends of ``B`` and ``n`` sends of the dK/dV accumulators (fp32, ``B * 4 / element_size``).
Every send has its matching receive of the same size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Group, P2POp, batch_send_recv
from colo.kernels import attention_block_backward, attention_block_forward
from colo.kernels.document_mask import check_document_ids

from .zigzag import check_attention_inputs, check_layout, check_sequence_shard, chunk_valid_length, shard_chunks

Call = tuple[int, tuple[int, ...], bool]
"""One block step: (local index of the query chunk, local indices of the visible key chunks, causal)."""


def ring_attention_calls(num_shards: int, rank: int, source: int, *, causal: bool, layout: str) -> list[Call]:
    """The block steps rank ``rank`` computes on the key/value block of rank ``source`` (no padding considered).

    Each query chunk of ``rank`` attends, in one call, to the key chunks of ``source`` it can see, in sequence
    order; the call is causal when the last of them is its own chunk (the diagonal).
    """
    query_chunks = shard_chunks(num_shards, rank, layout)
    key_chunks = shard_chunks(num_shards, source, layout)
    calls = []
    for qi, query_chunk in enumerate(query_chunks):
        order = sorted(range(len(key_chunks)), key=lambda ki: key_chunks[ki])
        visible = tuple(ki for ki in order if not causal or key_chunks[ki] <= query_chunk)
        if visible:
            calls.append((qi, visible, causal and key_chunks[visible[-1]] == query_chunk))
    return calls


class _Ring:
    """Geometry shared by forward and backward: chunk length, real lengths and the calls of every step."""

    def __init__(self, group: Group, local_len: int, seq_len: int, causal: bool, layout: str, document_ids=None):
        self.n, self.rank = group.size, group.rank
        self.group, self.causal, self.layout = group, causal, layout
        self.chunk_len = local_len // (1 if layout == "contiguous" else 2)
        self.seq_len = seq_len
        self.document_ids = document_ids  # (batch, padded global length) or None
        self.chunk_ids = None  # (batch, chunks, 2): first and last document id of every chunk, on the host
        if document_ids is not None:
            chunks = self.n * (1 if layout == "contiguous" else 2)
            ids = document_ids[:, : chunks * self.chunk_len].reshape(document_ids.shape[0], chunks, self.chunk_len)
            self.chunk_ids = torch.stack([ids[..., 0], ids[..., -1]], dim=-1).cpu()

    def meets(self, query_chunk: int, key_chunk: int) -> bool:
        """Whether some row has a document in both chunks (their id intervals overlap; always, without ids)."""
        if self.chunk_ids is None:
            return True
        query, key = self.chunk_ids[:, query_chunk], self.chunk_ids[:, key_chunk]
        return bool(((key[:, 1] >= query[:, 0]) & (key[:, 0] <= query[:, 1])).any())

    def documents(self, source: int, q_offset: int, q_len: int, spans: list[tuple[int, int]]) -> dict:
        """The block step's ``query_document_ids`` and ``document_ids`` (keys), sliced from the global ids."""
        if self.document_ids is None:
            return {}

        def ids(owner: int, offset: int, length: int) -> torch.Tensor:
            chunk = shard_chunks(self.n, owner, self.layout)[offset // self.chunk_len]
            return self.document_ids.narrow(1, chunk * self.chunk_len + offset % self.chunk_len, length)

        keys = [ids(source, offset, length) for offset, length in spans]
        return {
            "query_document_ids": ids(self.rank, q_offset, q_len),
            "document_ids": keys[0] if len(keys) == 1 else torch.cat(keys, dim=1),
        }

    def valid(self, owner: int) -> list[int]:
        """Real length of each of ``owner``'s chunks (a prefix of it)."""
        return [chunk_valid_length(c, self.chunk_len, self.seq_len) for c in shard_chunks(self.n, owner, self.layout)]

    def calls(self, source: int) -> list[tuple[int, int, list[tuple[int, int]], bool]]:
        """``(query offset, query length, [(key offset, key length)], causal)`` for the block of ``source``."""
        query_valid, key_valid = self.valid(self.rank), self.valid(source)
        query_chunks, key_chunks = (shard_chunks(self.n, owner, self.layout) for owner in (self.rank, source))
        out = []
        for qi, keys, causal in ring_attention_calls(self.n, self.rank, source, causal=self.causal, layout=self.layout):
            # the diagonal (causal) chunk always meets its own queries, so it is never the one left out
            keys = [ki for ki in keys if key_valid[ki] and self.meets(query_chunks[qi], key_chunks[ki])]
            spans = [(ki * self.chunk_len, key_valid[ki]) for ki in keys]
            if query_valid[qi] and spans:
                out.append((qi * self.chunk_len, query_valid[qi], spans, causal))
        return out

    def shift(self, tensor: torch.Tensor):
        """Post the send of ``tensor`` to the next rank and the receive of its neighbour's; returns the handle."""
        received = torch.empty_like(tensor)
        ops = [P2POp.send(tensor, (self.rank + 1) % self.n), P2POp.recv(received, (self.rank - 1) % self.n)]
        return batch_send_recv(ops, group=self.group, async_op=True)


def _keys(kv: torch.Tensor, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(spans) == 1:
        offset, length = spans[0]
        return kv[0].narrow(1, offset, length), kv[1].narrow(1, offset, length)
    return tuple(torch.cat([kv[i].narrow(1, o, n) for o, n in spans], dim=1) for i in (0, 1))


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Online-softmax merge of a block's ``(out, lse)`` into the running ones (fp32); rows seeing no key stay 0."""
    merged = torch.logaddexp(lse, block_lse)
    shift = torch.where(merged == float("-inf"), 0.0, merged)
    old = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    new = torch.exp(block_lse - shift).transpose(1, 2).unsqueeze(-1)
    return out * old + block_out.float() * new, merged


class RingAttentionFunction(torch.autograd.Function):
    """Forward: p2p ring shift of the key/value blocks (``n - 1`` shifts, each posted before computing on the block
    at hand) with an online-softmax merge. Backward: p2p ring shift of the key/value blocks again (``n - 1``) and of
    their dK/dV accumulators (``n`` shifts; the last one brings each accumulator home)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, seq_len, backend, document_ids):
        ring = _Ring(group, q.shape[1], seq_len, causal, layout, document_ids)
        kv = torch.stack([k, v])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(ring.n):
            handle = ring.shift(kv) if step < ring.n - 1 else None  # next block in flight while this one computes
            source = (ring.rank - step) % ring.n
            for q_offset, q_len, spans, block_causal in ring.calls(source):
                keys, values = _keys(kv, spans)
                block_out, block_lse = attention_block_forward(
                    q.narrow(1, q_offset, q_len), keys, values, causal=block_causal, scale=scale, backend=backend,
                    **ring.documents(source, q_offset, q_len, spans),
                )  # fmt: skip
                rows = slice(q_offset, q_offset + q_len)
                out[:, rows], lse[:, :, rows] = _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
            if handle is not None:
                kv = handle.wait()[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.backend = ring, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, backend = ctx.ring, ctx.scale, ctx.backend
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_handle = None
        for step in range(ring.n):
            kv_handle = ring.shift(kv) if step < ring.n - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            source = (ring.rank - step) % ring.n
            for q_offset, q_len, spans, block_causal in ring.calls(source):
                keys, values = _keys(kv, spans)
                rows = slice(q_offset, q_offset + q_len)
                block_dq, block_dk, block_dv = attention_block_backward(
                    dout[:, rows], q[:, rows], keys, values, out[:, rows], lse[:, :, rows],
                    causal=block_causal, scale=scale, backend=backend,
                    **ring.documents(source, q_offset, q_len, spans),
                )  # fmt: skip
                dq[:, rows] += block_dq
                start = 0
                for offset, length in spans:
                    dkv[0, :, offset : offset + length] += block_dk.narrow(1, start, length)
                    dkv[1, :, offset : offset + length] += block_dv.narrow(1, start, length)
                    start += length
            if dkv_handle is not None:
                dkv += dkv_handle.wait()[0]  # what the ranks before added for this block
            if ring.n > 1:
                dkv_handle = ring.shift(dkv)
            if kv_handle is not None:
                kv = kv_handle.wait()[0]
        if dkv_handle is not None:
            dkv = dkv_handle.wait()[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None


def check_global_document_ids(
    document_ids, q: torch.Tensor, num_shards: int, seq_len: int, where: str
) -> torch.Tensor | None:
    """Validate the whole sequence's document ids, ``(batch, seq_len)`` or ``(batch, padded length)``, the same on
    every rank; return them padded to the padded length (the padding repeats the last id: it is never attended)."""
    if document_ids is None:
        return None
    total = num_shards * q.shape[1]
    length = document_ids.shape[1] if isinstance(document_ids, torch.Tensor) and document_ids.dim() == 2 else -1
    shape = (q.shape[0], length if length in (seq_len, total) else seq_len)
    ids = check_document_ids(where, "document_ids (of the whole sequence)", document_ids, shape, q.device)
    if ids.shape[1] < total:
        ids = (
            F.pad(ids, (0, total - ids.shape[1]), mode="replicate")
            if ids.shape[1]
            else ids.new_zeros(ids.shape[0], total)
        )
    return ids


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "zigzag",
    seq_len: int | None = None,
    backend: str | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across ``group``: each rank's queries over every rank's keys (module docstring).

    Args:
        q: ``(batch, local_seq, num_heads, head_dim)``: this rank's queries, in the layout's local order (as
            `shard_sequence` cuts them).
        k: ``(batch, local_seq, num_kv_heads, head_dim)``: this rank's keys; ``num_heads`` a multiple of
            ``num_kv_heads`` (grouped-query attention).
        v: this rank's values, shaped like ``k``.
        group: the sequence-parallel group, e.g. ``mesh.group("sp")``; every rank holds ``local_seq`` positions.
        causal: causal mask over global positions. Default ``False``.
        scale: score scale; ``None``: ``1 / sqrt(head_dim)``.
        layout: ``"zigzag"`` (load-balanced for causal attention) or ``"contiguous"``. Default ``"zigzag"``.
        seq_len: real tokens in the global sequence (positions from ``seq_len`` on are padding); ``None``: no
            padding.
        backend: `colo.kernels` backend of the block steps (``None``: its dispatcher).
        document_ids: ``(batch, seq_len)`` (or the padded length) integer document ids of the *whole* sequence,
            in sequence order, the same on every rank, non-decreasing per row: attention stays within each document
            (`colo.kernels.document_mask`). ``None``: one document per row.

    Returns:
        ``(batch, local_seq, num_heads, head_dim)``, this rank's output rows (zero on padding).

    Raises:
        ValueError: shapes that do not fit, a local sequence that does not split into the layout's chunks, a
            ``seq_len`` that does not match, or bad ``document_ids``; raised before any communication.
    """
    group = check_attention_inputs(q, k, v, group, "ring_attention")
    seq_len = check_sequence_shard(q.shape[1], group.size, layout, seq_len, "ring_attention")
    document_ids = check_global_document_ids(document_ids, q, group.size, seq_len, "ring_attention")
    return RingAttentionFunction.apply(q, k, v, group, bool(causal), scale, layout, seq_len, backend, document_ids)


class RingAttentionCore(nn.Module):
    """An attention core (``module(q, k, v)`` on ``(batch, seq, heads, head_dim)``) that runs `ring_attention`.

    What the `RingAttention` style puts in place of a model's attention core; no parameters.

    Args:
        group: the sequence-parallel group.
        causal: causal mask over global positions.
        scale: score scale; ``None``: ``1 / sqrt(head_dim)``.
        layout: ``"zigzag"`` or ``"contiguous"``. Default ``"zigzag"``.
        backend: `colo.kernels` backend of the block steps (``None``: its dispatcher).
    """

    def __init__(
        self,
        *,
        group: Group,
        causal: bool,
        scale: float | None = None,
        layout: str = "zigzag",
        backend: str | None = None,
    ):
        super().__init__()
        self.group, self.causal, self.scale = group, bool(causal), scale
        self.layout, self.backend = check_layout(layout, "RingAttentionCore"), backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's attention output rows, ``(batch, local_seq, num_heads, head_dim)``; ``document_ids``: the
        whole sequence's (see `ring_attention`)."""
        return ring_attention(
            q, k, v, group=self.group, causal=self.causal, scale=self.scale, layout=self.layout, backend=self.backend,
            document_ids=document_ids,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}, layout={self.layout!r}, sp={self.group.size}"
