"""Collectives over a `Group`: all_reduce, broadcast, all_gather (even and uneven), reduce_scatter, all_to_all, barrier.

Each call validates its input before any communication, records its volume in the active `CommTracker`s,
picks its implementation from `colo.comm.algorithms`, and returns the result or, with ``async_op=True``, a
`Handle`. Ranks are group ranks (``src=0`` is the group's first member), never global ranks. On a group of one
rank (the dp group of a tp x pp run that fills the world) there is nothing to exchange: every call validates its
input as usual, then computes its result locally in `_on_one_rank` and runs no backend call and no algorithm form.

With ``COLO_DEBUG_CHECKS=1`` (`colo.comm.debug`) every call first exchanges its op, shapes and dtype over the group
and raises a `CommError` on every rank, naming the op, the group and each rank's arguments, when the ranks disagree
(`_check_same_call`); a backend given mismatched sizes aborts the process (gloo) or hangs instead.

In code ``torch.compile`` traces, every call except ``barrier`` validates its input as usual and then runs its form
in `colo.comm.traced` (torch's functional collectives, which the graph holds) instead of the backend call, the
`Handle`, the tracker record and the debug exchange, none of which a graph can hold.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import scratch, traced
from .algorithms import choose_algorithm
from .debug import debug_checks, disagreement, exchange
from .errors import CommError
from .group import Group, as_group
from .handle import Handle, issue
from .tracker import record

# torch 2.13 renamed the flat-buffer collectives; older torch (2.6-2.12) has only the old names.
P2P_FORM_TAG = 0x636F6C6F
"""Tag of the point-to-point messages of the p2p collective forms: messages between a pair of ranks are matched per
tag in posting order, so a user's own sends and receives (tag 0 by default, e.g. a pipeline's activations) in
flight at the same time cannot be matched with a collective's."""

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
"""Supported reductions. ``avg`` runs as a sum divided by the group size (gloo has no native average everywhere)."""


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _member_group(group: Group | dist.ProcessGroup | None, op: str) -> Group:
    resolved = as_group(group)
    if resolved.process_group is None or dist.get_rank() not in resolved.ranks:
        raise ValueError(f"{op}: rank {dist.get_rank()} is not a member of group {resolved.describe()}")
    return resolved


def _check_tensor(tensor: object, op: str, name: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, not {type(tensor).__name__}")
    return tensor


def _check_reduce_op(op_name: str, reduce: str, tensor: torch.Tensor) -> None:
    if reduce not in REDUCE_OPS:
        raise ValueError(f"{op_name}: op={reduce!r} is not supported; use one of {sorted(REDUCE_OPS)}")
    if reduce == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{op_name}: op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum'")


def _check_group_rank(op: str, name: str, value: int, group: Group) -> int:
    if not isinstance(value, int) or not 0 <= value < group.size:
        raise ValueError(
            f"{op}: {name}={value!r} must be a group rank in [0, {group.size}) of group {group.describe()}"
        )
    return value


def _check_same_call(op: str, group: Group, key: tuple, shown: str, splits: tuple | None = None) -> None:
    """Under ``COLO_DEBUG_CHECKS`` (callers test `debug_checks` first, so that nothing is built without it): exchange
    this call's ``op`` and ``key`` (the arguments every rank must pass alike) over the group before the call, and
    raise a `CommError` on every rank when they differ, listing each rank's ``shown`` arguments. ``splits``:
    all_to_all's ``(input_splits, output_splits)``, checked against the other ranks' (rank i sends rank j what rank j
    expects from rank i)."""
    if group.size == 1:
        return
    everyone = exchange((op, key, shown, splits), group, f"{op} (COLO_DEBUG_CHECKS exchange)")
    problem = None
    if disagreement([(o, k) for o, k, _, _ in everyone], group) is not None:
        problem = "the ranks called it with different arguments"
    elif splits is not None:
        problem = _splits_problem([s for _, _, _, s in everyone], group)
    if problem is None:
        return
    calls = "; ".join(f"rank {rank}: {o} {text}" for rank, (o, _, text, _) in zip(group.ranks, everyone))
    raise CommError(
        f"{op} on group {group.describe()}: {problem} ({calls}); every rank of the group must call the same "
        f"collective with matching shapes and dtype (checked before the call because COLO_DEBUG_CHECKS is set)"
    )


def _splits_problem(splits: list[tuple], group: Group) -> str | None:
    """Where all_to_all's row counts do not pair up: rank i's input_splits[j] is what rank j receives from i."""
    for i, (sent, _) in enumerate(splits):
        for j, (_, received) in enumerate(splits):
            if received is not None and sent[j] != received[i]:
                return (
                    f"rank {group.ranks[i]} sends {sent[j]} rows to rank {group.ranks[j]}, which expects "
                    f"{received[i]} (its output_split_sizes[{i}])"
                )
    return None


def _on_one_rank(op: str, group: Group, dtype: object, result: Any, async_op: bool = False) -> Any:
    """Finish ``op`` on a group of one rank, whose ``result`` (the tensor itself, or a copy of it) the caller
    computed locally: no backend call and no algorithm form runs (an exchange form would have no peer), and the
    tracker records the call with 0 bytes, the value of every formula for n = 1, under the algorithm ``"local"``.

    Returns:
        ``result``, or with ``async_op`` a `Handle` that is already complete and whose ``wait()`` returns it.
    """
    if traced.compiling():
        return _traced_result(op, group, result, async_op)
    record(op, group.name, 1, dtype, 0, 0, "local")
    return issue(op, group, list, lambda: result, async_op)


def _traced_result(op: str, group: Group, result: Any, async_op: bool) -> Any:
    """The result of a call in compiled code (`colo.comm.traced`), or a completed `Handle` holding it."""
    return Handle.completed(op, group, result) if async_op else result


def _local_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)


