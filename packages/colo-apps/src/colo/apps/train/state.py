"""Run state kept in checkpoint metadata as JSON (no pickle): RNG states, and the checkpoint directory's layout
(``step-NNNNNNNN`` names, keep-last-K pruning and removal of crashed saves' leftovers, where to resume)."""

from __future__ import annotations

import os
import random
import re
import shutil

import torch

from colo.comm import default_device
from colo.tensor.checkpoint import CheckpointError, latest_checkpoint, read_index, remove_partial_saves

_STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state() -> dict:
    """This process's RNG states (torch CPU and CUDA, python ``random``, numpy) as JSON-able lists."""
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "python": [version, list(internal), gauss],
    }
    try:
        import numpy
    except ImportError:
        state["numpy"] = None
    else:
        kind, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(position), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        cuda = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None:
        import numpy

        kind, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))


def checkpoint_path(root: str, step: int) -> str:
    """The directory of the checkpoint after ``step``: ``root/step-00000100``."""
    return os.path.join(root, f"step-{step:08d}")


def committed_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the committed ``step-N`` checkpoints under ``root`` (with ``index.json``), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.scandir(root):
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, "index.json")):
            found.append((int(match.group(1)), entry.path))
    return sorted(found)


def prune_checkpoints(root: str, keep_last: int | None) -> list[str]:
    """Delete all but the newest ``keep_last`` committed checkpoints (none when ``keep_last`` is ``None``) and the
    partial saves (``*.tmp-<id>`` directories) that no live save holds: what a save killed while writing or before
    its commit's rename left (`colo.tensor.checkpoint.remove_partial_saves`). A save in progress, in this process
    (a background save) or another, holds its directory's lock and is never touched. Returns the deleted paths.
    Call it on one rank: after starting a save, and at start-up before anything saves (``resume: auto``)."""
    deleted = remove_partial_saves(root)
    if keep_last is not None:
        for _, path in committed_checkpoints(root)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


def resolve_resume(resume: str, root: str) -> str | None:
    """The checkpoint to start from: ``"none"`` -> ``None``; ``"auto"`` -> the newest complete one under ``root``
    (or ``None``); anything else is a checkpoint directory, which must exist and be complete.

    Raises:
        ValueError: ``checkpoint.resume`` names a directory that is not a committed checkpoint.
    """
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(root)
    try:
        read_index(resume)
    except (CheckpointError, OSError) as error:
        raise ValueError(
            f"checkpoint.resume={resume!r} is not a complete checkpoint ({error}); use 'auto', 'none' or a "
            "checkpoint directory holding index.json"
        ) from None
    return resume


def pick_device(choice: str) -> torch.device:
    """The run's compute device (the ``device`` field of the run config): CUDA per local rank, or the CPU.

    ``"auto"``: `colo.comm.default_device`, CUDA in an NCCL job (which the ``"auto"`` backend picks only when every
    process on this node has a GPU of its own), else the CPU: 2 processes on a one-GPU machine run on the CPU with
    gloo instead of failing.
    """
    if choice == "cpu" or (choice == "auto" and default_device().type == "cpu"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='auto' or 'cpu'")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
