"""Gemini checkpoints in colo's common sharded format (`colo.tensor.checkpoint`), interchangeable with colo.zero's.

Every rank saves, for each parameter, the flat range of it that lies in its chunk shards, as a `FlatShard`:
the fp32 master under the parameter's name (frozen parameters: their compute copy), and Adam's moments under
``optim/<name>/exp_avg`` and ``optim/<name>/exp_avg_sq``. Wherever the state lives (device, host, disk) it is
read through the optimizer, so the files do not depend on the placement; loading assembles each rank's ranges
from whatever pieces overlap them, so a checkpoint saved on N ranks with one placement loads on M ranks with
another. The code is colo.zero's (`colo.zero.state`, over the chunk optimizer core): ``"optimizer"`` holds the
optimizer's type, its param groups and per-parameter scalars (Adam's ``step``), so a ZeRO checkpoint loads into
Gemini and the other way round; ``"gemini"`` holds the loss scaler.
"""

from __future__ import annotations

import os

from colo.zero.state import OPTIMIZER_KEY  # noqa: F401 - the shared key, named here for readers of Gemini's files

METADATA_KEY = "gemini"
"""Metadata key of Gemini's own state (the loss scaler): `GeminiOptimizer.checkpoint_key`."""


def save_gemini(gemini, path: str | os.PathLike, *, metadata: dict | None = None, expected_names=None) -> None:
    """Save ``gemini``'s masters, moments and frozen weights to the checkpoint directory ``path`` (a collective).

    Args:
        gemini: a `GeminiOptimizer`.
        path: a new directory (committed by a rename once every rank has written).
        metadata: JSON-serialisable user state (step, data position) stored beside Gemini's own.
        expected_names: tensors the checkpoint must hold besides this rank's (`save_checkpoint`'s).
    """
    gemini.save(path, metadata=metadata, expected_names=expected_names)


def load_gemini(gemini, path: str | os.PathLike) -> dict:
    """Fill ``gemini``'s masters, moments, step counts and frozen weights from ``path``; refresh the compute copies.

    Accepts checkpoints of `GeminiOptimizer` and of colo.zero's `ZeroOptimizer` (any data-parallel size, any
    placement). A checkpoint written before the first optimizer step, without moments, loads them as zeros.

    Returns:
        The metadata saved with the checkpoint.

    Raises:
        CheckpointError: a parameter is missing or mismatched, or the optimizer type differs.
    """
    return gemini.load(path)
