"""File-level helpers: CRC-32s of tensor bytes (whole and per block), fsync, and the reader of pieces that checks
headers, sizes and CRCs on every read.

Integrity on every read path: a piece records the CRC-32 of its stored bytes and the CRC-32 of every
`BLOCK_BYTES` block of them. A read of any part of a piece -- whole, a flat range of a ZeRO shard, a sub-rectangle of
a tensor-parallel shard -- reads the blocks that cover the part and checks each block's CRC, so a slice is verified
without reading the whole piece (at most two partial blocks more than the slice; an N-D sub-rectangle reads the flat
run from its first to its last element). Pieces of checkpoints written before block CRCs have only the whole CRC: a
partial read of one checks it once per reader (the whole piece is read once, the verified piece remembered).

The reader parses the safetensors files itself (an 8-byte little-endian header length, a JSON header with each
tensor's ``dtype``, ``shape`` and ``data_offsets``, then the data) and maps them into memory, as safetensors does: a
read returns a view of the mapped bytes (no copy until the caller copies them where they belong) once their CRCs
are checked. Nothing is unpickled.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import struct
import zlib
from dataclasses import dataclass

import torch

from .index import CheckpointError, CheckpointFormatError, Piece

BLOCK_BYTES = 1 << 20
"""Bytes per checksummed block of a piece (1 MiB): a partial read reads at most two partial blocks more than it needs,
and the index holds one CRC per MiB of data."""

_CRC32_POLYNOMIAL = 0xEDB88320
"""The CRC-32 polynomial of zlib and safetensors' peers, bit-reflected."""

_HEADER_LIMIT = 100 << 20
"""The largest safetensors header accepted (safetensors' own limit)."""

_SAFETENSORS_DTYPES = {
    code: dtype
    for code, dtype in {
        "F64": getattr(torch, "float64", None),
        "F32": getattr(torch, "float32", None),
        "F16": getattr(torch, "float16", None),
        "BF16": getattr(torch, "bfloat16", None),
        "I64": getattr(torch, "int64", None),
        "I32": getattr(torch, "int32", None),
        "I16": getattr(torch, "int16", None),
        "I8": getattr(torch, "int8", None),
        "U8": getattr(torch, "uint8", None),
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
        "BOOL": getattr(torch, "bool", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "C64": getattr(torch, "complex64", None),
    }.items()
    if dtype is not None
}
"""safetensors dtype codes -> torch dtypes."""


# --- CRC-32 -------------------------------------------------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in row-major order (a view when it already is a contiguous CPU tensor)."""
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).cpu().numpy())


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major order."""
    return zlib.crc32(_tensor_bytes(tensor)) & 0xFFFFFFFF


def _multiply_mod_polynomial(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, both bit-reflected (zlib's ``multmodp``)."""
    product, mask = 0, 1 << 31
    while mask:
        if a & mask:
            product ^= b
        b = (b >> 1) ^ _CRC32_POLYNOMIAL if b & 1 else b >> 1
        mask >>= 1
    return product


