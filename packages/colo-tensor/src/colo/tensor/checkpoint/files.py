"""File-level helpers: CRC-32 of tensor bytes, fsync, and a reader of pieces that checks headers, sizes and CRCs."""

from __future__ import annotations

import os
import zlib
from contextlib import ExitStack

import torch
from safetensors import SafetensorError, safe_open

from .index import CheckpointError, Piece


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major order."""
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return 0
    return zlib.crc32(flat.view(torch.uint8).cpu().numpy()) & 0xFFFFFFFF


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


class PieceReader:
    """Reads (parts of) pieces from a checkpoint directory through safetensors' lazy slicing.

    Files are opened once, on first use, and closed by `close` (or leaving the ``with`` block). Every read
    checks the stored shape and dtype against the index; a read of a whole piece also checks its CRC.

    Args:
        directory: the checkpoint directory.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.elements_read = 0
        self._stack = ExitStack()
        self._files: dict[str, object] = {}

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every open file."""
        self._stack.close()
        self._files.clear()

    def _where(self, piece: Piece, name: str) -> str:
        return f"{os.path.join(self.directory, piece.file)} (tensor {name!r}, key {piece.key!r})"

    def _open(self, piece: Piece, name: str):
        handle = self._files.get(piece.file)
        if handle is None:
            try:
                handle = self._stack.enter_context(
                    safe_open(os.path.join(self.directory, piece.file), framework="pt", device="cpu")
                )
            except (SafetensorError, OSError, ValueError) as error:
                raise CheckpointError(f"{self._where(piece, name)}: cannot open the file: {error}") from None
            self._files[piece.file] = handle
        return handle

    def read(self, piece: Piece, name: str, dtype: torch.dtype, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Read ``piece`` of tensor ``name``, or only ``index`` (slices of its stored shape).

        Raises:
            CheckpointError: naming the file and the tensor, if the header, the size or the CRC is wrong.
        """
        where = self._where(piece, name)
        handle = self._open(piece, name)
        try:
            lazy = handle.get_slice(piece.key)
            stored = tuple(lazy.get_shape())
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{where}: the file has no readable entry for this piece: {error}") from None
        if stored != piece.stored_shape:
            raise CheckpointError(f"{where}: stored shape {stored} but the index says {piece.stored_shape}")
        whole = index is None or all((s.start, s.stop) == (0, size) for s, size in zip(index, piece.stored_shape))
        try:
            if len(stored) == 0:
                values = handle.get_tensor(piece.key)
            else:
                values = lazy[index if index is not None else tuple(slice(0, size) for size in stored)]
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{where}: reading failed (truncated or corrupt file?): {error}") from None
        if values.dtype != dtype:
            raise CheckpointError(f"{where}: stored dtype {values.dtype} but the index says {dtype}")
        self.elements_read += values.numel()
        if whole and tensor_crc32(values) != piece.crc32:
            raise CheckpointError(
                f"{where}: CRC-32 mismatch (stored {piece.crc32:#010x}, read {tensor_crc32(values):#010x}); "
                "the file was altered or damaged"
            )
        return values