def _check_dim(op: str, tensor: torch.Tensor, dim: int) -> int:
    if tensor.dim() == 0:
        raise ValueError(f"{op}: needs a tensor with at least one dimension, got a scalar; use tensor.reshape(1)")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"{op}: dim={dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def all_reduce(
    tensor: torch.Tensor, op: str = "sum", *, group: Group | dist.ProcessGroup | None = None, async_op: bool = False
):
    """Reduce ``tensor`` in place over the group so every rank holds the result.

    Args:
        tensor: contiguous tensor, reduced in place.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
        group: a `Group` (``mesh.group("dp")``), a torch ProcessGroup, or ``None`` for the world.
        async_op: return a `Handle` instead of waiting.

    Returns:
        ``tensor`` (or a `Handle` whose ``wait()`` returns it).
    """
    tensor = _check_tensor(tensor, "all_reduce")
    group = _member_group(group, "all_reduce")
    _check_reduce_op("all_reduce", op, tensor)
    if not tensor.is_contiguous():
        raise ValueError("all_reduce: tensor must be contiguous (it is reduced in place); pass tensor.contiguous()")
    if traced.compiling() and group.size > 1:
        return _traced_result("all_reduce", group, traced.all_reduce(tensor, op, group), async_op)
    if not traced.compiling() and debug_checks():
        _check_same_call(
            "all_reduce",
            group,
            (tuple(tensor.shape), tensor.dtype, op),
            f"of {tuple(tensor.shape)} {tensor.dtype} ({op})",
        )
    n = group.size
    if n == 1:  # the sum, max, min and average of one tensor is the tensor
        return _on_one_rank("all_reduce", group, tensor.dtype, tensor, async_op)
    volume = 2 * (n - 1) / n * _nbytes(tensor)
    record("all_reduce", group.name, n, tensor.dtype, volume, volume, "native")

    def finish() -> torch.Tensor:
        if op == "avg":
            tensor.div_(n)
        return tensor

    return issue(
        "all_reduce",
        group,
        lambda: [dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group.process_group, async_op=True)],
        finish,
        async_op,
        lambda: f"of {tuple(tensor.shape)} {tensor.dtype}",
        nbytes=_nbytes(tensor),
    )


