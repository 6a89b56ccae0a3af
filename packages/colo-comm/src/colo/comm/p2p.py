"""Point-to-point: send/recv, their async forms, and batched p2p (the pipeline's transport).

Peers are group ranks: ``dst=1`` on ``mesh.group("pp")`` is the next stage of this rank's pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import _check_group_rank, _check_tensor, _member_group, _nbytes
from .group import Group
from .handle import issue
from .tracker import record


@dataclass(frozen=True)
class P2POp:
    """One send or receive in a `batch_send_recv`.

    Attributes:
        kind: ``"send"`` or ``"recv"``.
        tensor: the tensor sent, or the (contiguous) buffer received into.
        peer: the other side's group rank.
    """

    kind: str
    tensor: torch.Tensor
    peer: int

    @classmethod
    def send(cls, tensor: torch.Tensor, dst: int) -> P2POp:
        """Send ``tensor`` to group rank ``dst``."""
        return cls("send", tensor, dst)

    @classmethod
    def recv(cls, tensor: torch.Tensor, src: int) -> P2POp:
        """Receive into ``tensor`` from group rank ``src``."""
        return cls("recv", tensor, src)


def _check_p2p(op: str, tensor: torch.Tensor, peer: int, peer_name: str, group: Group) -> None:
    _check_tensor(tensor, op)
    _check_group_rank(op, peer_name, peer, group)
    if peer == group.rank:
        raise ValueError(f"{op}: {peer_name}={peer} is this rank itself in group {group.describe()}; pick another rank")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: tensor must be contiguous; pass tensor.contiguous()")


def isend(tensor: torch.Tensor, *, dst: int, group: Group | dist.ProcessGroup | None = None):
    """Start sending ``tensor`` to group rank ``dst``; returns a `Handle`."""
    group = _member_group(group, "send")
    _check_p2p("send", tensor, dst, "dst", group)
    record("send", group.name, group.size, tensor.dtype, _nbytes(tensor), _nbytes(tensor), "native")
    return issue(
        "send",
        group,
        lambda: [dist.isend(tensor, dst=group.global_rank(dst), group=group.process_group)],
        None,
        True,
        lambda: f"of {tuple(tensor.shape)} {tensor.dtype} to group rank {dst}",
        nbytes=_nbytes(tensor),
    )


def irecv(tensor: torch.Tensor, *, src: int, group: Group | dist.ProcessGroup | None = None):
    """Start receiving into ``tensor`` from group rank ``src``; returns a `Handle` whose ``wait()`` returns it."""
    group = _member_group(group, "recv")
    _check_p2p("recv", tensor, src, "src", group)
    record("recv", group.name, group.size, tensor.dtype, _nbytes(tensor), _nbytes(tensor), "native")
    return issue(
        "recv",
        group,
        lambda: [dist.irecv(tensor, src=group.global_rank(src), group=group.process_group)],
        lambda: tensor,
        True,
        lambda: f"of {tuple(tensor.shape)} {tensor.dtype} from group rank {src}",
        nbytes=_nbytes(tensor),
    )


def send(tensor: torch.Tensor, *, dst: int, group: Group | dist.ProcessGroup | None = None) -> None:
    """Send ``tensor`` to group rank ``dst`` and wait until it has gone."""
    isend(tensor, dst=dst, group=group).wait()


def recv(tensor: torch.Tensor, *, src: int, group: Group | dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive into ``tensor`` from group rank ``src``; returns ``tensor``."""
    return irecv(tensor, src=src, group=group).wait()


def batch_send_recv(ops: list[P2POp], *, group: Group | dist.ProcessGroup | None = None, async_op: bool = False):
    """Run several sends and receives together (``torch.distributed.batch_isend_irecv``).

    Both sides of each pair must list their matching operations in the same order. Batching avoids the
    deadlock of two ranks that both send first with blocking calls.

    Returns:
        The received tensors, in the order of the receive ops (or a `Handle` whose ``wait()`` returns them).
    """
    group = _member_group(group, "batch_send_recv")
    if not ops:
        raise ValueError("batch_send_recv: ops is empty; pass at least one P2POp")
    torch_ops = []
    for op in ops:
        if not isinstance(op, P2POp) or op.kind not in ("send", "recv"):
            raise TypeError(f"batch_send_recv: ops must be P2POp.send(...) / P2POp.recv(...), got {op!r}")
        _check_p2p(op.kind, op.tensor, op.peer, "dst" if op.kind == "send" else "src", group)
        nbytes = _nbytes(op.tensor)
        record(op.kind, group.name, group.size, op.tensor.dtype, nbytes, nbytes, "batched")
        function = dist.isend if op.kind == "send" else dist.irecv
        torch_ops.append(dist.P2POp(function, op.tensor, group.global_rank(op.peer), group.process_group))
    received = [op.tensor for op in ops if op.kind == "recv"]

    def summary() -> str:
        return ", ".join(
            f"{op.kind} {tuple(op.tensor.shape)} {'to' if op.kind == 'send' else 'from'} {op.peer}" for op in ops
        )

    return issue(
        "batch_send_recv",
        group,
        lambda: list(dist.batch_isend_irecv(torch_ops)),
        lambda: received,
        async_op,
        lambda: f"[{summary()}]",
        nbytes=sum(_nbytes(op.tensor) for op in ops),
    )
