"""The collectives inside ``torch.compile``'d code: torch's functional collectives, which dynamo puts in the graph.

Around each backend call, colo's eager path runs Python per call: the `Handle`, the clock `translate_errors` starts
for hang reports (``time.monotonic``), profiler regions, `CommTracker` records and the ``COLO_DEBUG_CHECKS``
exchanges. Dynamo cannot record any of these in a graph and breaks it at each one, and it cannot trace an
asynchronous ``torch.distributed`` call at all. So while dynamo traces (`compiling`), the collectives of
`colo.comm.collectives` validate their input as in eager and then run the functions here, which the graph holds
as ``_c10d_functional`` ops (asynchronous in the compiled program: the compiler places each wait).

Numerics are eager's: gathers and all-to-alls move bits; a reduce-scatter takes the form eager's algorithm table
chooses for its size (`colo.comm.algorithms`), reducing the same copies in the same order (the ``p2p`` form as an
all-to-all, which delivers the same copies). What a compiled region does not have: its calls are not counted by a
`CommTracker` (their volume is the eager formula's: measure an eager step), `last_collective` does not name them,
a backend failure inside one is torch's error rather than a `CommError`, and ``COLO_DEBUG_CHECKS`` does not exchange
their arguments (run the eager model once with it to check them).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from .group import Group

TRACEABLE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
"""Whether compiled code uses the functions here (torch 2.13 and newer). Under torch 2.11, tensor-parallel blocks
compiled through them trained with wrong gradients (a tp2 Llama's loss off by 4.5e-3 at its third step, the forward
right: the all-reduces in the parallel layers' backward did not take effect; the cause in torch was not established),
so older torch keeps eager collectives, which break the graph around them, as before."""


def compiling() -> bool:
    """Whether dynamo is tracing the caller (``torch.compiler.is_compiling``) on a torch where the functions here are
    used in compiled code (`TRACEABLE`)."""
    return TRACEABLE and torch.compiler.is_compiling()


def all_reduce(tensor: torch.Tensor, op: str, group: Group) -> torch.Tensor:
    """`colo.comm.all_reduce` of ``tensor`` in place (``"avg"``: a sum divided by the group size, as in eager)."""
    reduced = funcol.all_reduce(tensor, "sum" if op == "avg" else op, group.process_group)
    tensor.copy_(reduced)
    if op == "avg":
        tensor.div_(group.size)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """`colo.comm.broadcast` from group rank ``src`` (the functional op takes the group rank): in place on the
    receiving ranks; the source gets the op's output, equal to its tensor, which is not written (it may be a view
    that autograd forbids writing in a traced forward, e.g. SUMMA's own block)."""
    received = funcol.broadcast(tensor, src, group.process_group)
    if group.rank == src:
        return received
    tensor.copy_(received)
    return tensor


def all_gather(
    piece: torch.Tensor, dim: int, sizes: list[int] | None, out: torch.Tensor | None, group: Group
) -> torch.Tensor:
    """`colo.comm.all_gather` of ``piece`` (this rank's piece, padded to the largest when ``sizes`` are uneven)."""
    n = group.size
    gathered = funcol.all_gather_tensor(piece.contiguous().view(-1), 0, group.process_group)
    stacked = gathered.view(n, *piece.shape)
    if sizes is None and dim == 0:
        result = stacked.view(n * piece.shape[0], *piece.shape[1:])
    else:
        parts = stacked.unbind(0)
        if sizes is not None:
            parts = [part.narrow(dim, 0, size) for part, size in zip(parts, sizes)]
        result = torch.cat(parts, dim=dim)
    if out is None:
        return result
    out.copy_(result)
    return out


def reduce_scatter(full: torch.Tensor, op: str, algorithm: str, group: Group) -> torch.Tensor:
    """This rank's part (dim 0) of the reduction of ``full`` (contiguous, reduced along dim 0) over the group, by
    ``algorithm`` as eager runs it; ``"avg"`` is divided by the caller."""
    n, me = group.size, group.rank
    part = full.shape[0] // n
    reduce_op = "sum" if op == "avg" else op
    if algorithm == "native":
        return funcol.reduce_scatter_tensor(full, reduce_op, 0, group.process_group)
    if algorithm == "all_reduce":
        return funcol.all_reduce(full, reduce_op, group.process_group).narrow(0, me * part, part).clone()
    received = funcol.all_to_all_single(full, None, None, group.process_group)
    copies = received.view(n, part, *full.shape[1:])  # row k: rank k's copy of this rank's part
    if algorithm == "p2p" and op in ("sum", "avg") and (n == 2 or full.element_size() >= 4):
        output = copies[me].clone()  # eager's p2p form: this rank's own part, plus the peers' copies in rank order
        for peer in range(n):
            if peer != me:
                output = output + copies[peer]
        return output
    if algorithm == "p2p":
        copies = torch.cat([copies[me].unsqueeze(0), copies[:me], copies[me + 1 :]])
    return reduce_copies(copies, op)


def reduce_copies(copies: torch.Tensor, op: str) -> torch.Tensor:
    """`colo.comm.collectives._reduce_copies` without ``out=``: the reduction of the copies along dim 0."""
    if op in ("max", "min"):
        return (torch.amax if op == "max" else torch.amin)(copies, dim=0)
    if copies.is_floating_point() and copies.element_size() < 4:
        return copies.sum(dim=0, dtype=torch.float32).to(copies.dtype)
    return copies.sum(dim=0)


def all_to_all(
    tensor: torch.Tensor, input_splits: list[int] | None, output_splits: list[int] | None, group: Group
) -> torch.Tensor:
    """`colo.comm.all_to_all` of ``tensor`` along dim 0 (``None`` splits: even)."""
    return funcol.all_to_all_single(tensor.contiguous(), output_splits, input_splits, group.process_group)
