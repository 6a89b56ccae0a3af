"""Groups whose ranks are not ascending: colo's `Group.ranks` is the order the process group numbers its members in,
on a torch whose ``new_group`` keeps the caller's order (``sort_ranks``, 2.12+) and on an older one (ascending)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import colo.comm.group as group_module
from colo.comm import Group, all_gather_object, create_process_group
from colo.comm.testing import run_distributed


def _reversed_group(keeps_order: bool | None):
    """Create the group of ranks [1, 0]; ``keeps_order`` forces the path (None: what this torch offers)."""
    original = group_module.new_group_keeps_rank_order
    if keeps_order is not None:
        group_module.new_group_keeps_rank_order = lambda: keeps_order
    try:
        process_group, ranks = create_process_group([1, 0], backend="gloo")
    finally:
        group_module.new_group_keeps_rank_order = original
    group = Group("custom", process_group, ranks, 60.0)
    gathered = all_gather_object(dist.get_rank(), group=group)
    result = {
        "ranks": ranks,
        "colo_group_rank": group.rank,
        "torch_group_rank": dist.get_rank(group=process_group),
        "torch_order": tuple(dist.get_process_group_ranks(process_group)),
        "gathered": tuple(gathered),
    }
    dist.destroy_process_group(process_group)
    return result


@pytest.mark.parametrize("keeps_order", [None, False], ids=["this-torch", "torch-without-sort_ranks"])
def test_a_group_of_descending_ranks_numbers_its_members_as_the_process_group_does(keeps_order):
    results = run_distributed(_reversed_group, keeps_order, world_size=2)
    expected = (1, 0) if (keeps_order is None and group_module.new_group_keeps_rank_order()) else (0, 1)
    for rank, result in enumerate(results):
        assert result["ranks"] == expected
        assert result["torch_order"] == expected
        assert result["colo_group_rank"] == result["torch_group_rank"] == expected.index(rank)
        # an object collective returns the members in colo's order: the i-th entry is from Group.ranks[i]
        assert result["gathered"] == expected


def test_the_feature_check_matches_the_release_that_added_sort_ranks():
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert group_module.new_group_keeps_rank_order() == (release >= (2, 12))
