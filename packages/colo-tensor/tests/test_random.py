"""The tensor-parallel random streams: replicated regions draw the same dropout mask on every tp rank (the one a
single process draws from the base seed), sharded regions draw each rank's own mask (the one a single process
draws from that rank's seed), forking never advances the replicated stream, and everything is reproducible.

Masks are compared exactly: the same generator state and the same op on the same shape draw the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import RNGTracker, model_parallel_seed, seed_tensor_parallel

SEED, P, N = 1234, 0.5, 64


def _mask(p=P):
    return F.dropout(torch.ones(N), p) != 0


def _draws(seed):
    """replicated, sharded, sharded, replicated: the masks one rank draws."""
    tracker = seed_tensor_parallel(seed, mesh=Mesh(tp=torch.distributed.get_world_size()))
    first = _mask()
    with tracker.fork():
        sharded = [_mask()]
    with tracker.fork("model_parallel"):
        sharded.append(_mask())
    return {"replicated": [first, _mask()], "sharded": sharded}


def test_replicated_and_sharded_streams_match_the_single_process_draws():
    ranks = run_distributed(_draws, SEED, world_size=2)
    # single-process reference: the default stream seeded with the base seed, drawn twice in a row (the fork in
    # between must not advance it); rank r's stream seeded with model_parallel_seed(SEED, r), drawn twice
    torch.manual_seed(SEED)
    replicated = [_mask(), _mask()]
    for rank, result in enumerate(ranks):
        for got, expected in zip(result["replicated"], replicated):
            assert torch.equal(got, expected)
        torch.manual_seed(model_parallel_seed(SEED, rank))
        assert torch.equal(result["sharded"][0], _mask())
        assert torch.equal(result["sharded"][1], _mask())  # the stream continues across forks
    assert not torch.equal(ranks[0]["sharded"][0], ranks[1]["sharded"][0])  # each rank its own mask
    assert not torch.equal(ranks[0]["sharded"][0], replicated[0])
    again = run_distributed(_draws, SEED, world_size=2)
    for result, repeat in zip(ranks, again):  # reproducible from the base seed
        for key in ("replicated", "sharded"):
            assert all(torch.equal(a, b) for a, b in zip(result[key], repeat[key]))


def test_fork_restores_the_default_stream_on_error_and_keeps_states():
    tracker = RNGTracker()
    tracker.add("model_parallel", 7)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError, match="inside"), tracker.fork():
        torch.rand(2)
        raise RuntimeError("inside")
    assert torch.equal(torch.rand(4), expected)
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(3), first)


def test_tracker_errors_say_what_to_do():
    tracker = RNGTracker()
    with pytest.raises(ValueError, match=r"no stream 'model_parallel'; the streams are \[\]; create it"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="stream 'a' exists; call reset"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="already forked; do not nest"), tracker.fork("a"), tracker.fork("a"):
        pass
    with pytest.raises(ValueError, match="only 'cpu' and 'cuda'"):
        RNGTracker("meta")
