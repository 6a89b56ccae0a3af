"""colo.tensor.checkpoint: one sharded checkpoint format for every parallel layout.

Each rank writes the pieces it owns to ``rank-NNNNN.safetensors``; ``index.json`` maps every tensor name to its
global shape, dtype and pieces (rectangles of the global tensor, optionally narrowed to a flat range, each with
a CRC-32). Saves are committed by a rename; loads read only the parts of the pieces each rank needs, so any
layout loads into any other. No pickle anywhere.

Example::

    save_checkpoint(f"{root}/step-{step:08d}", state, metadata={"step": step}, group=mesh.group())
    metadata, _ = load_checkpoint(latest_checkpoint(root), targets)
"""

from .index import INDEX_FILE, CheckpointError, CheckpointIndex, Piece, TensorEntry, read_index
from .integrity import VerifyReport, latest_checkpoint, verify_checkpoint
from .load import LoadStats, load_checkpoint
from .regions import FlatShard
from .save import save_checkpoint

__all__ = [
    "INDEX_FILE",
    "CheckpointError",
    "CheckpointIndex",
    "FlatShard",
    "LoadStats",
    "Piece",
    "TensorEntry",
    "VerifyReport",
    "latest_checkpoint",
    "load_checkpoint",
    "read_index",
    "save_checkpoint",
    "verify_checkpoint",
]
