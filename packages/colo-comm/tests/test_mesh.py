"""`Mesh` arranges ranks outer to inner, creates a group per axis on every rank, and rejects bad shapes clearly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import Mesh, all_reduce, new_group
from colo.comm.testing import run_distributed


def _describe_mesh(shape: dict[str, int], fused: tuple[tuple[str, ...], ...]):
    mesh = Mesh(fused=fused, **shape)
    description = {
        "coord": mesh.coord,
        "rank_of_coord": mesh.rank_of(mesh.coord),
        "groups": {},
        "sizes": {},
    }
    axes_to_check = [(axis,) for axis in shape] + [tuple(axes) for axes in fused] + [tuple(shape)]
    for axes in axes_to_check:
        group = mesh.group(*axes)
        # The group really is the set of ranks it claims: an all-reduce of the global ranks sums over them.
        total = all_reduce(torch.tensor([float(dist.get_rank())]), group=group)
        description["groups"][axes] = (group.name, group.ranks, mesh.ranks_along(*axes), mesh.rank(*axes), total.item())
        description["sizes"][axes] = mesh.size(*axes)
    return description


def test_mesh_2x2_groups_neighbouring_ranks_on_the_inner_axis():
    results = run_distributed(_describe_mesh, {"dp": 2, "tp": 2}, (), world_size=4)
    for rank, result in enumerate(results):
        dp, tp = divmod(rank, 2)
        assert result["coord"] == {"dp": dp, "tp": tp}
        assert result["rank_of_coord"] == rank
        tp_ranks = (2 * dp, 2 * dp + 1)
        dp_ranks = (tp, tp + 2)
        assert result["groups"][("tp",)] == ("tp", tp_ranks, list(tp_ranks), tp, float(sum(tp_ranks)))
        assert result["groups"][("dp",)] == ("dp", dp_ranks, list(dp_ranks), dp, float(sum(dp_ranks)))
        assert result["groups"][("dp", "tp")] == ("dp+tp", (0, 1, 2, 3), [0, 1, 2, 3], rank, 6.0)
        assert result["sizes"] == {("dp",): 2, ("tp",): 2, ("dp", "tp"): 4}


def test_mesh_2x1x2_with_a_declared_fused_group():
    results = run_distributed(_describe_mesh, {"pp": 2, "sp": 1, "dp": 2}, (("sp", "dp"),), world_size=4)
    for rank, result in enumerate(results):
        pp, dp = divmod(rank, 2)
        assert result["coord"] == {"pp": pp, "sp": 0, "dp": dp}
        assert result["groups"][("sp",)] == ("sp", (rank,), [rank], 0, float(rank))
        dp_ranks = (2 * pp, 2 * pp + 1)
        assert result["groups"][("dp",)][:2] == ("dp", dp_ranks)
        # fused axes are taken in mesh order whatever order they are named in
        assert result["groups"][("sp", "dp")] == ("sp+dp", dp_ranks, list(dp_ranks), dp, float(sum(dp_ranks)))
        pp_ranks = (dp, dp + 2)
        assert result["groups"][("pp",)] == ("pp", pp_ranks, list(pp_ranks), pp, float(sum(pp_ranks)))
        assert result["sizes"][("pp", "sp", "dp")] == 4


def _submesh():
    mesh = Mesh(pp=2, dp=2)
    sub = mesh.submesh("dp")
    total = all_reduce(torch.tensor([float(dist.get_rank())]), group=sub.group("dp"))
    return sub.shape, sub.ranks, sub.coord, sub.group("dp") is mesh.group("dp"), total.item(), repr(sub)


def test_submesh_keeps_this_ranks_slice_and_reuses_groups():
    results = run_distributed(_submesh, world_size=4)
    for rank, (shape, ranks, coord, same_group, total, text) in enumerate(results):
        pp, dp = divmod(rank, 2)
        assert shape == {"dp": 2}
        assert ranks == (2 * pp, 2 * pp + 1)
        assert coord == {"dp": dp}
        assert same_group
        assert total == float(4 * pp + 1)
        assert text.startswith("Mesh(dp=2)")


def _lazy_fused_group():
    """A fused group that was not declared is created on first use by its members only."""
    mesh = Mesh(pp=2, dp=2, tp=1)
    if mesh.coord["pp"] == 0:
        group = mesh.group("dp", "tp")  # only stage 0 asks: must not hang
        return all_reduce(torch.ones(1), group=group).item()
    return None


def test_undeclared_fused_group_is_created_by_its_members_only():
    assert run_distributed(_lazy_fused_group, world_size=4) == [2.0, 2.0, None, None]


def _mesh_errors():
    errors = {}
    cases = {
        "product": lambda: Mesh(dp=2, tp=2),
        "zero": lambda: Mesh(dp=0, tp=2),
        "type": lambda: Mesh(dp=2.0),
        "none": lambda: Mesh(),
        "unknown": lambda: Mesh(dp=2).group("tp"),
        "twice": lambda: Mesh(dp=2).group("dp", "dp"),
        "fused_unknown": lambda: Mesh(dp=2, fused=[("dp", "sp")]),
        "rank_of": lambda: Mesh(dp=2).rank_of({"dp": 5}),
    }
    for name, call in cases.items():
        try:
            call()
        except (ValueError, TypeError) as error:
            errors[name] = str(error)
    return errors


def test_bad_mesh_shapes_say_what_to_do():
    errors = run_distributed(_mesh_errors, world_size=2)[0]
    assert set(errors) == {"product", "zero", "type", "none", "unknown", "twice", "fused_unknown", "rank_of"}
    assert "has 4 ranks but the world has 2" in errors["product"]
    assert "dp=0 must be at least 1" in errors["zero"]
    assert "must be an int" in errors["type"]
    assert "Mesh(dp=2)" in errors["none"]
    assert "unknown mesh axis 'tp'" in errors["unknown"] and "('dp',)" in errors["unknown"]
    assert "unknown mesh axis 'sp'" in errors["fused_unknown"]


def _suggestion():
    try:
        Mesh(dp=1, tp=2)
    except ValueError as error:
        return str(error)


def test_size_error_suggests_sizes_that_fit():
    message = run_distributed(_suggestion, world_size=4)[0]
    assert "e.g. Mesh(dp=2, tp=2)" in message


def test_mesh_before_init_explains_how_to_start():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        Mesh(dp=1)


def _repeated_meshes():
    """Meshes of the same shape reuse the cached groups instead of opening new connections each time."""
    first = Mesh(dp=2)
    second = Mesh(dp=2)
    return first.group("dp").process_group is second.group("dp").process_group


def test_meshes_of_the_same_shape_share_groups():
    assert run_distributed(_repeated_meshes, world_size=2) == [True, True]


def _local_groups_after_uneven_histories():
    """Ranks 0 and 1 create a group the others never see; a later group of ranks 0 and 3 must still form.

    torch's own naming of locally synchronised groups counts the groups each process knows, which now differs
    between rank 0 and rank 3: without colo's member-agreed names the two would wait on different keys and hang.
    """
    rank = dist.get_rank()
    results = {}
    if rank in (0, 1):
        results["first"] = all_reduce(torch.ones(1), group=new_group([0, 1], name="pair", local_synchronization=True))
    if rank in (0, 3):
        results["second"] = all_reduce(torch.ones(1), group=new_group([0, 3], name="ends", local_synchronization=True))
    return {key: value.item() for key, value in results.items()}


def test_locally_synchronised_groups_form_whatever_each_rank_created_before():
    results = run_distributed(_local_groups_after_uneven_histories, world_size=4)
    assert results == [{"first": 2.0, "second": 2.0}, {"first": 2.0}, {}, {"second": 2.0}]
