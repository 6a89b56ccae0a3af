"""The checkpoint index: ``index.json`` maps every tensor name to its global shape, dtype and pieces.

A piece is a rectangular slice of the global tensor (``offsets``, ``shape``) stored under ``key`` in a
safetensors ``file``, optionally narrowed to ``flat_range``: elements ``[start, end)`` of that rectangle's
row-major flattening (how ZeRO and Gemini shard flattened parameters), then stored as a 1-D tensor. Every
piece carries the CRC-32 of its stored bytes and the CRC-32 of each ``block_bytes`` block of them (checkpoints
written before block CRCs have only the first), so any part of a piece is verified when it is read. Free-form,
JSON-serialisable ``metadata`` (step, config, RNG state) sits beside the tensors; nothing is pickled.

The index is validated against this schema when it is read: a missing or malformed field is a
`CheckpointFormatError` naming the file, the tensor (and piece) and the field, never a ``KeyError`` from deep inside
a load.
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


class CheckpointFormatError(CheckpointError):
    """The index or a file header does not follow the checkpoint format: a required field is missing or malformed
    (a damaged or hand-edited index, or one not written by colo). The message names the file, the tensor and the
    field."""


_MISSING = object()


def _field(data: dict, key: str, *, where: str, default=_MISSING):
    """``data[key]``, or a `CheckpointFormatError` naming ``where`` and the field when it is absent."""
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{where}: expected a JSON object, found {type(data).__name__} {data!r:.80}")
    if key not in data:
        if default is not _MISSING:
            return default
        raise CheckpointFormatError(
            f"{where}: the required field {key!r} is missing (a damaged or hand-edited index; colo writes it)"
        )
    return data[key]


def _int(value, key: str, *, where: str, low: int = 0, high: int | None = None) -> int:
    """``value`` as a JSON integer in ``[low, high)``, else a `CheckpointFormatError` naming the field."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value >= high):
        span = f">= {low}" if high is None else f"in [{low}, {high})"
        raise CheckpointFormatError(f"{where}: field {key!r} is {value!r:.80}; expected an integer {span}")
    return value


