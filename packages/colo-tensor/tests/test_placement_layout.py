"""Placements and layouts: torch.chunk arithmetic, local shapes of nested and uneven shards, `distribute`, errors."""

from __future__ import annotations

import pytest
import torch

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import Layout, Partial, Replicate, Shard, distribute, gather, layout_of, redistribute, set_layout
from colo.tensor.placement import chunk_range, chunk_sizes


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4, 5])
def test_chunk_ranges_are_torch_chunk_with_empty_trailing_chunks(num_chunks):
    for extent in range(13):
        pieces = list(torch.arange(extent).chunk(num_chunks)) if extent else []
        pieces += [torch.arange(0)] * (num_chunks - len(pieces))
        for index, piece in enumerate(pieces):
            offset, size = chunk_range(extent, num_chunks, index)
            assert size == piece.numel()
            if size:
                assert offset == int(piece[0])
        assert sum(chunk_sizes(extent, num_chunks)) == extent


def test_placements_reject_bad_arguments():
    with pytest.raises(ValueError, match="Partial\\(reduce='mean'\\) is not supported; use one of"):
        Partial("mean")
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard("0")
    assert Shard(1) == Shard(1) and Partial() == Partial("sum") and Replicate() == Replicate()


def _errors(mesh: Mesh) -> dict[str, str]:
    cases = {
        "count": lambda: Layout(mesh, [Shard(0)], (4, 4)),
        "dim": lambda: Layout(mesh, [Shard(2), Replicate()], (4, 4)),
        "axis": lambda: Layout(mesh, {"sp": Shard(0)}, (4, 4)),
        "type": lambda: Layout(mesh, ["Shard(0)", Replicate()], (4, 4)),
        "single": lambda: Layout(mesh, Shard(0), (4, 4)),
        "no_layout": lambda: redistribute(torch.ones(2), [Replicate(), Replicate()]),
        "shape": lambda: set_layout(torch.ones(3, 4), Layout(mesh, {"tp": Shard(0)}, (4, 4))),
        "avg_int": lambda: distribute(torch.ones(4, dtype=torch.int64), mesh, {"tp": Partial("avg")}),
    }
    errors = {}
    for name, call in cases.items():
        try:
            call()
        except (TypeError, ValueError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def _layouts():
    mesh = Mesh(dp=2, tp=2)
    x = torch.arange(7 * 2).reshape(7, 2).float()
    nested = distribute(x, mesh, [Shard(0), Shard(0)])  # dim 0: 7 -> dp chunks [4, 3] -> tp chunks [2, 2], [2, 1]
    by_name = distribute(x, mesh, {"tp": Shard(1)})  # dp replicated
    partials = {reduce: distribute(x, mesh, {"dp": Partial(reduce)}) for reduce in ("sum", "avg", "max")}
    line = Mesh(tp=4)
    five = distribute(torch.arange(5.0), line, [Shard(0)])  # chunks [2, 2, 1, 0]
    return {
        "coord": mesh.coord,
        "nested": (nested, layout_of(nested).local_offsets(), layout_of(nested).placements),
        "by_name": (by_name, layout_of(by_name).placements),
        "partials": partials,
        "five": (five, layout_of(five).local_offsets(), gather(five)),
        "copy_has_no_layout": layout_of(nested.clone()) is None and layout_of(torch.ones(1)) is None,
        "errors": _errors(mesh),
    }


def test_distribute_nests_uneven_shards_outer_axis_first():
    x = torch.arange(7 * 2).reshape(7, 2).float()
    rows = {(0, 0): (0, 2), (0, 1): (2, 2), (1, 0): (4, 2), (1, 1): (6, 1)}
    for result in run_distributed(_layouts, world_size=4):
        dp, tp = result["coord"]["dp"], result["coord"]["tp"]
        rank = 2 * dp + tp
        local, offsets, placements = result["nested"]
        start, size = rows[(dp, tp)]
        torch.testing.assert_close(local, x[start : start + size], rtol=0, atol=0)
        assert offsets == (start, 0) and placements == (Shard(0), Shard(0))

        local, placements = result["by_name"]
        torch.testing.assert_close(local, x[:, tp : tp + 1], rtol=0, atol=0)
        assert placements == (Replicate(), Shard(1))

        # Partial("sum"): the value at dp coordinate 0, zeros elsewhere, so the sum is exact; avg and max keep it
        partials = result["partials"]
        torch.testing.assert_close(partials["sum"], x if dp == 0 else torch.zeros_like(x), rtol=0, atol=0)
        torch.testing.assert_close(partials["avg"], x, rtol=0, atol=0)
        torch.testing.assert_close(partials["max"], x, rtol=0, atol=0)

        five, offsets, gathered = result["five"]
        expected = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0]), torch.tensor([4.0]), torch.tensor([])]
        torch.testing.assert_close(five, expected[rank], rtol=0, atol=0)
        assert offsets == ((0,), (2,), (4,), (5,))[rank]
        torch.testing.assert_close(gathered, torch.arange(5.0), rtol=0, atol=0)
        assert result["copy_has_no_layout"]


def test_layout_errors_name_the_argument_and_the_fix():
    errors = run_distributed(_layouts, world_size=4)[0]["errors"]
    assert "give 1 placements for a mesh with 2 axes ('dp', 'tp'); give one per axis" in errors["count"]
    assert "axis 'dp' has Shard(2) but the tensor has 2 dimensions" in errors["dim"]
    assert "placements name axis 'sp', which is not an axis of the mesh ('dp', 'tp')" in errors["axis"]
    assert errors["type"].startswith("TypeError: the placement of axis 'dp' must be a placement")
    assert "must be a sequence or mapping of placements, e.g. [Shard(0)]" in errors["single"]
    assert "has no layout; create it with distribute(tensor, mesh, placements)" in errors["no_layout"]
    assert "the local tensor has shape (3, 4) but" in errors["shape"] and "(2, 4)" in errors["shape"]
    assert "Partial('avg') needs a floating-point tensor" in errors["avg_int"]
