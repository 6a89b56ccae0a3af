"""The sharded checkpoint format: a state saved with one layout loads, torch.equal, into any other."""

from __future__ import annotations

import json
import os

import pytest
import torch

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import Shard, distribute
from colo.tensor.checkpoint import (
    CheckpointError,
    FlatShard,
    latest_checkpoint,
    load_checkpoint,
    read_index,
    save_checkpoint,
    verify_checkpoint,
)
from colo.tensor.placement import chunk_range

SHAPES = {"embed.weight": (11, 6), "layers.0.mlp.up_proj.weight": (7, 9), "norm.weight": (6,), "step_scale": ()}


def reference_state() -> dict[str, torch.Tensor]:
    """The unsharded state every test saves (same on every rank and in the pytest process)."""
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    state["embed.weight"] = state["embed.weight"].to(torch.bfloat16)
    state["positions"] = torch.arange(13, dtype=torch.int64)
    return state


def flat_shard(full: torch.Tensor, num_ranks: int, rank: int) -> FlatShard:
    """Rank ``rank``'s ZeRO-style shard: a contiguous range of the flattened tensor (uneven, torch.chunk sizes)."""
    start, size = chunk_range(full.numel(), num_ranks, rank)
    return FlatShard(full.reshape(-1)[start : start + size].clone(), tuple(full.shape), start)


def empty_flat_shard(full: torch.Tensor, num_ranks: int, rank: int) -> FlatShard:
    start, size = chunk_range(full.numel(), num_ranks, rank)
    return FlatShard(torch.full((size,), -1, dtype=full.dtype), tuple(full.shape), start)


# --- rank functions ------------------------------------------------------------------------------------------


def _save_flat(path: str) -> None:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    state = {name: flat_shard(full, world, rank) for name, full in reference_state().items()}
    save_checkpoint(path, state, metadata={"step": 7, "scheduler": {"last_epoch": 3}})


def _load_flat(path: str) -> bool:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    reference = reference_state()
    targets = {name: empty_flat_shard(full, world, rank) for name, full in reference.items()}
    metadata, _ = load_checkpoint(path, targets)
    expected = {name: flat_shard(full, world, rank).tensor for name, full in reference.items()}
    assert metadata == {"step": 7, "scheduler": {"last_epoch": 3}}
    return all(torch.equal(targets[name].tensor, expected[name]) for name in reference)


def _load_tp_from_flat(path: str) -> dict:
    mesh = Mesh(tp=torch.distributed.get_world_size())
    reference = reference_state()
    matrices = [name for name, full in reference.items() if full.dim() == 2]
    targets = {name: distribute(torch.zeros_like(reference[name]), mesh, [Shard(1)]) for name in matrices}
    load_checkpoint(path, targets, strict=False)
    expected = {name: distribute(reference[name], mesh, [Shard(1)]) for name in matrices}
    return {name: torch.equal(targets[name], expected[name]) for name in matrices}


def _save_tp_dp(path: str) -> None:
    mesh = Mesh(dp=2, tp=2)
    reference = reference_state()
    state = {
        "embed.weight": distribute(reference["embed.weight"], mesh, {"tp": Shard(0)}),  # replicated over dp
        "layers.0.mlp.up_proj.weight": distribute(reference["layers.0.mlp.up_proj.weight"], mesh, [Shard(0), Shard(1)]),
        "norm.weight": distribute(reference["norm.weight"], mesh, {}),  # a layout, replicated everywhere
        "step_scale": reference["step_scale"],  # plain tensors: written by rank 0
        "positions": reference["positions"],
    }
    save_checkpoint(path, state, metadata={"step": 1}, group=mesh.group("dp", "tp"))


def _load_layouts(path: str) -> dict:
    """Load a checkpoint into TP shards (2-D tensors split on dim 0) and report what was read."""
    mesh = Mesh(tp=torch.distributed.get_world_size())
    reference = reference_state()
    targets, expected = {}, {}
    for name, full in reference.items():
        placements = [Shard(0)] if full.dim() == 2 else []
        targets[name] = distribute(torch.zeros_like(full), mesh, placements) if placements else torch.zeros_like(full)
        expected[name] = distribute(full, mesh, placements) if placements else full
    _, stats = load_checkpoint(path, targets)
    return {
        "equal": {name: torch.equal(targets[name], expected[name]) for name in reference},
        "read": stats.elements_read,
        "local": {name: targets[name].numel() for name in reference},
    }


def _save_failing_on_rank_1(path: str) -> str:
    from colo.tensor.checkpoint import save as save_module

    original = save_module._write_file

    def crash(file_path, tensors):
        if torch.distributed.get_rank() == 1:
            with open(file_path, "wb") as file:  # a partial write, then the writer dies
                file.write(b"\x00" * 10)
            raise OSError("disk full (simulated)")
        original(file_path, tensors)

    save_module._write_file = crash
    try:
        _save_flat(path)
    except CheckpointError as error:
        return str(error)
    finally:
        save_module._write_file = original
    return "no error"


# --- tests ---------------------------------------------------------------------------------------------------


def _assert_full_state_loads(path: str) -> None:
    reference = reference_state()
    targets = {name: torch.zeros_like(full) for name, full in reference.items()}
    load_checkpoint(path, targets)
    for name, full in reference.items():
        assert torch.equal(targets[name], full), name


