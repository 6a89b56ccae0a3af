"""Checkpoints saved under 2D (4 ranks), 2.5D with d=2 and 3D (8 ranks) load into 1D tp2 layouts and into one process,
and the 1D checkpoint loads back into the grid layouts: every tensor ``torch.equal`` to the full value it is a piece
of (the format stores pieces with their global offsets, so the grid layouts need nothing of their own)."""

from __future__ import annotations

import os

import torch

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import Shard, distribute, layout_of, load_checkpoint, save_checkpoint, set_layout
from colo.tensor.tp2d import LayerNorm2D, Linear2D, QKVLinear2D, VocabParallelEmbedding2D
from colo.tensor.tp3d import Embedding3D, LayerNorm3D, Linear3D
from colo.tensor.tp_grid import grid_mesh

# name -> (full shape, the 1D tp2 placement: column-parallel rows, row-parallel columns, or replicated)
SHAPES = {
    "up.weight": ((12, 8), {"tp": 0}),
    "up.bias": ((12,), {"tp": 0}),
    "qkv.q_weight": ((8, 8), {"tp": 0}),
    "qkv.k_weight": ((4, 8), {"tp": 0}),
    "qkv.v_weight": ((4, 8), {"tp": 0}),
    "norm.weight": ((8,), {}),
    "norm.bias": ((8,), {}),
    "embed.weight": ((16, 8), {"tp": 1}),
}


def _full():
    generator = torch.Generator().manual_seed(3)
    return {name: torch.randn(*shape, generator=generator) for name, (shape, _) in SHAPES.items()}


def _cube_params(mesh, full):
    up = Linear3D(8, 12, mesh=mesh)
    up.load_full(full["up.weight"], full["up.bias"])
    norm = LayerNorm3D(8, mesh=mesh)
    norm.load_full(full["norm.weight"], full["norm.bias"])
    embed = Embedding3D(16, 8, mesh=mesh)
    embed.load_full(full["embed.weight"])
    modules = {"up": up, "norm": norm, "embed": embed}
    return {f"{m}.{n}": p for m, module in modules.items() for n, p in module.named_parameters()}


def _grid_params(mesh, full):
    up = Linear2D(8, 12, mesh=mesh)
    up.load_full(full["up.weight"], full["up.bias"])
    qkv = QKVLinear2D(8, 4, 2, 2, mesh=mesh)
    qkv.load_full(torch.cat([full["qkv.q_weight"], full["qkv.k_weight"], full["qkv.v_weight"]]))
    norm = LayerNorm2D(8, mesh=mesh)
    norm.load_full(full["norm.weight"], full["norm.bias"])
    embed = VocabParallelEmbedding2D(16, 8, mesh=mesh)
    embed.load_full(full["embed.weight"])
    modules = {"up": up, "qkv": qkv, "norm": norm, "embed": embed}
    return {f"{m}.{n}": p for m, module in modules.items() for n, p in module.named_parameters()}


def _one_d_targets(mesh, names):
    targets = {}
    for name in names:
        shape, placement = SHAPES[name]
        placements = {axis: Shard(dim) for axis, dim in placement.items()}
        targets[name] = distribute(torch.zeros(shape), mesh, placements)
    return targets


def grid_round_trip(mode: str, tp: int, depth: int, directory: str):
    full = _full()
    grid = grid_mesh(mode, tp, depth=depth)
    saved = (_cube_params if mode == "3d" else _grid_params)(grid, full)
    directory = os.path.join(directory, mode)
    save_checkpoint(os.path.join(directory, "grid"), saved)
    one_d = Mesh(dp=grid.world_size // 2, tp=2)
    targets = _one_d_targets(one_d, saved)
    load_checkpoint(os.path.join(directory, "grid"), targets)
    unequal = [n for n, t in targets.items() if not torch.equal(t, layout_of(t).local_slice(full[n]))]
    save_checkpoint(os.path.join(directory, "one_d"), targets)
    back = {name: torch.zeros_like(p) for name, p in saved.items()}
    for name, tensor in back.items():
        set_layout(tensor, layout_of(saved[name]))
    load_checkpoint(os.path.join(directory, "one_d"), back)
    unequal += [f"back {n}" for n, t in back.items() if not torch.equal(t, layout_of(t).local_slice(full[n]))]
    return unequal


def _check_in_one_process(directory, mode):
    full = _full()
    names = [n for n in SHAPES if mode != "3d" or not n.startswith("qkv")]
    for name in ("grid", "one_d"):
        whole = {n: torch.zeros(SHAPES[n][0]) for n in names}
        load_checkpoint(os.path.join(directory, mode, name), whole)
        assert all(torch.equal(whole[n], full[n]) for n in names), (mode, name)


def test_2d_checkpoint_loads_in_1d_tp2_in_one_process_and_back(tmp_path):
    assert run_distributed(grid_round_trip, "2d", 4, 1, str(tmp_path), world_size=4) == [[]] * 4
    _check_in_one_process(str(tmp_path), "2d")


def _eight_rank_round_trips(directory):
    return grid_round_trip("2.5d", 8, 2, directory) + grid_round_trip("3d", 8, 1, directory)


def test_2p5d_and_3d_checkpoints_load_in_1d_tp2_in_one_process_and_back(tmp_path):
    assert run_distributed(_eight_rank_round_trips, str(tmp_path), world_size=8) == [[]] * 8
    _check_in_one_process(str(tmp_path), "2.5d")
    _check_in_one_process(str(tmp_path), "3d")
