"""Damage is found and named: a flipped byte or a truncated file gives an error naming the file and the tensor on
every read path (load, verify, export), damage to one tensor does not hide the others, and no load path unpickles."""

from __future__ import annotations

import ast
import json
import pickle
import struct
from pathlib import Path

import pytest
import torch

import colo.tensor.checkpoint as checkpoint_package
from colo.tensor.checkpoint import (
    CheckpointError,
    FlatShard,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    read_index,
    save_checkpoint,
    verify_checkpoint,
)
from colo.tensor.checkpoint.cli import main

STATE = {"a": torch.arange(64, dtype=torch.float32).view(8, 8), "b": torch.linspace(0, 1, 48).view(6, 8)}


def _data_range(file: Path, key: str) -> tuple[int, int]:
    """Byte range of tensor ``key`` inside a safetensors file (8-byte header length, JSON header, data)."""
    raw = file.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8 : 8 + header_length])[key]["data_offsets"]
    return 8 + header_length + start, 8 + header_length + end


def _flip(file: Path, position: int) -> None:
    data = bytearray(file.read_bytes())
    data[position] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    save_checkpoint(path, STATE, metadata={"step": 3})
    return path


def test_a_flipped_byte_names_its_tensor_and_spares_the_others(saved, tmp_path):
    file = saved / "rank-00000.safetensors"
    start, end = _data_range(file, "b")
    _flip(file, (start + end) // 2)
    pattern = r"rank-00000\.safetensors \(tensor 'b'.*CRC-32 mismatch"
    with pytest.raises(CheckpointError, match=pattern):
        verify_checkpoint(saved)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(saved, {name: torch.empty_like(t) for name, t in STATE.items()})
    with pytest.raises(CheckpointError, match=pattern):
        export_hf(saved, tmp_path / "hf")
    target = torch.empty(8, 8)
    load_checkpoint(saved, {"a": target}, strict=False)  # the undamaged tensor still loads
    assert torch.equal(target, STATE["a"])


def test_a_truncated_file_names_the_file_and_the_tensor_on_load(saved):
    file = saved / "rank-00000.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors \(tensor '[ab]'"):
        load_checkpoint(saved, {name: torch.empty_like(t) for name, t in STATE.items()})
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors \(tensor '[ab]'"):
        verify_checkpoint(saved)


def test_a_damaged_header_or_a_missing_file_is_named(saved, tmp_path):
    file = saved / "rank-00000.safetensors"
    _flip(file, 12)  # inside the JSON header
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors \(tensor 'a'.*cannot open the file"):
        load_checkpoint(saved, {"a": torch.empty(8, 8)}, strict=False)
    file.unlink()
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors \(tensor 'a'.*cannot open the file"):
        verify_checkpoint(saved)
    (saved / "index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index\.json: the index is not valid JSON"):
        read_index(saved)


_LOAD_PATH_MODULES = ("index", "files", "regions", "load", "integrity", "export", "cli", "__main__")


def test_no_load_path_imports_pickle_or_calls_torch_load():
    root = Path(checkpoint_package.__file__).parent
    for module in _LOAD_PATH_MODULES:
        tree = ast.parse((root / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute) and node.attr in ("load", "serialization"):
                names = [ast.unparse(node)]
            else:
                continue
            for name in names:
                assert "pickle" not in name and not name.startswith("torch.load") and "serialization" not in name, (
                    f"{module}.py: {name}"
                )


def test_loading_verifying_and_exporting_never_unpickle(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ckpt"
    save_checkpoint(path, STATE, metadata={"step": 1})

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling on a checkpoint load path")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    targets = {name: torch.empty_like(t) for name, t in STATE.items()}
    load_checkpoint(path, targets)
    shard = FlatShard(torch.empty(20), (6, 8), 10)
    load_checkpoint(path, {"b": shard}, strict=False)
    assert torch.equal(shard.tensor, STATE["b"].reshape(-1)[10:30])
    verify_checkpoint(path)
    assert latest_checkpoint(tmp_path) == str(path)
    export_hf(path, tmp_path / "hf")
    assert main(["info", str(path)]) == 0
    capsys.readouterr()
