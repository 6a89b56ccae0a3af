"""Tiers: the device arena carves buffers from a fixed block and never exceeds it; host and disk tiers count
against their capacities; the disk tier's background reads and writes round-trip and keep per-file order."""

from __future__ import annotations

import os

import pytest
import torch

from colo.gemini import DeviceArena, DiskTier, GeminiMemoryError, HostTier, MemoryTracer
from colo.gemini.tiers import ALIGNMENT


def test_arena_carves_aligned_views_of_one_block_and_coalesces_holes():
    arena = DeviceArena(1024, device="cpu")
    assert arena.preallocate  # without a GPU the device tier is preallocated host memory
    a = arena.allocate(10, torch.float32)  # 40 bytes, rounded to 64
    b = arena.allocate(16, torch.bfloat16)
    c = arena.allocate(3, torch.float64)
    for tensor in (a, b, c):
        assert tensor.data_ptr() % ALIGNMENT == 0
        assert tensor.untyped_storage().data_ptr() == arena._buffer.untyped_storage().data_ptr()
    assert (a.numel(), b.dtype, c.numel()) == (10, torch.bfloat16, 3)
    assert arena.used == 3 * ALIGNMENT == arena.live_bytes()
    a.fill_(1.0)
    c.fill_(2.0)
    assert torch.equal(a, torch.ones(10))  # the buffers do not overlap
    arena.free(a)
    arena.free(c)
    arena.free(b)  # frees in any order coalesce back into one hole
    assert arena.used == 0 and arena._holes == [(0, 1024)]
    assert arena.high_water == 3 * ALIGNMENT


def test_arena_refuses_past_its_capacity_before_allocating():
    arena = DeviceArena(256, device="cpu")
    arena.allocate(32, torch.float32)  # 128 bytes
    with pytest.raises(GeminiMemoryError, match="device_capacity"):
        arena.allocate(48, torch.float32)  # 192 more bytes
    assert arena.used == 128 and arena.high_water == 128


def test_arena_reports_fragmentation_and_transient_buffers_come_from_the_top():
    arena = DeviceArena(4 * ALIGNMENT, device="cpu")
    blocks = [arena.allocate(ALIGNMENT // 4, torch.float32) for _ in range(4)]
    arena.free(blocks[0])
    arena.free(blocks[2])  # two holes of one block each: two blocks free, no two adjacent
    assert arena.can_fit(ALIGNMENT) and not arena.can_fit(2 * ALIGNMENT)
    with pytest.raises(GeminiMemoryError, match="fragmented"):
        arena.allocate(2 * ALIGNMENT // 4, torch.float32)
    top = arena.allocate(ALIGNMENT // 4, torch.float32, from_top=True)
    assert top.data_ptr() - arena._buffer.data_ptr() == 2 * ALIGNMENT  # the highest hole


def test_tracer_counts_the_arena_from_its_events():
    arena = DeviceArena(1024, device="cpu")
    tracer = MemoryTracer()
    arena.observers.append(tracer.on_tier_change)
    buffers = [arena.allocate(n, torch.float32) for n in (5, 40, 17)]
    arena.free(buffers[1])
    arena.allocate(60, torch.float16)
    assert tracer.used["device"] == arena.used == arena.live_bytes()
    assert tracer.peak["device"] == arena.high_water


def test_host_tier_counts_against_its_capacity_and_pins_only_with_cuda():
    host = HostTier(100)
    x = host.allocate(20, torch.float32)
    assert host.used == 80 and not x.is_pinned()
    with pytest.raises(GeminiMemoryError, match="host_capacity"):
        host.allocate(6, torch.float32)
    host.free(x)
    assert host.used == 0 and host.high_water == 80
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            HostTier(None, pin_memory=True)


def test_disk_tier_round_trips_in_the_background_in_issue_order(tmp_path):
    disk = DiskTier(tmp_path / "tier", 1 << 20, num_threads=2)
    values = torch.randn(1000)
    halves = torch.randn(500).to(torch.bfloat16)
    disk.create("a", values.numel() * 4)
    disk.create("b", halves.numel() * 2)
    assert disk.used == 5000
    out_a, out_b = torch.empty(1000), torch.empty(500, dtype=torch.bfloat16)
    futures = [disk.write("a", values), disk.write("b", halves), disk.read("a", out_a), disk.read("b", out_b)]
    for future in futures:
        future.result()
    assert torch.equal(out_a, values) and torch.equal(out_b, halves)
    # a read issued right after a write of the same file sees the new bytes
    second = values * 2
    disk.write("a", second)
    disk.read("a", out_a).result()
    assert torch.equal(out_a, second)
    with pytest.raises(ValueError, match="holds 4000 bytes"):
        disk.read("a", torch.empty(10))
    with pytest.raises(GeminiMemoryError, match="disk_capacity"):
        disk.create("c", 1 << 20)
    disk.close()
    assert disk.used == 0 and not os.path.exists(tmp_path / "tier")  # it made the directory, so it removes it


def test_arena_compaction_slides_buffers_down_and_keeps_their_contents():
    arena = DeviceArena(6 * ALIGNMENT, device="cpu")
    blocks = [arena.allocate(ALIGNMENT // 4, torch.float32) for _ in range(5)]
    for i, block in enumerate(blocks):
        block.fill_(float(i))
    big = arena.allocate(ALIGNMENT // 2, torch.float16)  # the sixth block
    big.copy_(torch.arange(ALIGNMENT // 2, dtype=torch.float16))
    for i in (0, 2, 3):
        arena.free(blocks[i])
    assert not arena.can_fit(3 * ALIGNMENT)  # three blocks free, in holes of one and two
    moved = {i: arena.relocate(blocks[i]) for i in (1, 4)}
    moved_big = arena.relocate(big)
    assert torch.equal(moved[1], torch.full((16,), 1.0)) and torch.equal(moved[4], torch.full((16,), 4.0))
    assert torch.equal(moved_big, torch.arange(ALIGNMENT // 2, dtype=torch.float16))
    assert [t.data_ptr() - arena._buffer.data_ptr() for t in (moved[1], moved[4], moved_big)] == [0, 64, 128]
    assert arena.can_fit(3 * ALIGNMENT) and arena.used == 3 * ALIGNMENT == arena.live_bytes()
