"""`BufferPool` hands a returned buffer out again only when nothing else references its memory."""

from __future__ import annotations

import pytest
import torch

from colo.zero import BufferPool


def test_a_returned_buffer_is_handed_out_again():
    pool = BufferPool()
    first = pool.take(16, torch.float32, "cpu")
    address = first.data_ptr()
    assert pool.give(first)
    del first
    assert pool.nbytes == 16 * 4
    again = pool.take(16, torch.float32, "cpu")
    assert again.data_ptr() == address and pool.num_allocated == 1
    other = pool.take(16, torch.bfloat16, "cpu")  # another kind: a new buffer
    assert other.dtype == torch.bfloat16 and pool.num_allocated == 2


@pytest.mark.parametrize("holder", ["view", "storage sharer", "reshaped view"])
def test_a_buffer_something_still_references_waits_until_it_is_free(holder):
    pool = BufferPool()
    buffer = pool.take(16, torch.float32, "cpu")
    address = buffer.data_ptr()
    if holder == "view":
        kept = buffer[4:8]
    elif holder == "storage sharer":
        kept = torch.empty(0).set_(buffer.untyped_storage())
    else:
        kept = buffer.view(4, 4).t()
    assert not pool.give(buffer)
    del buffer
    fresh = pool.take(16, torch.float32, "cpu")  # the returned one is still read through `kept`: not handed out
    assert fresh.data_ptr() != address and pool.num_allocated == 2
    del kept
    again = pool.take(16, torch.float32, "cpu")  # now nothing else holds it
    assert again.data_ptr() == address and pool.num_allocated == 2


def test_waiting_buffers_are_bounded():
    pool = BufferPool(max_waiting=2)
    buffers = [pool.take(4, torch.float32, "cpu") for _ in range(3)]
    views = [buffer[:2] for buffer in buffers]
    for buffer in buffers:
        pool.give(buffer)
    assert [b.data_ptr() for b in pool.waiting] == [b.data_ptr() for b in buffers[1:]]  # the oldest was let go
    assert pool.nbytes == 2 * 4 * 4
    del views


def test_max_free_bounds_what_the_pool_keeps():
    pool = BufferPool(max_free=1)
    a, b = pool.take(8, torch.float32, "cpu"), pool.take(8, torch.float32, "cpu")
    assert pool.give(a)
    assert not pool.give(b)
    assert pool.nbytes == 8 * 4
    pool.clear()
    assert pool.nbytes == 0
    with pytest.raises(ValueError, match="max_free=-1"):
        BufferPool(max_free=-1)
    with pytest.raises(ValueError, match="max_waiting=-1"):
        BufferPool(max_waiting=-1)
