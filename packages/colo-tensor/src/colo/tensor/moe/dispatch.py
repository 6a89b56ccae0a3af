"""Expert-parallel dispatch and combine over an ``ep`` group: all-to-all with uneven splits.

Experts are split over the ``ep`` ranks in contiguous blocks: rank ``r`` holds global experts
``r * E / ep .. (r + 1) * E / ep - 1``. Each rank routes and permutes its own tokens (rows grouped by global
expert, `colo.tensor.moe.permute`), then:

1. the per-expert row counts are exchanged first (an all-to-all of ``(ep, E / ep)`` int64 counts), so every rank
   knows how many rows it receives from each rank for each of its experts;
2. dispatch: an all-to-all sends each rank the rows for its experts (uneven splits);
3. the received rows, ordered by (source rank, local expert), are regrouped by local expert for the experts;
4. combine: the outputs go back in (source, expert) order by the reverse all-to-all, to be unpermuted locally.

Communication per rank and forward, for hidden size ``H`` and element size ``b``: ``8 (ep - 1) E / ep`` bytes of
counts, ``(sent - sent to self) H b`` for dispatch and ``(received - received from self) H b`` for combine; the
backward moves the same two volumes again, each in the other direction (`dispatch_bytes`).
"""

from __future__ import annotations

import torch

from colo.comm import Group, all_to_all


class AllToAllRows(torch.autograd.Function):
    """Forward: all-to-all of rows with uneven splits (``send_splits[i]`` rows to rank ``i``, ``recv_splits[i]``
    from it). Backward: the reverse all-to-all of the gradient (splits swapped)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: Group, send_splits: list[int], recv_splits: list[int]):
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        return all_to_all(rows.contiguous(), group=group, input_split_sizes=send_splits, output_split_sizes=recv_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = all_to_all(
            grad.contiguous(), group=ctx.group, input_split_sizes=ctx.recv_splits, output_split_sizes=ctx.send_splits
        )
        return back, None, None, None


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """``(ep, E / ep)`` counts received: row ``s`` holds how many rows rank ``s`` sends for each local expert, from
    this rank's ``(E,)`` per-global-expert ``counts``."""
    ep = group.size
    return all_to_all(counts.view(ep, -1).contiguous(), group=group)


def _expert_major_order(received_counts: torch.Tensor) -> torch.Tensor:
    """Indices that regroup rows ordered (source, local expert) into (local expert, source) order, stably."""
    ep, local = received_counts.shape
    segments = torch.arange(ep * local, device=received_counts.device)
    segment_of_row = torch.repeat_interleave(segments, received_counts.reshape(-1))
    source, expert = segment_of_row // local, segment_of_row % local
    return torch.argsort(expert * ep + source, stable=True)


def expert_parallel(rows: torch.Tensor, counts: torch.Tensor, experts, group: Group) -> torch.Tensor:
    """Run ``experts`` (``fn(rows, local_counts) -> rows``) on rows grouped by global expert, over the ``ep`` group
    (see the module docstring); returns their outputs in the order of ``rows``."""
    received_counts = exchange_counts(counts, group)
    send_splits = counts.view(group.size, -1).sum(dim=1).tolist()
    recv_splits = received_counts.sum(dim=1).tolist()
    received = AllToAllRows.apply(rows, group, send_splits, recv_splits)
    order = _expert_major_order(received_counts)
    out = experts(received[order], received_counts.sum(dim=0))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return AllToAllRows.apply(out[inverse], group, recv_splits, send_splits)


def dispatch_bytes(
    send_splits: list[int], recv_splits: list[int], *, rank: int, hidden_size: int, element_size: int, backward: bool
) -> int:
    """All-to-all bytes of rows one rank moves in one MoE block's forward (and backward, with ``backward``):
    dispatch and combine (module docstring), as `colo.comm.CommTracker` counts them; the counts exchange adds
    ``8 (ep - 1) E / ep``."""
    ep = len(send_splits)
    sent = (sum(send_splits) - send_splits[rank]) * hidden_size * element_size
    received = (sum(recv_splits) - recv_splits[rank]) * hidden_size * element_size
    return 0 if ep == 1 else (sent + received) * (2 if backward else 1)
