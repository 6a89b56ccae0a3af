"""Stage partitioning: uniform, balanced by parameters or measured time, with embedding and head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colo.pipeline import (
    build_stages,
    partition_balanced,
    partition_by_parameters,
    partition_by_time,
    partition_uniform,
)


def test_uniform_gives_the_extra_blocks_to_the_first_stages():
    assert partition_uniform(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ValueError, match="cannot split 3 blocks into num_stages=4"):
        partition_uniform(3, 4)


def test_balanced_minimises_the_largest_stage():
    costs = [1, 1, 1, 1, 4, 4]
    ranges = partition_balanced(costs, 3)
    assert max(sum(costs[i] for i in r) for r in ranges) == 4
    # a heavy embedding on the first stage pushes blocks to the others
    assert partition_balanced([1, 1, 1, 1], 2, first_cost=2) == [range(0, 1), range(1, 4)]


def test_by_parameters_counts_embedding_and_head():
    blocks = [nn.Linear(8, 8) for _ in range(6)]  # 72 parameters each
    embedding, head = nn.Embedding(30, 8), nn.Linear(8, 30)  # 240 and 270
    ranges = partition_by_parameters(blocks, 3, first=embedding, last=head)
    assert ranges == [range(0, 1), range(1, 5), range(5, 6)]
    stages = build_stages(blocks, ranges, first=embedding, last=head)
    assert stages[0][0] is embedding and stages[-1][-1] is head and len(stages[1]) == 4


class Slow(nn.Module):
    """A block whose cost is ``repeats`` matmuls, so measured time grows with it."""

    def __init__(self, repeats):
        super().__init__()
        self.lin, self.repeats = nn.Linear(64, 64), repeats

    def forward(self, x):
        for _ in range(self.repeats):
            x = torch.tanh(self.lin(x))
        return x


def test_by_time_puts_the_slow_block_alone():
    blocks = [Slow(1), Slow(1), Slow(1), Slow(60)]
    ranges = partition_by_time(blocks, 2, sample_input=torch.randn(64, 64), repeats=3)
    assert ranges == [range(0, 3), range(3, 4)]
    assert all(p.grad is None for b in blocks for p in b.parameters())


def test_build_stages_checks_coverage():
    with pytest.raises(ValueError, match="must cover blocks 0..3 once each"):
        build_stages([nn.Identity()] * 4, [range(0, 2), range(3, 4)])