def broadcast(
    tensor: torch.Tensor, *, src: int, group: Group | dist.ProcessGroup | None = None, async_op: bool = False
):
    """Copy ``tensor`` from group rank ``src`` to every rank of the group, in place.

    Returns:
        ``tensor`` (or a `Handle` whose ``wait()`` returns it).
    """
    tensor = _check_tensor(tensor, "broadcast")
    group = _member_group(group, "broadcast")
    _check_group_rank("broadcast", "src", src, group)
    if not tensor.is_contiguous():
        raise ValueError("broadcast: tensor must be contiguous (it is written in place); pass tensor.contiguous()")
    if traced.compiling() and group.size > 1:
        return _traced_result("broadcast", group, traced.broadcast(tensor, src, group), async_op)
    if not traced.compiling() and debug_checks():
        _check_same_call(
            "broadcast",
            group,
            (tuple(tensor.shape), tensor.dtype, src),
            f"of {tuple(tensor.shape)} {tensor.dtype} from group rank {src}",
        )
    if group.size == 1:
        return _on_one_rank("broadcast", group, tensor.dtype, tensor, async_op)
    record("broadcast", group.name, group.size, tensor.dtype, _nbytes(tensor), _nbytes(tensor), "native")
    return issue(
        "broadcast",
        group,
        lambda: [dist.broadcast(tensor, src=group.global_rank(src), group=group.process_group, async_op=True)],
        lambda: tensor,
        async_op,
        lambda: f"of {tuple(tensor.shape)} {tensor.dtype} from group rank {src}",
        nbytes=_nbytes(tensor),
    )


