"""`verify_checkpoint` re-reads every piece and checks coverage; `latest_checkpoint` finds the newest committed one."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .files import PieceReader
from .index import INDEX_FILE, CheckpointError, read_index
from .regions import Region, local_flat_index


@dataclass(frozen=True)
class VerifyReport:
    """What `verify_checkpoint` checked: numbers of tensors, pieces and elements."""

    num_tensors: int
    num_pieces: int
    num_elements: int


def verify_checkpoint(path: str | os.PathLike) -> VerifyReport:
    """Read every piece of the checkpoint at ``path`` whole, checking the index's schema, headers, sizes and CRCs
    (every block's, and the piece's), and check that the pieces of every tensor cover it exactly once.

    Raises:
        CheckpointError: naming the file and the tensor of the first problem found.
    """
    directory = os.fspath(path)
    index = read_index(directory)
    num_pieces = num_elements = 0
    with PieceReader(directory) as reader:
        for name, entry in index.tensors.items():
            covered = torch.zeros(entry.numel, dtype=torch.int32)
            whole = Region((0,) * len(entry.shape), entry.shape)
            for piece in entry.pieces:
                where = f"{os.path.join(directory, piece.file)} (tensor {name!r})"
                if len(piece.offsets) != len(entry.shape) or any(
                    o < 0 or o + s > extent for o, s, extent in zip(piece.offsets, piece.shape, entry.shape)
                ):
                    raise CheckpointError(f"{where}: piece {piece.offsets}+{piece.shape} lies outside {entry.shape}")
                reader.read(piece, name, entry.dtype)
                flat = local_flat_index((piece.offsets, piece.shape), whole).reshape(-1)
                if piece.flat_range is not None:
                    flat = flat[piece.flat_range[0] : piece.flat_range[1]]
                covered.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
                num_pieces += 1
            if entry.numel and not bool((covered == 1).all()):
                twice, never = int((covered > 1).sum()), int((covered == 0).sum())
                raise CheckpointError(
                    f"{directory}: tensor {name!r}: its pieces cover {twice} elements more than once and miss {never}"
                )
            num_elements += entry.numel
    return VerifyReport(num_tensors=len(index.tensors), num_pieces=num_pieces, num_elements=num_elements)


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest committed checkpoint directory directly under ``root``, or ``None`` if there is none.

    Committed means it holds ``index.json`` (written last, then renamed into place); ``*.tmp-*`` leftovers of
    failed saves are ignored. Newest is the highest ``metadata["step"]`` when saved, then the latest commit.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    found = []
    for entry in os.scandir(root):
        index_path = os.path.join(entry.path, INDEX_FILE)
        if ".tmp-" in entry.name or not entry.is_dir() or not os.path.isfile(index_path):
            continue
        try:
            step = read_index(entry.path).metadata.get("step")
        except CheckpointError:
            continue
        step = step if isinstance(step, int) and not isinstance(step, bool) else -1
        found.append((step, os.stat(index_path).st_mtime_ns, entry.path))
    return max(found)[2] if found else None
