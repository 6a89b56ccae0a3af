"""Background saving: the same files as a foreground save, a snapshot taken at the call, errors at wait or the next
save, training collectives running beside the save's own, and a killed writer never costing the last checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from colo.comm import Mesh, all_reduce
from colo.comm.testing import requires_cuda, run_distributed
from colo.tensor import Shard, distribute
from colo.tensor.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    FlatShard,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from colo.tensor.checkpoint import save as save_module
from colo.tensor.placement import chunk_range


def reference_state() -> dict[str, torch.Tensor]:
    """The unsharded state (same on every rank and in the pytest process)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 6, generator=generator).to(torch.bfloat16),
        "layers.0.mlp.up_proj.weight": torch.randn(8, 5, generator=generator),
        "optim/layers.0.mlp.up_proj.weight/exp_avg": torch.randn(8, 5, generator=generator),
        "norm.weight": torch.randn(6, generator=generator),
        "step": torch.tensor(12, dtype=torch.int64),
    }


def training_state(mesh: Mesh) -> dict:
    """This rank's training tensors: tp shards, a ZeRO flat shard, a plain (replicated) tensor."""
    reference = reference_state()
    rank, world = mesh.rank("tp"), mesh.size("tp")
    up = reference["optim/layers.0.mlp.up_proj.weight/exp_avg"]
    start, size = chunk_range(up.numel(), world, rank)
    return {
        "embed.weight": distribute(reference["embed.weight"], mesh, [Shard(0)]),
        "layers.0.mlp.up_proj.weight": distribute(reference["layers.0.mlp.up_proj.weight"], mesh, [Shard(1)]),
        "optim/layers.0.mlp.up_proj.weight/exp_avg": FlatShard(
            up.reshape(-1)[start : start + size].clone(), (8, 5), start
        ),
        "norm.weight": reference["norm.weight"].clone(),
        "step": reference["step"].clone(),
    }


def _mutate(state: dict) -> None:
    """What training does to its tensors right after asking for a checkpoint."""
    for value in state.values():
        tensor = value.tensor if isinstance(value, FlatShard) else value
        tensor.fill_(-7)


class _GatedWriter:
    """Patches the one file-writing function so that this rank's write waits for `open` (the test's go-ahead)."""

    def __init__(self, gated: bool):
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.original = save_module._write_file

    def __enter__(self) -> _GatedWriter:
        def write(path, tensors):
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the gate")
            self.original(path, tensors)

        save_module._write_file = write
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()
        save_module._write_file = self.original


# --- rank functions ------------------------------------------------------------------------------------------


def _save_foreground_then_background(foreground: str, background: str) -> dict:
    mesh = Mesh(tp=torch.distributed.get_world_size())
    save_checkpoint(foreground, training_state(mesh), metadata={"step": 12})
    state = training_state(mesh)
    rank = torch.distributed.get_rank()
    in_gather, original_gather = threading.Event(), save_module.gather_object

    def gather_object(*args, **kwargs):
        in_gather.set()
        return original_gather(*args, **kwargs)

    save_module.gather_object = gather_object
    try:
        with AsyncCheckpointer(group=mesh.group("tp")) as checkpointer, _GatedWriter(gated=rank == 0) as writer:
            handle = checkpointer.save(background, state, metadata={"step": 12})
            _mutate(state)  # training goes on: the snapshot must not see this
            if rank == 1:  # let rank 1's thread enter the checkpoint's gather (it waits there for rank 0's write)
                assert in_gather.wait(30)
                time.sleep(0.1)
            # training collectives on the world group while a checkpoint collective is in flight: they must pair
            # up (they would not if the save used the training group: rank 0's all-reduce would meet the gather)
            sums = []
            for step in range(3):
                value = torch.tensor([float(rank + step)])
                all_reduce(value, group=mesh.group("tp"))
                sums.append(value.item())
            returned_early = not handle.done()
            writer.gate.set()
            handle.wait()
    finally:
        save_module.gather_object = original_gather
    return {"returned_early": returned_early, "sums": sums}


def _failing_background_saves(root: str) -> dict:
    rank = torch.distributed.get_rank()
    original = save_module._write_file

    def fail_on_rank_1(path, tensors):
        if rank == 1:
            raise OSError("No space left on device (simulated)")
        original(path, tensors)

    messages = {}
    mesh = Mesh(tp=2)
    with AsyncCheckpointer(group=mesh.group("tp")) as checkpointer:
        save_module._write_file = fail_on_rank_1
        try:
            checkpointer.save(f"{root}/step-1", training_state(mesh))  # returns: the failure comes later
            with pytest.raises(CheckpointError) as at_wait:
                checkpointer.wait()
            messages["wait"] = str(at_wait.value)
            checkpointer.save(f"{root}/step-2", training_state(mesh))
            with pytest.raises(CheckpointError) as at_next_save:
                checkpointer.save(f"{root}/step-3", training_state(mesh))  # raises step-2's error, starts nothing
            messages["next_save"] = str(at_next_save.value)
        finally:
            save_module._write_file = original
        checkpointer.save(f"{root}/step-4", training_state(mesh), metadata={"step": 4}).wait()  # usable again
    return messages


# --- tests ---------------------------------------------------------------------------------------------------