def all_gather(
    tensor: torch.Tensor,
    *,
    group: Group | dist.ProcessGroup | None = None,
    dim: int = 0,
    sizes: list[int] | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
):
    """Concatenate every rank's ``tensor`` along ``dim``, in group-rank order.

    The implementation is picked per backend and size by `colo.comm.algorithms`: torch's own, point-to-point
    sends of each piece to every rank (on gloo from 1 MiB, where its own all-gather is about half as fast), or an
    all-reduce of a zero buffer holding this rank's piece.

    Args:
        tensor: this rank's piece; all pieces agree on every dimension but ``dim``.
        group: the group to gather over (``None``: the world).
        dim: the dimension to concatenate along.
        sizes: each rank's extent along ``dim``, for uneven pieces (gloo has no uneven all-gather, so colo pads
            to the largest, gathers and trims). ``None`` means every piece has this rank's shape.
        out: a contiguous tensor of the gathered shape to gather into, instead of a new one (even pieces along
            dim 0 only). ``tensor`` may be this rank's own region of it (an in-place gather).
        async_op: return a `Handle` instead of waiting.

    Returns:
        The gathered tensor, ``out`` when given (or a `Handle` whose ``wait()`` returns it).
    """
    tensor = _check_tensor(tensor, "all_gather")
    group = _member_group(group, "all_gather")
    dim = _check_dim("all_gather", tensor, dim)
    n, me = group.size, group.rank
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if len(sizes) != n or any(s < 0 for s in sizes):
            raise ValueError(f"all_gather: sizes={sizes} must list {n} non-negative extents, one per rank of the group")
        if sizes[me] != tensor.shape[dim]:
            raise ValueError(
                f"all_gather: sizes[{me}]={sizes[me]} does not match this rank's tensor, whose dim {dim} has "
                f"extent {tensor.shape[dim]}"
            )
        if len(set(sizes)) == 1:
            sizes = None
    if traced.compiling() and n > 1:
        piece = tensor if sizes is None else _padded(tensor, dim, max(sizes))
        if out is not None:
            _check_gather_out(out, piece, n, sizes, dim)
        return _traced_result("all_gather", group, traced.all_gather(piece, dim, sizes, out, group), async_op)
    if not traced.compiling() and debug_checks():
        shape = tuple(tensor.shape)
        _check_same_call(
            "all_gather",
            group,
            (shape if sizes is None else shape[:dim] + (None,) + shape[dim + 1 :], tensor.dtype, dim, sizes),
            f"of {shape} {tensor.dtype} along dim {dim}" + ("" if sizes is None else f" (sizes={sizes})"),
        )
    row_bytes = tensor.element_size() * _inner_numel(tensor, dim)
    if sizes is None:
        piece = tensor.contiguous()
        extent = tensor.shape[dim]
        total = n * extent
        volume = (n - 1) * extent * row_bytes
    else:
        extent = max(sizes)
        piece = _padded(tensor, dim, extent)
        total = sum(sizes)
        volume = (total - sizes[me]) * row_bytes

    if out is not None:
        _check_gather_out(out, piece, n, sizes, dim)
    if n == 1:
        return _on_one_rank("all_gather", group, tensor.dtype, _gather_one(piece, out), async_op)
    algorithm = choose_algorithm("all_gather", group.backend, n * _nbytes(piece))
    if tensor.dtype == torch.bool or tensor.is_complex() or (algorithm == "p2p" and (sizes is not None or dim)):
        algorithm = "native"
    if algorithm == "all_reduce":
        # Every rank writes its piece into a zero buffer and the sum assembles them: x + 0 == x exactly
        # (up to the sign of a zero: -0.0 arrives as +0.0).
        if out is None:
            flat = torch.zeros(n * piece.numel(), dtype=tensor.dtype, device=tensor.device)
            flat.narrow(0, me * piece.numel(), piece.numel()).copy_(piece.view(-1))
        else:  # zero the other ranks' regions first: ``piece`` may be this rank's region of ``out``
            flat = out.view(-1)
            own = flat.narrow(0, me * piece.numel(), piece.numel())
            flat.narrow(0, 0, me * piece.numel()).zero_()
            flat.narrow(0, (me + 1) * piece.numel(), (n - me - 1) * piece.numel()).zero_()
            if own.data_ptr() != piece.data_ptr():
                own.copy_(piece.view(-1))
        result = out

        def start() -> list:
            return [dist.all_reduce(flat, group=group.process_group, async_op=True)]
    elif algorithm == "p2p" and sizes is None and dim == 0:
        # every rank sends its piece straight to every other and receives theirs into their regions of the result
        result = (
            out if out is not None else torch.empty((total, *piece.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        )

        def start() -> list:
            own = result.narrow(0, me * extent, extent)
            if own.data_ptr() != piece.data_ptr():
                own.copy_(piece)
            ops = []
            for peer in range(n):
                if peer != me:
                    peer_rank = group.global_rank(peer)
                    ops.append(dist.P2POp(dist.isend, piece, peer_rank, group=group.process_group, tag=P2P_FORM_TAG))
                    region = result.narrow(0, peer * extent, extent)
                    ops.append(dist.P2POp(dist.irecv, region, peer_rank, group=group.process_group, tag=P2P_FORM_TAG))
            return dist.batch_isend_irecv(ops)
    elif sizes is None and dim == 0:
        # the common case: gather straight into the result, no reshaping afterwards
        result = (
            out if out is not None else torch.empty((total, *piece.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        )

        def start() -> list:
            return [_all_gather_flat(result, piece, group=group.process_group, async_op=True)]
    else:
        result = None
        flat = torch.empty(n * piece.numel(), dtype=tensor.dtype, device=tensor.device)

        def start() -> list:
            return [_all_gather_flat(flat, piece.view(-1), group=group.process_group, async_op=True)]

    padded_volume = (n - 1) * extent * row_bytes
    impl_volume = 2 * padded_volume if algorithm == "all_reduce" else padded_volume
    label = algorithm if sizes is None else f"padded_{algorithm}"
    record("all_gather", group.name, n, tensor.dtype, volume, impl_volume, label)

    def finish() -> torch.Tensor:
        if result is not None and sizes is None and dim == 0:
            return result
        stacked = flat.view(n, *piece.shape)
        if sizes is None and dim == 0:
            return stacked.view(total, *piece.shape[1:])
        parts = stacked.unbind(0)
        if sizes is not None:
            parts = [part.narrow(dim, 0, size) for part, size in zip(parts, sizes)]
        return torch.cat(parts, dim=dim)

    detail = lambda: f"of {tuple(tensor.shape)} {tensor.dtype}"  # noqa: E731
    return issue("all_gather", group, start, finish, async_op, detail, nbytes=_nbytes(tensor))


def _padded(tensor: torch.Tensor, dim: int, extent: int) -> torch.Tensor:
    """``tensor`` padded with zeros at the end of ``dim`` to ``extent`` (an uneven piece of an all-gather)."""
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, extent - tensor.shape[dim]]
    return torch.nn.functional.pad(tensor, pad).contiguous()


def _gather_one(piece: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The all-gather of one piece: a copy of it, into ``out`` when given (unless ``piece`` already is ``out``)."""
    if out is None:
        return _local_copy(piece)
    if out.data_ptr() != piece.data_ptr():
        out.copy_(piece)
    return out


def _check_gather_out(out: torch.Tensor, piece: torch.Tensor, n: int, sizes, dim: int) -> None:
    if sizes is not None or dim != 0:
        raise ValueError("all_gather: out= needs even pieces gathered along dim 0")
    shape = (n * piece.shape[0], *piece.shape[1:])
    if tuple(out.shape) != shape or out.dtype != piece.dtype or not out.is_contiguous():
        raise ValueError(
            f"all_gather: out must be a contiguous {piece.dtype} tensor of shape {shape}, got "
            f"{tuple(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )


def _inner_numel(tensor: torch.Tensor, dim: int) -> int:
    inner = 1
    for i, extent in enumerate(tensor.shape):
        if i != dim:
            inner *= extent
    return inner


def reduce_scatter(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    group: Group | dist.ProcessGroup | None = None,
    dim: int = 0,
    donate: bool | str = False,
    async_op: bool = False,
):
    """Reduce ``tensor`` over the group and return this rank's equal part of the result along ``dim``.

    The implementation is picked per backend and size by `colo.comm.algorithms`: torch's own, an all-reduce and a
    local slice, or an exchange of the parts (one all-to-all, or point-to-point sends) and a local reduction of
    this rank's copies (on gloo, where its own reduce_scatter is slow; the exchanges move the reduce-scatter's
    bytes, the all-reduce twice as many).

    Args:
        tensor: the full tensor; its extent along ``dim`` must divide by the group size.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
        group: the group to reduce over (``None``: the world).
        dim: the dimension to split.
        donate: the caller gives ``tensor`` up: the all-reduce form then reduces in it, without a copy, the p2p
            form adds the copies it receives into this rank's part of it, and the result may be a view of it
            (ZeRO's gradient buckets, dropped right after); the other forms only read it. ``"whole"``: given up
            only to a form that reduces all of it in place (the all-reduce form; on a group of one, the tensor is
            its own reduction): every element then holds the group's reduction (for ``"avg"``, the sum), and
            the `Handle`'s ``input_reduced`` says so; every other form leaves it as it was. For a caller that goes
            on using the tensor (ZeRO-1's persistent gradient buffer): it learns from the handle what the call did
            to it.
        async_op: return a `Handle` instead of waiting.

    Returns:
        This rank's part (or a `Handle` whose ``wait()`` returns it).
    """
    tensor = _check_tensor(tensor, "reduce_scatter")
    group = _member_group(group, "reduce_scatter")
    _check_reduce_op("reduce_scatter", op, tensor)
    dim = _check_dim("reduce_scatter", tensor, dim)
    n, me = group.size, group.rank
    if tensor.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter: dim {dim} of shape {tuple(tensor.shape)} has extent {tensor.shape[dim]}, which does "
            f"not divide by the group size {n}; pad it to a multiple of {n}"
        )
    if donate not in (False, True, "whole"):
        raise ValueError(f"reduce_scatter: donate={donate!r} must be False, True or 'whole'")
    if not traced.compiling() and debug_checks():
        _check_same_call(
            "reduce_scatter",
            group,
            (tuple(tensor.shape), tensor.dtype, dim, op),
            f"of {tuple(tensor.shape)} {tensor.dtype} along dim {dim} ({op})",
        )
    if n == 1:  # this rank's part is the whole tensor, reduced over one copy: the tensor itself
        result = tensor if donate else _local_copy(tensor)
        handle = _on_one_rank("reduce_scatter", group, tensor.dtype, result, async_op)
        if async_op:
            handle.input_reduced = bool(donate)
        return handle
    full = tensor.movedim(dim, 0).contiguous() if dim else tensor.contiguous()
    part = full.shape[0] // n
    algorithm = choose_algorithm("reduce_scatter", group.backend, _nbytes(full))
    if traced.compiling():  # nothing donated: the functional collectives do not reduce in the caller's tensor
        result = traced.reduce_scatter(full, op, algorithm, group)
        if op == "avg":
            result = result / n
        return _traced_result("reduce_scatter", group, result.movedim(0, dim) if dim else result, async_op)
    reduced_in_place = bool(donate) and algorithm == "all_reduce" and full is tensor
    if donate == "whole":  # only the all-reduce form may use the tensor
        donate = reduced_in_place
    volume = (n - 1) / n * _nbytes(full)
    impl_volume = 2 * volume if algorithm == "all_reduce" else volume
    record("reduce_scatter", group.name, n, tensor.dtype, volume, impl_volume, algorithm)

    if algorithm == "all_to_all":  # every rank sends each rank its part, then reduces the n copies of its own
        received = scratch.take(full.numel(), tensor.dtype, tensor.device).view(full.shape)
        output = torch.empty((part, *full.shape[1:]), dtype=tensor.dtype, device=tensor.device)

        def start() -> list:
            return [dist.all_to_all_single(received, full, group=group.process_group, async_op=True)]

        def local_part() -> torch.Tensor:
            _reduce_copies(received.view(n, part, *full.shape[1:]), op, out=output)
            scratch.give(received.view(-1))
            return output
    elif algorithm == "p2p":  # every rank sends each other rank its part, then adds the copies of its own it got
        received = scratch.take((n - 1) * part * _inner_numel(full, 0), tensor.dtype, tensor.device)
        received = received.view((n - 1) * part, *full.shape[1:])
        peers = [peer for peer in range(n) if peer != me]

        def start() -> list:
            ops, pg = [], group.process_group
            for k, peer in enumerate(peers):
                peer_rank = group.global_rank(peer)
                sent, into = full.narrow(0, peer * part, part), received.narrow(0, k * part, part)
                ops.append(dist.P2POp(dist.isend, sent, peer_rank, group=pg, tag=P2P_FORM_TAG))
                ops.append(dist.P2POp(dist.irecv, into, peer_rank, group=pg, tag=P2P_FORM_TAG))
            return dist.batch_isend_irecv(ops)

        def local_part() -> torch.Tensor:
            own = full.narrow(0, me * part, part)
            copies = received.view(n - 1, part, *full.shape[1:])
            if op in ("sum", "avg") and (n == 2 or tensor.element_size() >= 4):
                output = own if donate else own.clone()
                for copy in copies:
                    output.add_(copy)
            else:
                output = own if donate else torch.empty_like(own)
                _reduce_copies(torch.cat([own.unsqueeze(0), copies]), op, out=output)
            scratch.give(received.view(-1))
            return output
    elif algorithm == "all_reduce":
        buffer = full.clone() if full is tensor and not donate else full

        def start() -> list:
            return [dist.all_reduce(buffer, op=REDUCE_OPS[op], group=group.process_group, async_op=True)]

        def local_part() -> torch.Tensor:
            own = buffer.narrow(0, me * part, part)
            return own if donate else own.clone()
    else:
        output = torch.empty((part, *full.shape[1:]), dtype=tensor.dtype, device=tensor.device)

        def start() -> list:
            return [_reduce_scatter_flat(output, full, op=REDUCE_OPS[op], group=group.process_group, async_op=True)]

        def local_part() -> torch.Tensor:
            return output

    def finish() -> torch.Tensor:
        result = local_part()
        if op == "avg":
            result.div_(n)
        return result.movedim(0, dim) if dim else result

    detail = lambda: f"of {tuple(tensor.shape)} {tensor.dtype}"  # noqa: E731
    handle = issue("reduce_scatter", group, start, finish, async_op, detail, nbytes=_nbytes(tensor))
    if async_op:
        handle.input_reduced = reduced_in_place
    return handle


def _reduce_copies(copies: torch.Tensor, op: str, *, out: torch.Tensor) -> None:
    """Reduce the group's copies of this rank's part (dim 0, in rank order) into ``out``; sums of 16-bit floats
    accumulate in fp32 and round once, as a reduction in one step would."""
    if op in ("max", "min"):
        (torch.amax if op == "max" else torch.amin)(copies, dim=0, out=out)
    elif copies.is_floating_point() and copies.element_size() < 4:
        out.copy_(copies.sum(dim=0, dtype=torch.float32))
    else:
        torch.sum(copies, dim=0, out=out)


def all_to_all(
    tensor: torch.Tensor,
    *,
    group: Group | dist.ProcessGroup | None = None,
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
    async_op: bool = False,
):
    """Send slice ``i`` of ``tensor`` (along dim 0) to group rank ``i``; return the slices received, in rank order.

    Args:
        tensor: this rank's input.
        group: the group to exchange over (``None``: the world).
        input_split_sizes: rows sent to each rank; ``None`` splits dim 0 evenly.
        output_split_sizes: rows received from each rank; when ``None`` with uneven input splits, they are
            exchanged first (one extra small all-to-all).
        async_op: return a `Handle` instead of waiting.

    Returns:
        The received tensor (or a `Handle` whose ``wait()`` returns it).
    """
    tensor = _check_tensor(tensor, "all_to_all")
    group = _member_group(group, "all_to_all")
    _check_dim("all_to_all", tensor, 0)
    n, me = group.size, group.rank
    rows = tensor.shape[0]
    if input_split_sizes is None:
        if rows % n:
            raise ValueError(
                f"all_to_all: dim 0 has extent {rows}, which does not divide by the group size {n}; pad it or pass "
                "input_split_sizes"
            )
        if output_split_sizes is not None:
            raise ValueError("all_to_all: output_split_sizes needs input_split_sizes too")
        input_splits = output_splits = [rows // n] * n
    else:
        input_splits = [int(s) for s in input_split_sizes]
        if len(input_splits) != n or any(s < 0 for s in input_splits) or sum(input_splits) != rows:
            raise ValueError(
                f"all_to_all: input_split_sizes={input_splits} must be {n} non-negative row counts adding up to "
                f"dim 0's extent {rows}"
            )
        if output_split_sizes is None:
            output_splits = input_splits if n == 1 else _exchange_split_sizes(input_splits, group)
        else:
            output_splits = [int(s) for s in output_split_sizes]
            if len(output_splits) != n or any(s < 0 for s in output_splits):
                raise ValueError(f"all_to_all: output_split_sizes={output_splits} must be {n} non-negative row counts")
            if n == 1 and output_splits != input_splits:
                raise ValueError(
                    f"all_to_all: on a group of one rank the rows received are the rows sent, so "
                    f"output_split_sizes={output_splits} must equal input_split_sizes={input_splits}"
                )
    even = input_split_sizes is None
    if not traced.compiling() and debug_checks():
        _check_same_call(
            "all_to_all",
            group,
            (tuple(tensor.shape) if even else tuple(tensor.shape[1:]), tensor.dtype, even),
            f"of {tuple(tensor.shape)} {tensor.dtype}" + ("" if even else f" (input_split_sizes={input_splits})"),
            None if even else (input_splits, None if output_split_sizes is None else output_splits),
        )
    if n == 1:
        return _on_one_rank("all_to_all", group, tensor.dtype, _local_copy(tensor), async_op)
    if traced.compiling():
        splits = (None, None) if even else (input_splits, output_splits)
        return _traced_result("all_to_all", group, traced.all_to_all(tensor, *splits, group), async_op)
    source = tensor.contiguous()
    row_bytes = tensor.element_size() * _inner_numel(tensor, 0)
    volume = (rows - input_splits[me]) * row_bytes
    record("all_to_all", group.name, n, tensor.dtype, volume, volume, "native")
    output = torch.empty((sum(output_splits), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    return issue(
        "all_to_all",
        group,
        lambda: [
            dist.all_to_all_single(
                output,
                source,
                None if even else output_splits,
                None if even else input_splits,
                group=group.process_group,
                async_op=True,
            )
        ],
        lambda: output,
        async_op,
        lambda: f"of {tuple(tensor.shape)} {tensor.dtype}",
        nbytes=_nbytes(tensor),
    )


def _exchange_split_sizes(input_splits: list[int], group: Group) -> list[int]:
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")
    sent = torch.tensor(input_splits, dtype=torch.int64, device=device)
    received = all_to_all(sent, group=group)
    return [int(x) for x in received.tolist()]


def barrier(*, group: Group | dist.ProcessGroup | None = None) -> None:
    """Block until every rank of the group reaches the barrier."""
    group = _member_group(group, "barrier")
    if not traced.compiling() and debug_checks():
        _check_same_call("barrier", group, (), "")
    if group.size == 1:
        _on_one_rank("barrier", group, "none", None)
        return
    record("barrier", group.name, group.size, "none", 0, 0, "native")
    issue("barrier", group, lambda: [dist.barrier(group=group.process_group, async_op=True)], None, False)
