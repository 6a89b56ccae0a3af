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
as it cuts the tokens), so attention stays within each document exactly as in the single process. A key chunk
that shares no document with the query chunk in any row is left out of the block step (a step left with none is
skipped), and a key/value block travels only
as far around the ring as the farthest rank that attends to it (`RingPlan`: every rank derives the same plan from
the same ids, so a skipped send is a skipped receive on the other side). With short packed documents most blocks
stay home: a rank computes and receives only what its documents reach.

Sequences that are not a multiple of the number of chunks are padded at the end (`shard_sequence`) and
``seq_len`` tells ring attention where the real tokens stop: padded keys are cut off each block and padded
queries get a zero output and zero gradients.

Communication per call, with ``B`` the bytes of this rank's k and v together and ``d(s)`` the travel of rank ``s``'s
block (`RingPlan.travel`: the ring distance to the farthest rank with a block step on it; ``n - 1`` without
documents or padding): forward, rank ``r`` sends its block at step ``t`` (the block of rank ``r - t``) when
``d(r - t) > t``, ``n - 1`` sends of ``B`` in the unmasked case. Backward, the blocks travel again as in the forward,
and the fp32 dK/dV accumulator of block ``s`` (``B * 4 / element_size``) follows it: from each rank that holds the
block to the next while the block travels on, and from the last one (``d(s) > 0``) straight back to ``s``, so
``sum_s d(s)`` accumulator sends in all (``n`` per rank in the unmasked case). Every send has its matching receive
of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

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


Span = tuple[int, int, list[tuple[int, int]], bool]
"""A block step in positions: (query offset, query length, [(key offset, key length)], causal), local offsets."""


@dataclass(frozen=True)
class RingPlan:
    """What every rank of the ring computes and sends, derived alike on every rank from the geometry and the
    document ids (so each skipped send is a skipped receive on the other side).

    Attributes:
        steps: ``steps[(rank, source)]``: the block steps `Span` rank ``rank`` computes on rank ``source``'s block
            (padding cut off; key chunks that share no document with the query chunk in any row left out).
        travel: ``travel[s]``: how many ring hops rank ``s``'s block makes, the ring distance ``(r - s) mod n`` of
            the farthest rank ``r`` with a step on it (0: it stays home).
    """

    steps: dict[tuple[int, int], list[Span]]
    travel: tuple[int, ...]

    def holds(self, rank: int, step: int) -> bool:
        """Whether ``rank`` holds, at ring step ``step``, the block of rank ``rank - step``."""
        n = len(self.travel)
        return step <= self.travel[(rank - step) % n]

    def forwards(self, rank: int, step: int) -> bool:
        """Whether ``rank`` sends the block it holds at ``step`` on to ``rank + 1``."""
        n = len(self.travel)
        return step < self.travel[(rank - step) % n]


