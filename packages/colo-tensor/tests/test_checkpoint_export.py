"""Hugging Face export and the command line: a sharded checkpoint, whatever its layout, exports to safetensors that
``safetensors.torch.load_file`` reads back equal to the saved full tensors, streaming one tensor at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import Shard, distribute
from colo.tensor.checkpoint import CheckpointError, FlatShard, export_hf, save_checkpoint
from colo.tensor.checkpoint import export as export_module
from colo.tensor.checkpoint.cli import main
from colo.tensor.placement import chunk_range

WEIGHTS = {
    "model.embed_tokens.weight": ((16, 8), torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": ((8, 8), torch.float32),
    "model.layers.0.mlp.up_proj.weight": ((12, 8), torch.float32),
    "model.norm.weight": ((8,), torch.float32),
    "lm_head.weight": ((16, 8), torch.float32),
}


def full_state() -> dict[str, torch.Tensor]:
    """The unsharded state: weights, one optimizer state and an integer buffer."""
    generator = torch.Generator().manual_seed(3)
    state = {name: torch.randn(shape, generator=generator).to(dtype) for name, (shape, dtype) in WEIGHTS.items()}
    state["optim/lm_head.weight/exp_avg"] = torch.randn(16, 8, generator=generator)
    state["model.rotary.positions"] = torch.arange(10, dtype=torch.int64)
    return state


def _save_tp_and_zero(path: str) -> None:
    """tp=2 rectangles for the matrices, ZeRO flat shards for the rest, a plain tensor written by rank 0."""
    mesh = Mesh(tp=2)
    rank = mesh.rank("tp")
    state = {}
    for name, full in full_state().items():
        if name.endswith("proj.weight") or name == "model.embed_tokens.weight":
            state[name] = distribute(full, mesh, [Shard(0 if "embed" in name else 1)])
        elif name == "model.rotary.positions":
            state[name] = full
        else:
            start, size = chunk_range(full.numel(), 2, rank)
            state[name] = FlatShard(full.reshape(-1)[start : start + size].clone(), tuple(full.shape), start)
    save_checkpoint(path, state, metadata={"step": 5}, group=mesh.group("tp"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("export") / "step-5")
    run_distributed(_save_tp_and_zero, path, world_size=2)
    return path


def test_export_single_file_round_trips_the_weights_without_optimizer_states(checkpoint, tmp_path):
    report = export_hf(checkpoint, tmp_path / "hf")
    assert report.files == (str(tmp_path / "hf" / "model.safetensors"),) and report.index_file is None
    exported = load_file(report.files[0])
    expected = {name: t for name, t in full_state().items() if not name.startswith("optim/")}
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    with safe_open(report.files[0], framework="pt") as file:
        assert file.metadata() == {"format": "pt"}  # what transformers' from_pretrained requires
    assert report.total_bytes == sum(t.numel() * t.element_size() for t in expected.values())


def test_sharded_export_writes_a_correct_index_and_converts_floats(checkpoint, tmp_path):
    out = tmp_path / "hf"
    limit = 600  # bytes: the 16x8 matrices (256 B in bf16) share files, no file holds more than 600 B
    report = export_hf(checkpoint, out, max_shard_bytes=limit, dtype="bfloat16", include=["model.*", "lm_head.*"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected = {name: t for name, t in full_state().items() if not name.startswith("optim/")}
    assert sorted(index["weight_map"]) == sorted(expected)
    num_files = len(report.files)
    assert num_files > 1
    assert [os.path.basename(f) for f in report.files] == [
        f"model-{i:05d}-of-{num_files:05d}.safetensors" for i in range(1, num_files + 1)
    ]
    total = 0
    for file in report.files:
        tensors = load_file(file)
        assert sorted(tensors) == sorted(n for n, f in index["weight_map"].items() if f == os.path.basename(file))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1
        total += size
        for name, tensor in tensors.items():
            want = expected[name].to(torch.bfloat16) if expected[name].is_floating_point() else expected[name]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name  # int64 positions stay int64
    assert index["metadata"]["total_size"] == total == report.total_bytes

    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(checkpoint, out)
    export_hf(checkpoint, out, overwrite=True)  # one file now: the stale shards and index are removed
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_export_streams_one_tensor_at_a_time(checkpoint, tmp_path, monkeypatch):
    original, alive, most_alive = export_module.read_whole_tensor, [], []

    def tracked(*args, **kwargs):
        most_alive.append(sum(ref() is not None for ref in alive))
        tensor = original(*args, **kwargs)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(export_module, "read_whole_tensor", tracked)
    export_hf(checkpoint, tmp_path / "hf", max_shard_bytes=10**9, exclude=())
    assert len(most_alive) == len(full_state()) and max(most_alive) == 0  # the previous tensor is always gone


def test_export_selection_and_bad_arguments_are_explained(checkpoint, tmp_path):
    report = export_hf(checkpoint, tmp_path / "optim", include=["optim/*"], exclude=())
    assert list(load_file(report.files[0])) == ["optim/lm_head.weight/exp_avg"]
    with pytest.raises(ValueError, match="no tensor.*include"):
        export_hf(checkpoint, tmp_path / "none", include=["decoder.*"])
    with pytest.raises(ValueError, match="dtype"):
        export_hf(checkpoint, tmp_path / "bad", dtype="int8")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        export_hf(checkpoint, tmp_path / "bad", max_shard_bytes="five gigs")
    assert export_module.parse_size("5GB") == 5 * 10**9 and export_module.parse_size("2MiB") == 2 * 2**20


def test_export_of_a_corrupt_checkpoint_names_file_and_tensor_and_leaves_nothing(tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(path, {"a": torch.zeros(64), "b": torch.ones(64)})
    file = path / "rank-00000.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors \(tensor '[ab]'.*CRC"):
        export_hf(path, tmp_path / "hf")
    assert os.listdir(tmp_path / "hf") == []  # no partial export


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "colo.tensor.checkpoint", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_command_line_info_verify_and_export(checkpoint, tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    save_checkpoint(corrupt, {"w": torch.arange(32, dtype=torch.float32)})
    data = bytearray((corrupt / "rank-00000.safetensors").read_bytes())
    data[-1] ^= 0x01
    (corrupt / "rank-00000.safetensors").write_bytes(bytes(data))
    out = tmp_path / "hf"
    # two real `python -m` runs (exit status, output), started together; the rest through the same main()
    verify_corrupt = _cli("verify", str(corrupt))
    export = _cli("export", checkpoint, str(out), "--max-shard-size", "500B", "--dtype", "bfloat16")

    assert main(["info", checkpoint]) == 0
    info = capsys.readouterr().out
    assert '{"step": 5}' in info
    assert "7 tensors" in info and "rank-00000.safetensors" in info and "rank-00001.safetensors" in info
    lines = {line.split()[0]: line.split()[1:] for line in info.splitlines() if line.startswith(("model.", "lm_"))}
    assert lines["model.embed_tokens.weight"][:2] == ["16x8", "bfloat16"]
    assert " ".join(lines["model.embed_tokens.weight"][2:]) == "2 rectangles (2x1 grid)"
    assert " ".join(lines["model.layers.0.mlp.up_proj.weight"][2:]) == "2 rectangles (1x2 grid)"
    assert " ".join(lines["model.norm.weight"][2:]) == "2 flat ranges"
    assert " ".join(lines["model.rotary.positions"][1:]) == "int64 whole"
    assert main(["info", "--json", checkpoint]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"]["lm_head.weight"]["pieces"] == 2
    assert main(["verify", checkpoint]) == 0
    verify = capsys.readouterr().out
    assert verify.startswith("ok:") and "7 tensors" in verify

    _, error = verify_corrupt.communicate(timeout=120)
    assert verify_corrupt.returncode == 1
    assert "rank-00000.safetensors" in error and "'w'" in error and "CRC" in error

    exported, _ = export.communicate(timeout=120)
    assert export.returncode == 0, exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "optim/lm_head.weight/exp_avg" not in index["weight_map"]
    tensors = {}
    for file in set(index["weight_map"].values()):
        tensors.update(load_file(out / file))
    expected = full_state()
    assert sorted(tensors) == sorted(name for name in expected if not name.startswith("optim/"))
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
