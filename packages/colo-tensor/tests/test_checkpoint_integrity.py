"""Damage is found and named: a flipped byte or a truncated file gives an error naming the file and the tensor on
every read path (load whole or a slice, verify, export), damage to one tensor does not hide the others, an index or
file header missing a field is refused naming the file, the tensor and the field, and no load path unpickles."""

from __future__ import annotations

import ast
import json
import pickle
import re
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


def test_a_tensor_held_but_written_by_no_rank_fails_the_save_and_commits_nothing(tmp_path):
    # a replica flag that does not match the layout: every holder takes another rank for the writer
    held = {**STATE, "c": FlatShard(torch.ones(8), (2, 4), 0, replica=True)}
    with pytest.raises(
        CheckpointError,
        match=r"nothing was committed: 1 tensors are held .* no rank wrote .*'c' \(held by ranks \[0\]\)",
    ):
        save_checkpoint(tmp_path / "ckpt", held)
    assert not any(tmp_path.iterdir())  # nothing committed, no temporary directory left


def test_expected_names_that_no_rank_holds_fail_the_save(tmp_path):
    with pytest.raises(CheckpointError, match=r"expects 1 tensors that no rank holds: \['layers.2.w'\]"):
        save_checkpoint(tmp_path / "ckpt", STATE, expected_names=["a", "b", "layers.2.w"])
    assert not any(tmp_path.iterdir())


def test_the_index_records_what_it_must_hold_and_every_reader_refuses_what_lacks_it(tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(path, STATE, expected_names=["a"])
    index = read_index(path)
    assert index.expected == {"a": (8, 8), "b": (6, 8)}
    # an index that lost a tensor (a writer that dropped it): load, verify, export and `latest` refuse it
    document = json.loads((path / "index.json").read_text())
    del document["tensors"]["b"]
    (path / "index.json").write_text(json.dumps(document))
    message = r"incomplete: it lacks 1 of the 2 tensors it was saved to hold \(b\)"
    with pytest.raises(CheckpointError, match=message):
        read_index(path)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, {"a": torch.empty(8, 8)})
    with pytest.raises(CheckpointError, match=message):
        export_hf(path, tmp_path / "hf")
    assert latest_checkpoint(tmp_path) is None
    assert main(["verify", str(path)]) != 0


# --- every read path verifies what it reads ------------------------------------------------------------------------

DOWN_PROJ = "layers.0.mlp.down_proj.weight"
ROWS, COLS = 1024, 640  # 2.5 MiB of fp32: three 1 MiB checksummed blocks


def _ddp_checkpoint(path: Path) -> torch.Tensor:
    """A DDP-style checkpoint (the whole tensor, one piece) of ``DOWN_PROJ``; returns the tensor."""
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    save_checkpoint(path, {DOWN_PROJ: full})
    return full


def _flip_element(path: Path, element: int) -> None:
    """Flip one bit of element ``element`` (row-major, fp32) of ``DOWN_PROJ`` in the rank-0 file."""
    file = path / "rank-00000.safetensors"
    start, _ = _data_range(file, DOWN_PROJ)
    _flip(file, start + 4 * element + 1)