def ring_plan(
    num_shards: int, chunk_len: int, seq_len: int, *, causal: bool, layout: str, document_ids: torch.Tensor | None
) -> RingPlan:
    """The `RingPlan` of ring attention over ``num_shards`` ranks (chunks of ``chunk_len`` positions, ``seq_len`` real
    tokens); ``document_ids``: the whole (padded) sequence's ids on the CPU, or ``None`` for one document per row."""
    n = num_shards
    valid = {
        rank: [chunk_valid_length(c, chunk_len, seq_len) for c in shard_chunks(n, rank, layout)] for rank in range(n)
    }
    runs = None
    if document_ids is not None:  # each chunk's distinct ids per row (the ids are non-decreasing along a row)
        runs = {}
        for rank in range(n):
            for index, chunk in enumerate(shard_chunks(n, rank, layout)):
                length = valid[rank][index]
                ids = document_ids[:, chunk * chunk_len : chunk * chunk_len + length]
                runs[rank, index] = [torch.unique_consecutive(row) for row in ids]

    def meet(rank: int, query_index: int, source: int, key_index: int) -> bool:
        """Whether, in some row, the query chunk and the key chunk share a document."""
        if runs is None:
            return True
        pairs = zip(runs[rank, query_index], runs[source, key_index], strict=True)
        return any(bool(torch.isin(query_ids, key_ids).any()) for query_ids, key_ids in pairs)

    steps: dict[tuple[int, int], list[Span]] = {}
    for rank in range(n):
        for source in range(n):
            spans = []
            for qi, keys, block_causal in ring_attention_calls(n, rank, source, causal=causal, layout=layout):
                # the diagonal chunk, when visible, is the last and always meets itself: the causal flag holds
                keys = [ki for ki in keys if valid[source][ki] and valid[rank][qi] and meet(rank, qi, source, ki)]
                if keys:
                    key_spans = [(ki * chunk_len, valid[source][ki]) for ki in keys]
                    spans.append((qi * chunk_len, valid[rank][qi], key_spans, block_causal))
            steps[rank, source] = spans
    travel = tuple(max(((r - s) % n for r in range(n) if steps[r, s]), default=0) for s in range(n))
    return RingPlan(steps, travel)


_PLANS = WeakIdKeyDictionary()
"""The plans made for a ``document_ids`` tensor (the same one reaches every layer of a forward): made once, not per
layer, and without a device-to-host copy of the ids per layer."""


def _cached_plan(n: int, chunk_len: int, seq_len: int, causal: bool, layout: str, document_ids) -> RingPlan:
    key = (n, chunk_len, seq_len, causal, layout)
    if document_ids is None:
        return _plain_plan(*key)
    plans = _PLANS.get(document_ids)
    if plans is None or plans[0] != document_ids._version:
        plans = _PLANS[document_ids] = (document_ids._version, {})
    if key not in plans[1]:
        plans[1][key] = ring_plan(n, chunk_len, seq_len, causal=causal, layout=layout, document_ids=document_ids.cpu())
    return plans[1][key]


_PLAIN_PLANS: dict[tuple, RingPlan] = {}


def _plain_plan(n: int, chunk_len: int, seq_len: int, causal: bool, layout: str) -> RingPlan:
    key = (n, chunk_len, seq_len, causal, layout)
    if key not in _PLAIN_PLANS:
        _PLAIN_PLANS[key] = ring_plan(n, chunk_len, seq_len, causal=causal, layout=layout, document_ids=None)
    return _PLAIN_PLANS[key]


