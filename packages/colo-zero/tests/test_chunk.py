"""Chunk planning: padding to the shard count, no mixing of groups / dtypes / frozen, least-padding search."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colo.zero import Chunk, plan_chunks
from colo.zero.chunk import padding_of


def _entries(sizes, *, groups=None, frozen=(), dtypes=None):
    entries = []
    for i, size in enumerate(sizes):
        dtype = dtypes[i] if dtypes else torch.float32
        p = nn.Parameter(torch.randn(size).to(dtype), requires_grad=i not in frozen)
        entries.append((f"p{i}", p, groups[i] if groups else 0))
    return entries


def test_chunks_never_mix_groups_dtypes_or_frozen_and_pad_to_the_shard_count():
    entries = _entries(
        [7, 5, 3, 9, 4, 6],
        groups=[0, 1, 0, 1, 0, 0],
        frozen={4},
        dtypes=[torch.float32] * 5 + [torch.bfloat16],
    )
    plans = plan_chunks(entries, num_shards=4, chunk_numel=12)
    for plan in plans:
        assert plan.capacity % 4 == 0
        assert plan.used <= plan.capacity
        keys = {(plan.group_index, p.dtype, p.requires_grad) for _, p in plan.entries}
        assert keys == {(plan.group_index, plan.dtype, plan.trainable)}
    names = [name for plan in plans for name, _ in plan.entries]
    assert sorted(names) == [f"p{i}" for i in range(6)]
    # packing order within a key follows the input order: p0 then p2 share group 0's first chunk
    assert [name for name, _ in plans[0].entries] == ["p0", "p2"]


def test_oversized_parameter_gets_its_own_chunk():
    plans = plan_chunks(_entries([3, 50, 3]), num_shards=4, chunk_numel=8)
    assert [(p.capacity, [n for n, _ in p.entries]) for p in plans] == [(8, ["p0", "p2"]), (52, ["p1"])]


def test_search_wastes_no_more_padding_than_any_fixed_size():
    entries = _entries([33, 17, 64, 5, 29, 40, 12, 7])
    best = plan_chunks(entries, num_shards=2, max_chunk_numel=256, padding_tolerance=0.0)
    for capacity in (64, 70, 96, 128, 200, 256):
        assert padding_of(best) <= padding_of(plan_chunks(entries, num_shards=2, chunk_numel=capacity))
    # with a tolerance, the smallest capacity within it of the least padding: more chunks, barely more padding
    total = sum(p.numel() for _, p, _ in entries)
    tolerant = plan_chunks(entries, num_shards=2, max_chunk_numel=256, padding_tolerance=0.1)
    assert padding_of(tolerant) <= padding_of(best) + 0.1 * total
    assert tolerant[0].capacity <= best[0].capacity and len(tolerant) >= len(best)


def test_a_parameter_as_large_as_the_cap_does_not_fix_the_capacity():
    entries = _entries([64, 40, 40, 40, 40, 40])  # with capacity 64 every 40 would sit alone: 37% padding
    plans = plan_chunks(entries, num_shards=2, max_chunk_numel=64, padding_tolerance=0.0)
    assert padding_of(plans) < padding_of(plan_chunks(entries, num_shards=2, chunk_numel=64))


def test_chunk_shards_and_parameter_views():
    entries = _entries([5, 6])
    chunk = Chunk(0, plan_chunks(entries, num_shards=4, chunk_numel=12)[0], num_shards=4, shard_rank=3)
    assert (chunk.numel, chunk.shard_numel, chunk.shard_offset, chunk.padding_numel) == (12, 3, 9, 1)
    full = chunk.pack(torch.float32, torch.device("cpu"))
    chunk.bind_params(full)
    full[0] = 42.0
    assert entries[0][1][0].item() == 42.0  # the parameter is a view of the chunk
    with pytest.raises(ValueError, match="tier"):
        chunk.set_buffer("master", full, tier="ssd")