def test_background_save_writes_the_foreground_files_from_a_snapshot_while_training_communicates(tmp_path):
    foreground, background = str(tmp_path / "fg"), str(tmp_path / "bg")
    results = run_distributed(_save_foreground_then_background, foreground, background, world_size=2)
    for result in results:
        assert result["returned_early"]  # save() returned before rank 0's file was written
        assert result["sums"] == [1.0, 3.0, 5.0]
    # bit-identical safetensors files and the same index: same pieces, same bytes, same CRCs, same order
    assert sorted(os.listdir(foreground)) == sorted(os.listdir(background))
    for name in os.listdir(foreground):
        with open(os.path.join(foreground, name), "rb") as a, open(os.path.join(background, name), "rb") as b:
            assert a.read() == b.read(), name
    reference = reference_state()
    targets = {name: torch.zeros_like(full) for name, full in reference.items()}
    load_checkpoint(background, targets)
    for name, full in reference.items():  # no -7 leaked in
        assert torch.equal(targets[name], full), name


def test_background_error_surfaces_at_wait_and_at_the_next_save(tmp_path):
    for messages in run_distributed(_failing_background_saves, str(tmp_path), world_size=2):
        for where in ("wait", "next_save"):
            assert "rank 1" in messages[where] and "No space left" in messages[where], messages
        assert "step-2" in messages["next_save"]
    assert sorted(os.listdir(tmp_path)) == ["step-4"]  # failed saves committed nothing and cleaned up
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-4")


def test_single_process_background_save_and_handle_errors(tmp_path):
    state = {"w": torch.arange(12, dtype=torch.float32).view(3, 4)}
    with AsyncCheckpointer() as checkpointer:
        handle = checkpointer.save(tmp_path / "a", state, metadata={"step": 1})
        state["w"].zero_()
        handle.wait()
        with pytest.raises(FileExistsError):
            checkpointer.save(tmp_path / "a", state)
        with pytest.raises(TypeError, match="JSON"):
            checkpointer.save(tmp_path / "b", state, metadata={"bad": object()})
        failing = checkpointer.save(tmp_path / "c", {"w": "not a tensor"})
        with pytest.raises(CheckpointError, match=r"rank 0: TypeError.*tensors\['w'\]"):
            failing.wait()
        checkpointer.wait()  # already raised through the handle: not raised again
    target = torch.empty(3, 4)
    assert load_checkpoint(tmp_path / "a", {"w": target})[0] == {"step": 1}
    assert torch.equal(target, torch.arange(12, dtype=torch.float32).view(3, 4))
    with pytest.raises(RuntimeError, match="closed"):
        checkpointer.save(tmp_path / "d", state)


_CRASHING_WRITER = """
import os, signal, sys, torch
from colo.tensor.checkpoint import AsyncCheckpointer, save_checkpoint
from colo.tensor.checkpoint import save as save_module

root, crash = sys.argv[1], sys.argv[2]
state = {"w": torch.arange(4096, dtype=torch.float32).view(64, 64), "b": torch.ones(64)}
save_checkpoint(f"{root}/step-1", state, metadata={"step": 1})
state = {name: value + 1 for name, value in state.items()}
if crash == "mid-write":
    def write(path, tensors):  # half the file reaches the disk, then the process is killed outright
        with open(path, "wb") as file:
            file.write(b"\\x00" * 8192)
            file.flush()
            os.fsync(file.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    save_module._write_file = write
else:  # every file and the index written, the process dies before the commit's rename
    os.rename = lambda *args: os._exit(17)
checkpointer = AsyncCheckpointer()
checkpointer.save(f"{root}/step-2", state, metadata={"step": 2}).wait()
print("the writer survived")
"""


@pytest.mark.parametrize("crash", ["mid-write", "before-rename"])
def test_killed_background_writer_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path, crash):
    script = tmp_path / "crashing_writer.py"
    script.write_text(textwrap.dedent(_CRASHING_WRITER))
    root = tmp_path / "ckpts"
    result = subprocess.run(
        [sys.executable, str(script), str(root), crash], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == (-9 if crash == "mid-write" else 17), result.stderr
    leftovers = [name for name in os.listdir(root) if name.startswith("step-2")]
    assert len(leftovers) == 1 and ".tmp-" in leftovers[0]  # the half-written save, never committed
    if crash == "before-rename":
        assert os.path.exists(root / leftovers[0] / "index.json")  # complete, but not under the checkpoint's name
    assert latest_checkpoint(root) == str(root / "step-1")
    verify_checkpoint(root / "step-1")
    targets = {"w": torch.empty(64, 64), "b": torch.empty(64)}
    assert load_checkpoint(root / "step-1", targets)[0] == {"step": 1}
    assert torch.equal(targets["w"], torch.arange(4096, dtype=torch.float32).view(64, 64))
    save_checkpoint(root / "step-2", targets, metadata={"step": 2})  # the leftover does not block the next save
    assert latest_checkpoint(root) == str(root / "step-2")


@requires_cuda
def test_background_save_of_cuda_tensors_matches_the_foreground_save(tmp_path):
    state = {name: tensor.cuda() for name, tensor in reference_state().items()}
    save_checkpoint(tmp_path / "fg", state)
    with AsyncCheckpointer() as checkpointer:
        for round_index in range(2):  # the second save reuses the pinned staging buffers
            handle = checkpointer.save(tmp_path / f"bg{round_index}", state)
            saved = {name: tensor.clone() for name, tensor in state.items()}
            for tensor in state.values():
                tensor.add_(1)
            handle.wait()
            targets = {name: torch.empty_like(tensor, device="cpu") for name, tensor in saved.items()}
            load_checkpoint(tmp_path / f"bg{round_index}", targets)
            for name, tensor in saved.items():
                assert torch.equal(targets[name], tensor.cpu()), name
    for name in os.listdir(tmp_path / "fg"):
        assert (tmp_path / "fg" / name).read_bytes() == (tmp_path / "bg0" / name).read_bytes(), name