def test_flat_shards_dp4_load_as_dp2_flat_shards_tp_shards_and_whole(tmp_path):
    path = str(tmp_path / "dp4")
    run_distributed(_save_flat, path, world_size=4)
    index = read_index(path)
    for entry in index.tensors.values():  # one piece per rank with a non-empty torch.chunk share
        assert len(entry.pieces) == sum(chunk_range(entry.numel, 4, r)[1] > 0 for r in range(4))
    assert all(piece.flat_range is not None for piece in index.tensors["embed.weight"].pieces)
    assert verify_checkpoint(path).num_tensors == len(reference_state())
    assert run_distributed(_load_flat, path, world_size=2) == [True, True]
    assert all(all(r.values()) for r in run_distributed(_load_tp_from_flat, path, world_size=2))
    _assert_full_state_loads(path)  # dp=4 -> a single process


def test_flat_shards_dp2_load_as_dp4(tmp_path):
    path = str(tmp_path / "dp2")
    run_distributed(_save_flat, path, world_size=2)
    assert run_distributed(_load_flat, path, world_size=4) == [True] * 4


def test_tp2_dp2_writes_replicas_once_and_loads_in_one_process(tmp_path):
    path = str(tmp_path / "tp2dp2")
    run_distributed(_save_tp_dp, path, world_size=4)
    index = read_index(path)
    files = {name: sorted(p.file for p in entry.pieces) for name, entry in index.tensors.items()}
    assert files["embed.weight"] == ["rank-00000.safetensors", "rank-00001.safetensors"]  # dp replicas: once
    assert len(files["layers.0.mlp.up_proj.weight"]) == 4
    assert files["norm.weight"] == files["positions"] == ["rank-00000.safetensors"]
    verify_checkpoint(path)
    _assert_full_state_loads(path)


def test_single_process_loads_into_tp2_reading_only_its_shard(tmp_path):
    path = str(tmp_path / "single")
    save_checkpoint(path, reference_state(), metadata={"step": 0})
    for result in run_distributed(_load_layouts, path, world_size=2):
        assert all(result["equal"].values()), result["equal"]
        # a rank reads exactly its shard of a rectangular piece, never the full tensor
        assert result["read"] == result["local"]
        assert result["read"]["embed.weight"] < reference_state()["embed.weight"].numel()


def test_flipped_byte_and_truncated_file_name_the_file_and_the_tensor(tmp_path):
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, {"w": torch.arange(64, dtype=torch.float32).view(8, 8)})
    file = os.path.join(path, "rank-00000.safetensors")
    data = bytearray(open(file, "rb").read())
    data[-5] ^= 0xFF
    open(file, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors.*'w'.*CRC"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors.*'w'.*CRC"):
        load_checkpoint(path, {"w": torch.empty(8, 8)})
    open(file, "wb").write(bytes(data[:-40]))
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors.*'w'"):
        verify_checkpoint(path)


def test_failed_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path):
    good = str(tmp_path / "step-1")
    run_distributed(_save_flat, good, world_size=2)
    errors = run_distributed(_save_failing_on_rank_1, str(tmp_path / "step-2"), world_size=2)
    assert all("rank 1" in error and "disk full" in error for error in errors), errors
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # nothing committed, the temporary directory removed
    os.makedirs(tmp_path / "step-3.tmp-dead")  # what a killed writer leaves behind
    open(tmp_path / "step-3.tmp-dead" / "rank-00000.safetensors", "wb").write(b"partial")
    assert latest_checkpoint(tmp_path) == good
    _assert_full_state_loads(good)


def test_latest_checkpoint_prefers_the_highest_step(tmp_path):
    for step in (2, 10, 9):
        save_checkpoint(str(tmp_path / f"s{step}"), {"x": torch.ones(2)}, metadata={"step": step})
    assert latest_checkpoint(tmp_path) == str(tmp_path / "s10")
    assert latest_checkpoint(tmp_path / "missing") is None


def test_index_is_json_and_bad_requests_are_explained(tmp_path):
    path = str(tmp_path / "c")
    save_checkpoint(path, {"x": torch.ones(3)}, metadata={"rng": [1, 2]})
    assert json.load(open(os.path.join(path, "index.json")))["metadata"] == {"rng": [1, 2]}
    with pytest.raises(FileExistsError):
        save_checkpoint(path, {"x": torch.ones(3)})
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(str(tmp_path / "d"), {"x": torch.ones(3)}, metadata={"bad": object()})
    with pytest.raises(CheckpointError, match="'y'"):
        load_checkpoint(path, {"y": torch.ones(3)})
    with pytest.raises(CheckpointError, match=r"'x'.*\(4,\)"):
        load_checkpoint(path, {"x": torch.ones(4)})


@pytest.mark.parametrize("saved_as", ["whole", "flat"])
def test_flat_targets_read_one_run_of_a_piece_in_the_same_rectangle(tmp_path, saved_as):
    full = torch.randn(9, 7, generator=torch.Generator().manual_seed(1))
    value = full if saved_as == "whole" else FlatShard(full.reshape(-1).clone(), (9, 7), 0)
    save_checkpoint(tmp_path / "c", {"w": value})
    for start, end in [(0, 63), (3, 4), (6, 15), (14, 21), (20, 63), (62, 63)]:
        target = FlatShard(torch.full((end - start,), -1.0), (9, 7), start)
        _, stats = load_checkpoint(tmp_path / "c", {"w": target})
        assert torch.equal(target.tensor, full.reshape(-1)[start:end]), (start, end)
        rows = (end - 1) // 7 - start // 7 + 1  # at most the rows that hold the run are read
        assert stats.elements_read["w"] <= (end - start if saved_as == "flat" else rows * 7)
    whole = torch.zeros(9, 7)
    load_checkpoint(tmp_path / "c", {"w": whole})
    assert torch.equal(whole, full)