def _first_half() -> FlatShard:
    """What ZeRO at dp=2 holds of ``DOWN_PROJ`` on rank 0: the first half of its flattened elements."""
    return FlatShard(torch.empty(ROWS * COLS // 2), (ROWS, COLS), 0)


def test_a_flat_shard_read_of_a_corrupted_tensor_is_refused_naming_the_file_and_the_tensor(tmp_path):
    # the resharding path the format exists for (DDP saved, ZeRO dp=2 loads): before, it returned the flipped value
    path = tmp_path / "ckpt"
    _ddp_checkpoint(path)
    _flip_element(path, 1000)  # inside the first half
    with pytest.raises(CheckpointError, match=rf"rank-00000\.safetensors \(tensor '{DOWN_PROJ}'.*CRC-32 mismatch"):
        load_checkpoint(path, {DOWN_PROJ: _first_half()})


def _right_half_columns() -> FlatShard:
    """What tensor parallelism at tp=2 (``Shard(1)``) holds of ``DOWN_PROJ`` on rank 1: a sub-rectangle of the piece."""
    return FlatShard(
        torch.empty(ROWS * COLS // 2), (ROWS, COLS), 0, rect_offsets=(0, COLS // 2), rect_shape=(ROWS, COLS // 2)
    )


def test_a_sub_rectangle_read_of_a_corrupted_tensor_is_refused_naming_the_file_and_the_tensor(tmp_path):
    # a tensor-parallel column shard (tp=2, Shard(1)) of the DDP checkpoint: a sub-rectangle of the stored piece
    path = tmp_path / "ckpt"
    full = _ddp_checkpoint(path)
    columns = _right_half_columns()
    load_checkpoint(path, {DOWN_PROJ: columns})
    assert torch.equal(columns.tensor.view(ROWS, COLS // 2), full[:, COLS // 2 :])
    _flip_element(path, 700 * COLS + COLS - 1)  # row 700, last column: inside the rectangle
    columns = _right_half_columns()
    with pytest.raises(CheckpointError, match=rf"rank-00000\.safetensors \(tensor '{DOWN_PROJ}'.*CRC-32 mismatch"):
        load_checkpoint(path, {DOWN_PROJ: columns})


def test_a_slice_is_verified_without_reading_the_whole_tensor(tmp_path):
    path = tmp_path / "ckpt"
    full = _ddp_checkpoint(path)
    _flip_element(path, ROWS * COLS - 10)  # near the end: in a block the first half does not touch
    target = _first_half()
    _, stats = load_checkpoint(path, {DOWN_PROJ: target})
    assert torch.equal(target.tensor, full.reshape(-1)[: ROWS * COLS // 2])
    half_bytes = ROWS * COLS // 2 * 4
    assert half_bytes <= stats.bytes_read[DOWN_PROJ] <= half_bytes + (1 << 20)  # the covering 1 MiB blocks only
    with pytest.raises(CheckpointError, match=rf"\(tensor '{DOWN_PROJ}'.*CRC-32 mismatch in block 2"):
        load_checkpoint(path, {DOWN_PROJ: torch.empty(ROWS, COLS)})


def test_a_checkpoint_without_block_crcs_still_loads_and_its_slices_are_verified_by_the_whole_crc(tmp_path):
    path = tmp_path / "ckpt"
    full = _ddp_checkpoint(path)
    document = json.loads((path / "index.json").read_text())
    for piece in document["tensors"][DOWN_PROJ]["pieces"]:  # as colo wrote pieces before block CRCs
        del piece["block_bytes"], piece["block_crc32"]
    (path / "index.json").write_text(json.dumps(document))
    target = _first_half()
    _, stats = load_checkpoint(path, {DOWN_PROJ: target})
    assert torch.equal(target.tensor, full.reshape(-1)[: ROWS * COLS // 2])
    assert stats.bytes_read[DOWN_PROJ] == ROWS * COLS * 4 + ROWS * COLS // 2 * 4  # the whole piece once, then the half
    _flip_element(path, ROWS * COLS - 10)
    with pytest.raises(CheckpointError, match=rf"\(tensor '{DOWN_PROJ}'.*CRC-32 mismatch"):
        load_checkpoint(path, {DOWN_PROJ: _first_half()})


# --- the index is validated against its schema on open ---------------------------------------------------------------


def _drop(document: dict, where: str, field: str) -> None:
    entry = document["tensors"]["b"]
    del (entry if where == "tensor" else entry["pieces"][0])[field]


@pytest.mark.parametrize(
    ("where", "field", "named"),
    [
        ("tensor", "shape", r"tensor 'b'"),
        ("tensor", "dtype", r"tensor 'b'"),
        ("tensor", "pieces", r"tensor 'b'"),
        ("piece", "offsets", r"tensor 'b', piece 0"),
        ("piece", "crc32", r"tensor 'b', piece 0"),
    ],
)
def test_an_index_missing_a_field_is_refused_naming_the_file_the_tensor_and_the_field(
    saved, capsys, where, field, named
):
    document = json.loads((saved / "index.json").read_text())
    _drop(document, where, field)
    (saved / "index.json").write_text(json.dumps(document))
    message = rf"index\.json, {named}: the required field '{field}' is missing"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(saved, {name: torch.empty_like(t) for name, t in STATE.items()})
    with pytest.raises(CheckpointError, match=message):
        read_index(saved)
    assert main(["verify", str(saved)]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error) and error.count("\n") == 1, error  # one line, no traceback


def test_a_file_header_missing_a_field_is_refused_naming_the_file_the_tensor_and_the_field(saved, capsys):
    file = saved / "rank-00000.safetensors"
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    del header["b"]["shape"]
    text = json.dumps(header).encode().ljust(length)  # shorter than before: same length with padding
    file.write_bytes(raw[:8] + text + raw[8 + length :])
    message = r"rank-00000\.safetensors \(tensor 'b'.*lacks the required field 'shape'"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(saved, {name: torch.empty_like(t) for name, t in STATE.items()})
    assert main(["verify", str(saved)]) == 2
    assert re.search(message, capsys.readouterr().err)
