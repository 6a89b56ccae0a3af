"""`export_hf`: a consolidated Hugging Face-style ``model.safetensors`` (sharded with an index when large) from any
sharded checkpoint, offline, streaming one tensor at a time."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import struct
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .files import PieceReader, fsync_path
from .index import CheckpointError, TensorEntry, parse_dtype, read_index
from .load import read_whole_tensor

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
"""torch dtype -> the dtype name in a safetensors header."""

SINGLE_FILE = "model.safetensors"
INDEX_FILE_HF = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass(frozen=True)
class ExportReport:
    """What `export_hf` wrote.

    Attributes:
        files: the safetensors files written, in order (paths).
        index_file: the ``model.safetensors.index.json`` path, or ``None`` for a single file.
        num_tensors: number of tensors exported.
        total_bytes: bytes of tensor data exported (the index's ``total_size``).
    """

    files: tuple[str, ...]
    index_file: str | None
    num_tensors: int
    total_bytes: int


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, an int stays (bytes), as Hugging Face reads sizes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE.fullmatch(str(size))
        if match is None:
            raise ValueError(f"max_shard_bytes={size!r}: give bytes as an int or a size such as '5GB' or '500MiB'")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_bytes={size!r} must be positive")
    return value


def _selected(names: Sequence[str], include: Sequence[str] | None, exclude: Sequence[str]) -> list[str]:
    include = ["*"] if include is None else list(include)
    return [
        name
        for name in names
        if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(fnmatch.fnmatchcase(name, p) for p in exclude)
    ]


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in name order: a new shard when the next tensor would overflow; a larger tensor gets its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards if shards[-1] else []


def _write_safetensors(
    path: str, names: list[str], entries: dict[str, TensorEntry], dtype_of: dict[str, torch.dtype], reader
) -> None:
    """Write one safetensors file tensor by tensor: the header first (sizes are known), then each tensor's bytes.

    Tensors are laid out by decreasing element size, then name, so each starts aligned to its element size
    (the data section starts at a multiple of 8), as safetensors' own writer does.
    """
    order = sorted(names, key=lambda n: (-dtype_of[n].itemsize, n))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        nbytes = entries[name].numel * dtype_of[name].itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype_of[name]],
            "shape": list(entries[name].shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for name in order:
            tensor = read_whole_tensor(reader, name, entries[name]).to(dtype_of[name])
            file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor  # one tensor in memory at a time
        file.flush()
        os.fsync(file.fileno())


def _existing_exports(out_dir: str) -> list[str]:
    if not os.path.isdir(out_dir):
        return []
    return sorted(
        name for name in os.listdir(out_dir) if name in (SINGLE_FILE, INDEX_FILE_HF) or _SHARD_FILE.fullmatch(name)
    )


def export_hf(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = ("optim/*",),
    overwrite: bool = False,
) -> ExportReport:
    """Export a sharded checkpoint, whatever layout saved it, as Hugging Face-style consolidated safetensors.

    Writes ``model.safetensors``, or, when the tensors exceed ``max_shard_bytes``,
    ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json`` (``{"metadata": {"total_size":
    ...}, "weight_map": {name: file}}``), the files ``transformers``' ``from_pretrained`` and
    ``safetensors.torch.load_file`` read. Tensor names are kept (the checkpoint's names are already the model's
    unfused parameter names). Runs offline in one process, without ``torch.distributed``; streams: each tensor is
    assembled from its pieces (every CRC checked), converted, written and dropped before the next, so memory
    holds one tensor, never a whole shard. Files are written under temporary names and renamed into place, the
    index last.

    Args:
        checkpoint_dir: a committed checkpoint directory (see `latest_checkpoint`).
        out_dir: where to write (created if missing; may already hold ``config.json`` and tokenizer files).
        max_shard_bytes: the most tensor bytes per file, an int or a size such as ``"5GB"`` or ``"500MiB"``
            (default ``"5GB"``, as Hugging Face); a larger tensor gets a file of its own.
        dtype: convert floating-point tensors to this dtype (e.g. ``torch.bfloat16`` from fp32 masters); integer
            and bool tensors are kept. Default: keep every dtype.
        include: glob patterns (``fnmatch``, ``*`` crosses ``/`` and ``.``) of the tensors to export; default all.
        exclude: glob patterns of tensors to leave out, applied after ``include``; default ``("optim/*",)``:
            the optimizer states.
        overwrite: replace an earlier export in ``out_dir`` (its stale shard files are removed); without it an
            existing ``model*.safetensors`` there is an error.

    Returns:
        An `ExportReport` of the files written.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete or corrupt (naming the file and the tensor).
        FileExistsError: ``out_dir`` already holds an export and ``overwrite`` is false.
        ValueError: no tensor selected, or a bad ``dtype`` or ``max_shard_bytes``.
    """
    if sys.byteorder != "little":
        raise RuntimeError("export_hf: safetensors files are little-endian; this machine is big-endian")
    checkpoint_dir, out_dir = os.fspath(checkpoint_dir), os.fspath(out_dir)
    limit = parse_size(max_shard_bytes)
    if isinstance(dtype, str):
        try:
            dtype = parse_dtype(dtype.removeprefix("torch."), where="export_hf")
        except CheckpointError:
            raise ValueError(f"export_hf: dtype={dtype!r} is not a torch dtype; use e.g. 'bfloat16'") from None
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"export_hf: dtype={dtype!r} must be a floating-point torch dtype, e.g. torch.bfloat16")
    index = read_index(checkpoint_dir)
    names = _selected(list(index.tensors), include, exclude)
    if not names:
        raise ValueError(
            f"export_hf: no tensor of {checkpoint_dir} matches include={include!r} and exclude={tuple(exclude)!r}; "
            f"it holds e.g. {sorted(index.tensors)[:5]}"
        )
    dtype_of = {}
    for name in names:
        stored = index.tensors[name].dtype
        dtype_of[name] = dtype if dtype is not None and stored.is_floating_point else stored
        if dtype_of[name] not in SAFETENSORS_DTYPES:
            raise ValueError(f"export_hf: tensor {name!r} is {dtype_of[name]}, which safetensors files cannot hold")
    existing = _existing_exports(out_dir)
    if existing and not overwrite:
        raise FileExistsError(f"export_hf: {out_dir} already holds {existing}; pass overwrite=True to replace them")

    sizes = {name: index.tensors[name].numel * dtype_of[name].itemsize for name in names}
    shards = _plan_shards(sizes, limit)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    os.makedirs(out_dir, exist_ok=True)
    suffix = f".tmp-{uuid.uuid4().hex[:12]}"
    written: list[str] = []
    try:
        with PieceReader(checkpoint_dir) as reader:
            for file, shard in zip(files, shards):
                written.append(os.path.join(out_dir, file + suffix))
                _write_safetensors(written[-1], shard, index.tensors, dtype_of, reader)
        index_text = None
        if len(shards) > 1:
            weight_map = {name: file for file, shard in zip(files, shards) for name in shard}
            index_text = json.dumps(
                {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2,
            )
            written.append(os.path.join(out_dir, INDEX_FILE_HF + suffix))
            with open(written[-1], "w", encoding="utf-8") as handle:
                handle.write(index_text + "\n")
                handle.flush()
                os.fsync(handle.fileno())
    except BaseException:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
        raise
    final = files + ([INDEX_FILE_HF] if len(shards) > 1 else [])
    for path, name in zip(written, final):  # the index last: a reader never sees an index without its files
        os.replace(path, os.path.join(out_dir, name))
    for stale in sorted(set(existing) - set(final), key=lambda n: n != INDEX_FILE_HF):  # a stale index first
        os.remove(os.path.join(out_dir, stale))
    fsync_path(out_dir)
    return ExportReport(
        files=tuple(os.path.join(out_dir, file) for file in files),
        index_file=os.path.join(out_dir, INDEX_FILE_HF) if len(shards) > 1 else None,
        num_tensors=len(names),
        total_bytes=sum(sizes.values()),
    )
