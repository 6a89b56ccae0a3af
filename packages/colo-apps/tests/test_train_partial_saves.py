"""Partial saves left by a crash are removed and live ones never are: `prune_checkpoints` (after every save, and at a
``resume: auto`` start-up) deletes the ``step-N.tmp-<id>`` directory of a save killed while writing or at its
commit's rename, and keeps the one a running save holds, in the pruning process (a background save) or another."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import torch

from colo.apps.train.state import prune_checkpoints
from colo.comm.testing import run_distributed
from colo.tensor.checkpoint import AsyncCheckpointer, latest_checkpoint, load_checkpoint, save_checkpoint
from colo.tensor.checkpoint import save as save_module

STATE = {"w": torch.arange(4096, dtype=torch.float32).view(64, 64)}

_DYING_RUN = """
import os, sys, threading, torch
from colo.tensor.checkpoint import AsyncCheckpointer, save_checkpoint
from colo.tensor.checkpoint import save as save_module

root = sys.argv[1]
state = {"w": torch.arange(4096, dtype=torch.float32).view(64, 64)}
for step in (1, 2):
    save_checkpoint(f"{root}/step-{step:08d}", state, metadata={"step": step})
write, stuck = save_module._write_file, threading.Event()
def write_file(path, tensors):
    if "step-00000003" not in path:
        return write(path, tensors)
    with open(path, "wb") as file:  # part of the file reaches the disk, and the writer never finishes
        file.write(b"\\x00" * 8192)
    stuck.set()
    threading.Event().wait()
save_module._write_file = write_file
AsyncCheckpointer().save(f"{root}/step-00000003", state, metadata={"step": 3})  # killed while writing
stuck.wait()
os.rename = lambda *args: os._exit(17)  # every file and the index written; the process dies at the rename
save_checkpoint(f"{root}/step-00000004", state, metadata={"step": 4})
"""

_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)  # what a save in progress in this process holds on its temporary directory
print("locked", flush=True)
time.sleep(600)
"""


def _leftovers(root) -> list[str]:
    return sorted(name for name in os.listdir(root) if ".tmp-" in name)


def test_prune_removes_the_partial_saves_of_a_run_killed_while_writing_and_at_the_rename(tmp_path):
    script, root = tmp_path / "dying_run.py", tmp_path / "checkpoints"
    script.write_text(textwrap.dedent(_DYING_RUN))
    died = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120)
    assert died.returncode == 17, died.stderr
    left = _leftovers(root)
    assert [name.split(".")[0] for name in left] == ["step-00000003", "step-00000004"], left
    assert os.path.exists(root / left[1] / "index.json")  # complete, but never renamed into place

    deleted = prune_checkpoints(str(root), keep_last=2)

    assert deleted == [str(root / name) for name in left]
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]
    assert latest_checkpoint(root) == str(root / "step-00000002")


def test_prune_keeps_a_save_in_progress_in_this_process_and_in_another(tmp_path, monkeypatch):
    from colo.tensor.checkpoint.partial_saves import LOCK_FILE

    root = tmp_path / "checkpoints"
    save_checkpoint(root / "step-00000001", STATE, metadata={"step": 1})
    # another process saving: its temporary directory and the lock it holds there
    other = root / "step-00000002.tmp-0123456789ab"
    other.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(other / LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        # this process saving in the background, its writer still inside the file
        entered, release = threading.Event(), threading.Event()
        write = save_module._write_file

        def slow_write(path, tensors):
            entered.set()
            assert release.wait(60)
            write(path, tensors)

        monkeypatch.setattr(save_module, "_write_file", slow_write)
        with AsyncCheckpointer() as checkpointer:
            handle = checkpointer.save(root / "step-00000003", STATE, metadata={"step": 3})
            assert entered.wait(60)
            live = _leftovers(root)
            assert len(live) == 2

            assert prune_checkpoints(str(root), keep_last=2) == []

            assert _leftovers(root) == live
            release.set()
            handle.wait()
    finally:
        holder.kill()
        holder.wait()
    # the background save committed whole; the other process is gone, so its directory is a dead one now
    target = torch.empty(64, 64)
    assert load_checkpoint(root / "step-00000003", {"w": target})[0] == {"step": 3}
    assert torch.equal(target, STATE["w"])
    assert LOCK_FILE not in os.listdir(root / "step-00000003")
    assert prune_checkpoints(str(root), keep_last=2) == [str(other)]
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000003"]


def _start_without_saving(config: dict) -> int:
    from colo.apps.train import train, validate_config

    return train(validate_config(config)).start_step


def test_a_resume_auto_start_up_removes_partial_saves_before_anything_saves(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.py").write_text("".join(f"def f_{n}(x):\n    return x * {n}\n" for n in range(200)))
    output = tmp_path / "run"
    dead = output / "checkpoints" / "step-00000007.tmp-0123456789ab"  # what a preempted run's save left
    dead.mkdir(parents=True)
    (dead / "rank-00000.safetensors").write_bytes(b"\x00" * 8192)
    config = {
        "name": "partial-saves",
        "output_dir": str(output),
        "model": {"preset": "tiny"},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "schedule": {"total_steps": 1, "warmup_steps": 0},
        "data": {"paths": [str(corpus)], "seq_len": 16, "global_batch_size": 2},
        # no checkpoint is written by this run: only the start-up can have removed the leftover
        "checkpoint": {"every_steps": None, "save_final": False, "resume": "auto"},
        "logging": {"progress_bar": False, "tensorboard": False},
        "eval": {"every_steps": None},
        "sample": {"max_new_tokens": 0},
    }
    assert run_distributed(_start_without_saving, config, world_size=1) == [0]
    assert os.listdir(output / "checkpoints") == []
