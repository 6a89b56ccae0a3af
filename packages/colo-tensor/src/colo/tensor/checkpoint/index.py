"""The checkpoint index: ``index.json`` maps every tensor name to its global shape, dtype and pieces.

A piece is a rectangular slice of the global tensor (``offsets``, ``shape``) stored under ``key`` in a
safetensors ``file``, optionally narrowed to ``flat_range``: elements ``[start, end)`` of that rectangle's
row-major flattening (how ZeRO and Gemini shard flattened parameters), then stored as a 1-D tensor. Every
piece carries the CRC-32 of its bytes. Free-form, JSON-serialisable ``metadata`` (step, config, RNG state)
sits beside the tensors; nothing is pickled.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch

INDEX_FILE = "index.json"
"""Name of the index inside a checkpoint directory; its presence marks a committed checkpoint."""

FORMAT_VERSION = 1
"""Version of the index schema written by this package."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match what was asked of it."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, *, where: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; a `CheckpointError` naming ``where`` for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r} in the index")
    return dtype


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One stored slice of a tensor.

    Attributes:
        file: the safetensors file, relative to the checkpoint directory.
        key: the tensor's key inside that file.
        offsets: where the rectangle starts in the global tensor, per dimension.
        shape: the rectangle's extent per dimension.
        flat_range: ``[start, end)`` of the rectangle's row-major elements actually stored (as a 1-D tensor),
            or ``None`` when the whole rectangle is stored with its shape.
        crc32: CRC-32 of the stored bytes.
    """

    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat_range: tuple[int, int] | None
    crc32: int

    @property
    def numel(self) -> int:
        """Number of stored elements."""
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(self.shape)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the tensor in the file."""
        return (self.numel,) if self.flat_range is not None else self.shape

    def to_json(self) -> dict:
        """The JSON object of this piece."""
        data = asdict(self)
        data["offsets"], data["shape"] = list(self.offsets), list(self.shape)
        data["flat_range"] = None if self.flat_range is None else list(self.flat_range)
        return data

    @classmethod
    def from_json(cls, data: dict, *, where: str) -> Piece:
        """Parse a piece, raising a `CheckpointError` naming ``where`` if a field is missing or malformed."""
        try:
            flat = data["flat_range"]
            return cls(
                file=str(data["file"]),
                key=str(data["key"]),
                offsets=tuple(int(x) for x in data["offsets"]),
                shape=tuple(int(x) for x in data["shape"]),
                flat_range=None if flat is None else (int(flat[0]), int(flat[1])),
                crc32=int(data["crc32"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise CheckpointError(f"{where}: malformed piece {data!r} in the index ({error!r})") from None


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """A tensor of the checkpoint: global shape, dtype and the pieces that cover it exactly once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        return math.prod(self.shape)


@dataclass(kw_only=True)
class CheckpointIndex:
    """The parsed ``index.json`` of a checkpoint.

    Attributes:
        tensors: tensor name -> `TensorEntry`.
        metadata: free-form JSON-serialisable state (step, config, RNG state, versions).
        expected: tensor name -> global shape of every tensor the checkpoint must hold: what the saving ranks
            held (replicas included) and what the saver declared the model to contain. Reading an index whose
            ``tensors`` lack any of them fails, so an incomplete checkpoint is never loaded, verified as healthy
            or converted. Empty in checkpoints written before colo recorded it.
    """

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    expected: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def missing(self) -> list[str]:
        """The expected tensors the index does not hold with their expected shape, sorted."""
        return sorted(
            name
            for name, shape in self.expected.items()
            if name not in self.tensors or self.tensors[name].shape != tuple(shape)
        )

    def check_complete(self, *, where: str) -> None:
        """Raise a `CheckpointError` naming ``where`` and the missing tensors when `missing` is not empty."""
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise CheckpointError(
                f"{where}: the checkpoint is incomplete: it lacks {len(missing)} of the {len(self.expected)} tensors "
                f"it was saved to hold ({shown}); it cannot be loaded, verified or converted. Save it again from "
                "the run (or an earlier complete checkpoint)"
            )

    def to_json(self) -> str:
        """The index as JSON text."""
        tensors = {
            name: {
                "shape": list(entry.shape),
                "dtype": dtype_name(entry.dtype),
                "pieces": [piece.to_json() for piece in entry.pieces],
            }
            for name, entry in sorted(self.tensors.items())
        }
        expected = {name: list(shape) for name, shape in sorted(self.expected.items())}
        document = {"format_version": FORMAT_VERSION, "metadata": self.metadata, "expected": expected}
        return json.dumps({**document, "tensors": tensors}, indent=1)

    @classmethod
    def from_json(cls, text: str, *, where: str) -> CheckpointIndex:
        """Parse index JSON text read from ``where``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{where}: the index is not valid JSON ({error})") from None
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: index format_version {data.get('format_version')!r}; this colo reads {FORMAT_VERSION}"
            )
        tensors = {}
        for name, entry in data["tensors"].items():
            at = f"{where}, tensor {name!r}"
            tensors[name] = TensorEntry(
                shape=tuple(int(x) for x in entry["shape"]),
                dtype=parse_dtype(entry["dtype"], where=at),
                pieces=tuple(Piece.from_json(p, where=at) for p in entry["pieces"]),
            )
        try:
            expected = {str(name): tuple(int(x) for x in shape) for name, shape in data.get("expected", {}).items()}
        except (AttributeError, TypeError, ValueError) as error:
            raise CheckpointError(f"{where}: malformed 'expected' section in the index ({error!r})") from None
        index = cls(tensors=tensors, metadata=data.get("metadata", {}), expected=expected)
        index.check_complete(where=where)
        return index


def read_index(path: str | os.PathLike) -> CheckpointIndex:
    """Read the index of the committed checkpoint directory ``path``.

    Raises:
        CheckpointError: there is no index (not a checkpoint, or a save that never committed), it is malformed,
            or it lacks tensors it was saved to hold (`CheckpointIndex.expected`).
    """
    index_path = os.path.join(os.fspath(path), INDEX_FILE)
    try:
        with open(index_path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"{index_path} does not exist: {os.fspath(path)!r} is not a committed checkpoint directory"
        ) from None
    return CheckpointIndex.from_json(text, where=index_path)
