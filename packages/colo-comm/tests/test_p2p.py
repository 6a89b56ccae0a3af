"""Point-to-point and object collectives deliver exactly what was sent, on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import (
    Mesh,
    P2POp,
    all_gather_object,
    batch_send_recv,
    broadcast_object,
    gather_object,
    irecv,
    isend,
    recv,
    send,
)
from colo.comm.testing import run_distributed


def _message(src: int, dst: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(6, dtype=torch.float32) + 100 * src + dst).to(dtype).reshape(2, 3)


def _ring_blocking(dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    buffer = torch.empty(2, 3, dtype=dtype)
    # even ranks send first, odd ranks receive first: blocking p2p without deadlock
    if rank % 2 == 0:
        send(_message(rank, nxt, dtype), dst=nxt)
        recv(buffer, src=prev)
    else:
        recv(buffer, src=prev)
        send(_message(rank, nxt, dtype), dst=nxt)
    torch.testing.assert_close(buffer, _message(prev, rank, dtype), rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_blocking_send_recv_around_a_ring(world_size):
    run_distributed(_ring_blocking, torch.bfloat16, world_size=world_size)


def _ring_async():
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    buffer = torch.empty(2, 3)
    receive = irecv(buffer, src=prev)
    sending = isend(_message(rank, nxt), dst=nxt)
    sending.wait()
    torch.testing.assert_close(receive.wait(), _message(prev, rank))


def test_isend_irecv_around_a_ring():
    run_distributed(_ring_async, world_size=4)


def _batched_both_directions():
    """Every rank sends to and receives from both neighbours in one batch (the pipeline's pattern)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    from_prev, from_next = torch.empty(2, 3), torch.empty(2, 3)
    ops = [
        P2POp.send(_message(rank, nxt), nxt),
        P2POp.recv(from_prev, prev),
        P2POp.send(_message(rank, prev), prev),
        P2POp.recv(from_next, nxt),
    ]
    received = batch_send_recv(ops)
    assert received[0] is from_prev and received[1] is from_next
    torch.testing.assert_close(from_prev, _message(prev, rank))
    torch.testing.assert_close(from_next, _message(nxt, rank))


@pytest.mark.parametrize("world_size", [2, 4])
def test_batched_p2p_exchanges_with_both_neighbours(world_size):
    run_distributed(_batched_both_directions, world_size=world_size)


def _pipeline_axis_p2p():
    """Peers are group ranks: on a (pp=2, tp=2) mesh, pp rank 0 sends to pp rank 1 of its own tp column."""
    mesh = Mesh(pp=2, tp=2)
    group = mesh.group("pp")
    buffer = torch.empty(2, 3)
    if mesh.rank("pp") == 0:
        send(_message(dist.get_rank(), 0), dst=1, group=group)
        return None
    recv(buffer, src=0, group=group)
    return buffer


def test_p2p_peers_are_group_ranks():
    results = run_distributed(_pipeline_axis_p2p, world_size=4)
    # global ranks 0 and 1 are stage 0 (tp=0, 1); ranks 2 and 3 are stage 1
    torch.testing.assert_close(results[2], _message(0, 0))
    torch.testing.assert_close(results[3], _message(1, 0))


def _objects():
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = {"rank": rank, "shape": (rank, 2), "dtype": "bfloat16"}
    assert broadcast_object(meta if rank == 1 else None, src=1) == {"rank": 1, "shape": (1, 2), "dtype": "bfloat16"}
    assert all_gather_object(meta) == [{"rank": r, "shape": (r, 2), "dtype": "bfloat16"} for r in range(world)]
    gathered = gather_object(rank * 10, dst=0)
    assert gathered == ([r * 10 for r in range(world)] if rank == 0 else None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_object_collectives(world_size):
    run_distributed(_objects, world_size=world_size)


def _bad_p2p():
    errors = {}
    for name, call in {
        "self": lambda: send(torch.ones(2), dst=dist.get_rank()),
        "range": lambda: send(torch.ones(2), dst=5),
        "empty_batch": lambda: batch_send_recv([]),
        "kind": lambda: batch_send_recv([("send", torch.ones(2), 1)]),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as error:
            errors[name] = str(error)
    return errors


def test_bad_p2p_input_is_rejected_with_the_fix():
    errors = run_distributed(_bad_p2p, world_size=2)[0]
    assert set(errors) == {"self", "range", "empty_batch", "kind"}
    assert "this rank itself" in errors["self"]
    assert "dst=5" in errors["range"]