class _Ring:
    """Geometry shared by forward and backward: chunk length, the plan, the document ids of each block step."""

    def __init__(self, group: Group, local_len: int, seq_len: int, causal: bool, layout: str, document_ids=None,
                 plan_key=None):  # fmt: skip
        self.n, self.rank = group.size, group.rank
        self.group, self.causal, self.layout = group, causal, layout
        self.chunk_len = local_len // (1 if layout == "contiguous" else 2)
        self.seq_len = seq_len
        self.document_ids = document_ids  # (batch, padded global length) or None
        self.plan = _cached_plan(self.n, self.chunk_len, seq_len, causal, layout, plan_key)

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

    def calls(self, source: int) -> list[Span]:
        """The block steps of this rank on the block of ``source`` (`RingPlan.steps`)."""
        return self.plan.steps[self.rank, source]

    def source(self, step: int) -> int:
        return (self.rank - step) % self.n

    def shift_block(self, kv: torch.Tensor, step: int):
        """Post the send of the block held at ``step`` to the next rank and the receive of the previous rank's, each
        where the plan has the block travel on; the handle (``None`` when neither)."""
        ops = []
        if self.plan.forwards(self.rank, step):
            ops.append(P2POp.send(kv, (self.rank + 1) % self.n))
        if self.plan.forwards((self.rank - 1) % self.n, step):
            ops.append(P2POp.recv(torch.empty_like(kv), (self.rank - 1) % self.n))
        return batch_send_recv(ops, group=self.group, async_op=True) if ops else None

    def shift_gradient(self, dkv: torch.Tensor | None, step: int):
        """After ``step``'s block steps: send the block's dK/dV accumulator ``dkv`` on (to the next rank while the
        block travels on, else home to its owner), receive the previous rank's for the next step's block and, at
        ``step == travel[rank]``, this rank's own accumulator coming home. Returns ``(handle, receives)``: the
        handle (``None`` when nothing moves) and which of ``("next", "home")`` its received tensors are, in order."""
        n, rank, plan = self.n, self.rank, self.plan
        ops, receives = [], []
        source = self.source(step)
        if dkv is not None and plan.travel[source] > 0:
            ops.append(P2POp.send(dkv, (rank + 1) % n if plan.forwards(rank, step) else source))
        if plan.forwards((rank - 1) % n, step):
            ops.append(P2POp.recv(torch.empty_like(self._template), (rank - 1) % n))
            receives.append("next")
        if step > 0 and step == plan.travel[rank]:
            ops.append(P2POp.recv(torch.empty_like(self._template), (rank + step) % n))
            receives.append("home")
        handle = batch_send_recv(ops, group=self.group, async_op=True) if ops else None
        return handle, receives


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
    """Forward: p2p ring shift of the key/value blocks (as far as the plan has each travel, each shift posted
    before computing on the block at hand) with an online-softmax merge. Backward: the blocks travel again and
    their dK/dV accumulators follow them, the last holder of each sending it home."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, seq_len, backend, document_ids, plan_key):
        ring = _Ring(group, q.shape[1], seq_len, causal, layout, document_ids, plan_key)
        kv = torch.stack([k, v])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(ring.n):
            handle = ring.shift_block(kv, step)  # next block in flight while this one computes
            source = ring.source(step)
            # not holding the block of this step (it went no farther than the rank before): no block step on it
            for q_offset, q_len, spans, block_causal in ring.calls(source) if ring.plan.holds(ring.rank, step) else ():
                keys, values = _keys(kv, spans)
                block_out, block_lse = attention_block_forward(
                    q.narrow(1, q_offset, q_len), keys, values, causal=block_causal, scale=scale, backend=backend,
                    **ring.documents(source, q_offset, q_len, spans),
                )  # fmt: skip
                rows = slice(q_offset, q_offset + q_len)
                out[:, rows], lse[:, :, rows] = _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
            if handle is not None:
                received = handle.wait()
                if received:
                    kv = received[0]
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
        ring._template = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = None  # this rank's block's accumulator once it is home
        incoming = None  # the accumulator of the block this rank holds next, from the rank before
        for step in range(ring.n):
            holds = ring.plan.holds(ring.rank, step)
            kv_handle = ring.shift_block(kv, step)
            dkv = None
            if holds:
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                source = ring.source(step)
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
                if incoming is not None:
                    dkv += incoming  # what the ranks before added for this block
                if step == 0 and ring.plan.travel[ring.rank] == 0:
                    own = dkv  # this rank's block stayed home: its accumulator is complete
            incoming = None
            dkv_handle, receives = ring.shift_gradient(dkv, step)
            if dkv_handle is not None:
                for kind, tensor in zip(receives, dkv_handle.wait(), strict=True):
                    if kind == "next":
                        incoming = tensor
                    else:
                        own = tensor
            if kv_handle is not None:
                received = kv_handle.wait()
                if received:
                    kv = received[0]
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None, None, None, None


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
    padded_ids = check_global_document_ids(document_ids, q, group.size, seq_len, "ring_attention")
    plan_key = document_ids if isinstance(document_ids, torch.Tensor) else padded_ids  # the same tensor every layer
    return RingAttentionFunction.apply(
        q, k, v, group, bool(causal), scale, layout, seq_len, backend, padded_ids, plan_key
    )


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
