"""colo.tensor.checkpoint: one sharded checkpoint format for every parallel layout.

Each rank writes the pieces it owns to ``rank-NNNNN.safetensors``; ``index.json`` maps every tensor name to its
global shape, dtype and pieces (rectangles of the global tensor, optionally narrowed to a flat range, each with
the CRC-32 of its bytes and of every 1 MiB block of them). Saves are committed by a rename, in the foreground
(`save_checkpoint`) or in a background thread (`AsyncCheckpointer`); `remove_partial_saves` deletes what a crashed
save left, never a live one. Loads read only the parts of the pieces each rank needs, so any layout loads into any
other, and verify every byte they read (the blocks covering it); the index is validated against its schema when
read. `export_hf` writes consolidated Hugging Face safetensors. No pickle on any load path. The command line
``python -m colo.tensor.checkpoint {info,verify,export}`` inspects, checks and exports checkpoints.

Example::

    checkpointer = AsyncCheckpointer(group=mesh.group("dp", "tp"))
    checkpointer.save(f"{root}/step-{step:08d}", state, metadata={"step": step})  # returns after a copy
    ...
    checkpointer.close()
    metadata, _ = load_checkpoint(latest_checkpoint(root), targets)
    export_hf(latest_checkpoint(root), "hf-model", dtype=torch.bfloat16)
"""

from .background import AsyncCheckpointer, SaveHandle
from .export import ExportReport, export_hf
from .index import INDEX_FILE, CheckpointError, CheckpointFormatError, CheckpointIndex, Piece, TensorEntry, read_index
from .integrity import VerifyReport, latest_checkpoint, verify_checkpoint
from .load import LoadStats, load_checkpoint
from .partial_saves import remove_partial_saves
from .regions import FlatShard
from .save import save_checkpoint

__all__ = [
    "INDEX_FILE",
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIndex",
    "ExportReport",
    "FlatShard",
    "LoadStats",
    "Piece",
    "SaveHandle",
    "TensorEntry",
    "VerifyReport",
    "export_hf",
    "latest_checkpoint",
    "load_checkpoint",
    "read_index",
    "remove_partial_saves",
    "save_checkpoint",
    "verify_checkpoint",
]