@functools.lru_cache(maxsize=64)
def _append_zeros_operator(num_bytes: int) -> int:
    """``x^(8 num_bytes)`` modulo the polynomial: multiplying a CRC by it appends ``num_bytes`` zero bytes."""
    result, power, exponent = 1 << 31, 1 << 30, 8 * num_bytes  # x^0, x^1
    while exponent:
        if exponent & 1:
            result = _multiply_mod_polynomial(power, result)
        power = _multiply_mod_polynomial(power, power)
        exponent >>= 1
    return result


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of ``A``, ``crc2`` of ``B`` and ``length2 = len(B)`` (zlib's
    ``crc32_combine``, which Python's ``zlib`` does not expose)."""
    return _multiply_mod_polynomial(_append_zeros_operator(length2), crc1) ^ crc2


def block_crc32s(data: memoryview, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """CRC-32 of each ``block_bytes`` block of ``data`` (the last one may be shorter)."""
    return [zlib.crc32(data[start : start + block_bytes]) for start in range(0, len(data), block_bytes)]


def tensor_checksums(tensor: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> tuple[int, tuple[int, ...]]:
    """The CRC-32 of a tensor's bytes (row-major) and of each ``block_bytes`` block of them, in one pass."""
    data = _tensor_bytes(tensor)
    blocks = block_crc32s(data, block_bytes)
    whole = 0
    for index, crc in enumerate(blocks):
        length = min(block_bytes, len(data) - index * block_bytes)
        whole = crc if index == 0 else crc32_combine(whole, crc, length)
    return whole, tuple(blocks)


# --- files --------------------------------------------------------------------------------------------------------


def fsync_path(path: str) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_file_name(rank: int) -> str:
    """The safetensors file a rank writes: ``rank-00003.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class _SafetensorsFile:
    """An open safetensors file: its memory map, its size, its parsed header and where the data starts."""

    map: mmap.mmap
    size: int
    header: dict
    data_start: int


@dataclass(frozen=True)
class _Stored:
    """One validated header entry: the tensor's bytes lie at ``[begin, end)`` of the file."""

    begin: int
    end: int


class PieceReader:
    """Reads (parts of) pieces from a checkpoint directory, verifying every byte it returns.

    Files are mapped into memory once, on first use, and forgotten by `close` (or leaving the ``with`` block); a
    returned tensor may be a view of a map, which stays mapped while the tensor lives. Every read checks the file's
    header entry against the index (dtype, shape, size) and the CRC-32 of what it read: the blocks covering the part
    asked for, or, for a piece of an older checkpoint without block CRCs, the whole piece (once per reader).

    Attributes:
        elements_read: elements returned by `read` so far.
        bytes_read: bytes read from files so far, verification included.

    Args:
        directory: the checkpoint directory.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.elements_read = 0
        self.bytes_read = 0
        self._files: dict[str, _SafetensorsFile] = {}
        self._verified: set[tuple[str, str]] = set()

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Forget every open file (a map is unmapped once no tensor read from it is left)."""
        self._files.clear()

    def _where(self, piece: Piece, name: str) -> str:
        return f"{os.path.join(self.directory, piece.file)} (tensor {name!r}, key {piece.key!r})"

    def _open(self, piece: Piece, name: str) -> _SafetensorsFile:
        opened = self._files.get(piece.file)
        if opened is not None:
            return opened
        path = os.path.join(self.directory, piece.file)
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size < 8:
                    raise ValueError(f"{size} bytes, too short for a safetensors header")
                # copy-on-write: tensors over the map are writable (torch.frombuffer) and never write the file
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            (header_length,) = struct.unpack("<Q", mapped[:8])
            if header_length > min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"a header length of {header_length} bytes in a file of {size} bytes")
            header = json.loads(mapped[8 : 8 + header_length])
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (OSError, ValueError) as error:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointError(f"{self._where(piece, name)}: cannot open the file: {error}") from None
        opened = self._files[piece.file] = _SafetensorsFile(mapped, size, header, 8 + header_length)
        return opened

    def _stored(self, file: _SafetensorsFile, piece: Piece, name: str, dtype: torch.dtype) -> _Stored:
        """The header entry of ``piece``, validated against the index."""
        where = self._where(piece, name)
        entry = file.header.get(piece.key)
        if entry is None:
            raise CheckpointError(f"{where}: the file has no readable entry for this piece (no key {piece.key!r})")
        if not isinstance(entry, dict):
            raise CheckpointFormatError(f"{where}: the file's header entry is not a JSON object: {entry!r}")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in entry:
                raise CheckpointFormatError(f"{where}: the file's header entry lacks the required field {field!r}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
            raise CheckpointFormatError(f"{where}: the file's header has a malformed 'shape' {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            raise CheckpointFormatError(f"{where}: the file's header has malformed 'data_offsets' {offsets!r}")
        stored_dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if tuple(shape) != piece.stored_shape:
            raise CheckpointError(f"{where}: stored shape {tuple(shape)} but the index says {piece.stored_shape}")
        if stored_dtype != dtype:
            stored = stored_dtype if stored_dtype is not None else repr(entry["dtype"])
            raise CheckpointError(f"{where}: stored dtype {stored} but the index says {dtype}")
        begin, end = file.data_start + offsets[0], file.data_start + offsets[1]
        if end - begin != piece.numel * dtype.itemsize or begin < file.data_start:
            raise CheckpointError(
                f"{where}: the header's data_offsets {offsets} span {end - begin} bytes but {piece.numel} elements of "
                f"{dtype} take {piece.numel * dtype.itemsize}"
            )
        if end > file.size:
            raise CheckpointError(
                f"{where}: reading failed (truncated or corrupt file?): the piece ends at byte {end} of a "
                f"{file.size}-byte file"
            )
        return _Stored(begin, end)

    def _read_bytes(self, file: _SafetensorsFile, offset: int, length: int) -> torch.Tensor:
        """``length`` bytes of ``file`` from ``offset``: a uint8 tensor over the map (it keeps the map alive)."""
        self.bytes_read += length
        if length == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(file.map, dtype=torch.uint8, count=length, offset=offset)

    def _verify_whole(self, file: _SafetensorsFile, stored: _Stored, piece: Piece, where: str) -> None:
        """Check the whole-piece CRC of an old piece (no block CRCs)."""
        crc = zlib.crc32(memoryview(self._read_bytes(file, stored.begin, stored.end - stored.begin).numpy()))
        self._check_whole_crc(crc, piece, where)

    def _check_whole_crc(self, crc: int, piece: Piece, where: str) -> None:
        if crc != piece.crc32:
            raise CheckpointError(
                f"{where}: CRC-32 mismatch (stored {piece.crc32:#010x}, read {crc:#010x}); the file was altered or "
                "damaged"
            )
        self._verified.add((piece.file, piece.key))

    def _read_run(
        self, file: _SafetensorsFile, stored: _Stored, piece: Piece, where: str, first: int, last: int, dtype
    ) -> torch.Tensor:
        """Elements ``[first, last)`` of the piece's stored (row-major) elements, verified, as a 1-D tensor."""
        itemsize, size = dtype.itemsize, stored.end - stored.begin
        low, high = first * itemsize, last * itemsize
        if piece.block_crc32 is None:  # an older checkpoint: the whole CRC, once per reader
            if (low, high) == (0, size):
                buffer = self._read_bytes(file, stored.begin, size)
                self._check_whole_crc(zlib.crc32(memoryview(buffer.numpy())), piece, where)
                return buffer.view(dtype)
            if (piece.file, piece.key) not in self._verified:
                self._verify_whole(file, stored, piece, where)
            return self._read_bytes(file, stored.begin + low, high - low).view(dtype)
        block = piece.block_bytes
        first_block, end_block = low // block, -(-high // block)
        start, stop = first_block * block, min(end_block * block, size)
        buffer = self._read_bytes(file, stored.begin + start, stop - start)
        crcs = block_crc32s(memoryview(buffer.numpy()), block)
        for number, crc in enumerate(crcs, start=first_block):
            if crc != piece.block_crc32[number]:
                raise CheckpointError(
                    f"{where}: CRC-32 mismatch in block {number} (bytes [{number * block}, "
                    f"{min((number + 1) * block, size)}) of the piece; stored {piece.block_crc32[number]:#010x}, "
                    f"read {crc:#010x}); the file was altered or damaged"
                )
        if (start, stop) == (0, size):  # read whole: the blocks also reproduce the piece's CRC (an index check)
            whole = 0
            for number, crc in enumerate(crcs):
                whole = crc if number == 0 else crc32_combine(whole, crc, min(block, size - number * block))
            self._check_whole_crc(whole, piece, where)
        return buffer[low - start : high - start].view(dtype)

    def read(self, piece: Piece, name: str, dtype: torch.dtype, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Read ``piece`` of tensor ``name``, or only ``index`` (slices of its stored shape), verified.

        Raises:
            CheckpointError: naming the file and the tensor, if the header, the size or a CRC is wrong.
        """
        where = self._where(piece, name)
        file = self._open(piece, name)
        stored = self._stored(file, piece, name, dtype)
        shape = piece.stored_shape
        if index is None:
            index = tuple(slice(0, extent) for extent in shape)
        if len(index) != len(shape) or any(s.step not in (None, 1) for s in index):
            raise ValueError(f"{where}: read index {index} is not one unit-step slice per dim of {shape}")
        bounds = [s.indices(extent)[:2] for s, extent in zip(index, shape)]
        out_shape = tuple(max(0, stop - start) for start, stop in bounds)
        if math.prod(out_shape) == 0:
            return torch.empty(out_shape, dtype=dtype)
        strides = [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]
        first = sum(start * stride for (start, _), stride in zip(bounds, strides))
        last = sum((stop - 1) * stride for (_, stop), stride in zip(bounds, strides)) + 1
        run = self._read_run(file, stored, piece, where, first, last, dtype)
        if math.prod(out_shape) == last - first:  # the part is one contiguous run (a whole piece, whole rows)
            values = run.view(out_shape)
        else:  # a sub-rectangle: its elements inside the run from its first to its last element
            values = run.as_strided(out_shape, strides, run.storage_offset()).clone()
        self.elements_read += values.numel()
        return values