def _ints(value, key: str, *, where: str, length: int | None = None) -> tuple[int, ...]:
    """``value`` as a list of non-negative JSON integers (of ``length`` when given)."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        expected = "a list" if length is None else f"a list of {length}"
        raise CheckpointFormatError(f"{where}: field {key!r} is {value!r:.80}; expected {expected} of integers >= 0")
    return tuple(_int(x, key, where=where) for x in value)


def _text(value, key: str, *, where: str) -> str:
    if not isinstance(value, str):
        raise CheckpointFormatError(f"{where}: field {key!r} is {value!r:.80}; expected a string")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, *, where: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; a `CheckpointFormatError` naming ``where`` for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r} in the index")
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
        block_bytes: the size of the checksummed blocks of the stored bytes, or ``None`` (a checkpoint written
            before block CRCs).
        block_crc32: the CRC-32 of each ``block_bytes`` block of the stored bytes (the last may be shorter), or
            ``None``.
    """

    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat_range: tuple[int, int] | None
    crc32: int
    block_bytes: int | None = None
    block_crc32: tuple[int, ...] | None = None

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
        """The JSON object of this piece (without the block fields when there are no block CRCs)."""
        data = asdict(self)
        data["offsets"], data["shape"] = list(self.offsets), list(self.shape)
        data["flat_range"] = None if self.flat_range is None else list(self.flat_range)
        if self.block_crc32 is None:
            del data["block_bytes"], data["block_crc32"]
        else:
            data["block_crc32"] = list(self.block_crc32)
        return data

    @classmethod
    def from_json(cls, data: dict, *, where: str) -> Piece:
        """Parse a piece, raising a `CheckpointFormatError` naming ``where`` and the field if one is missing or
        malformed."""
        file = _text(_field(data, "file", where=where), "file", where=where)
        key = _text(_field(data, "key", where=where), "key", where=where)
        offsets = _ints(_field(data, "offsets", where=where), "offsets", where=where)
        shape = _ints(_field(data, "shape", where=where), "shape", where=where, length=len(offsets))
        flat = _field(data, "flat_range", where=where)
        flat_range = None if flat is None else _ints(flat, "flat_range", where=where, length=2)
        if flat_range is not None and not flat_range[0] <= flat_range[1] <= math.prod(shape):
            raise CheckpointFormatError(
                f"{where}: field 'flat_range' is {list(flat_range)}; expected [start, end) within the "
                f"{math.prod(shape)} elements of the piece's rectangle {list(shape)}"
            )
        crc32 = _int(_field(data, "crc32", where=where), "crc32", where=where, high=1 << 32)
        block_bytes = _field(data, "block_bytes", where=where, default=None)
        blocks = _field(data, "block_crc32", where=where, default=None)
        if (block_bytes is None) != (blocks is None):
            present, absent = ("block_bytes", "block_crc32") if blocks is None else ("block_crc32", "block_bytes")
            raise CheckpointFormatError(
                f"{where}: field {present!r} is present but the required field {absent!r} is missing"
            )
        if blocks is not None:
            block_bytes = _int(block_bytes, "block_bytes", where=where, low=1)
            if not isinstance(blocks, list):
                raise CheckpointFormatError(
                    f"{where}: field 'block_crc32' is {blocks!r:.80}; expected a list of integers"
                )
            blocks = tuple(_int(crc, "block_crc32", where=where, high=1 << 32) for crc in blocks)
        return cls(
            file=file,
            key=key,
            offsets=offsets,
            shape=shape,
            flat_range=flat_range,
            crc32=crc32,
            block_bytes=block_bytes,
            block_crc32=blocks,
        )

    def check_fits(self, shape: tuple[int, ...], dtype: torch.dtype, *, where: str) -> None:
        """Raise a `CheckpointFormatError` naming ``where`` unless the piece lies inside a tensor of ``shape`` and
        its block CRCs count the blocks of its stored bytes."""
        if len(self.offsets) != len(shape) or any(o + s > n for o, s, n in zip(self.offsets, self.shape, shape)):
            raise CheckpointFormatError(
                f"{where}: the piece at offsets {list(self.offsets)} of shape {list(self.shape)} lies outside the "
                f"tensor's shape {list(shape)}"
            )
        if self.block_crc32 is not None:
            if self.block_bytes % dtype.itemsize:
                raise CheckpointFormatError(
                    f"{where}: field 'block_bytes' is {self.block_bytes}, not a multiple of the {dtype.itemsize}-byte "
                    f"elements of {dtype}"
                )
            expected = -(-self.numel * dtype.itemsize // self.block_bytes)
            if len(self.block_crc32) != expected:
                raise CheckpointFormatError(
                    f"{where}: field 'block_crc32' lists {len(self.block_crc32)} CRCs but the piece's "
                    f"{self.numel * dtype.itemsize} bytes make {expected} blocks of {self.block_bytes}"
                )


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
        version = _field(data, "format_version", where=where)
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{where}: index format_version {version!r}; this colo reads {FORMAT_VERSION}")
        tensors = {}
        for name, entry in _mapping(_field(data, "tensors", where=where), "tensors", where=where).items():
            at = f"{where}, tensor {name!r}"
            shape = _ints(_field(entry, "shape", where=at), "shape", where=at)
            dtype = parse_dtype(_text(_field(entry, "dtype", where=at), "dtype", where=at), where=at)
            pieces = _field(entry, "pieces", where=at)
            if not isinstance(pieces, list):
                raise CheckpointFormatError(f"{at}: field 'pieces' is {pieces!r:.80}; expected a list of pieces")
            parsed = []
            for number, data_piece in enumerate(pieces):
                piece = Piece.from_json(data_piece, where=f"{at}, piece {number}")
                piece.check_fits(shape, dtype, where=f"{at}, piece {number}")
                parsed.append(piece)
            tensors[name] = TensorEntry(shape=shape, dtype=dtype, pieces=tuple(parsed))
        expected = {
            name: _ints(shape, "expected", where=f"{where}, expected tensor {name!r}")
            for name, shape in _mapping(data.get("expected", {}), "expected", where=where).items()
        }
        metadata = _mapping(data.get("metadata", {}), "metadata", where=where)
        index = cls(tensors=tensors, metadata=metadata, expected=expected)
        index.check_complete(where=where)
        return index


def _mapping(value, key: str, *, where: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"{where}: field {key!r} is {value!r:.80}; expected a JSON object")
    return value


def read_index(path: str | os.PathLike) -> CheckpointIndex:
    """Read the index of the committed checkpoint directory ``path``.

    Raises:
        CheckpointFormatError: the index misses a required field or one is malformed (the message names the file,
            the tensor and the field).
        CheckpointError: there is no index (not a checkpoint, or a save that never committed), it is not JSON, or it
            lacks tensors it was saved to hold (`CheckpointIndex.expected`).
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
