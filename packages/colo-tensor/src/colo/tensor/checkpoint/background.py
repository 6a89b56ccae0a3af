"""`AsyncCheckpointer`: snapshot the state now, write and commit it in a background thread while training goes on."""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from colo.comm import Group, create_process_group

from .regions import FlatShard
from .save import (
    OwnedPiece,
    begin_save,
    check_expected_names,
    check_metadata,
    declared_tensors,
    failure_message,
    finish_save,
    owned_pieces,
    saving_group,
    write_pieces,
)


class SaveHandle:
    """A background save started by `AsyncCheckpointer.save`.

    Attributes:
        path: the checkpoint directory being written.
        snapshot_seconds: how long `AsyncCheckpointer.save` blocked the caller (waiting for the previous save,
            agreeing on the temporary directory and copying the tensors).
    """

    def __init__(self, path: str, future: concurrent.futures.Future, snapshot_seconds: float):
        self.path = path
        self.snapshot_seconds = snapshot_seconds
        self._future = future
        self._observed = False  # the error was raised to the caller through this handle

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed on every rank.

        Args:
            timeout: seconds to wait; ``None`` waits as long as it takes.

        Raises:
            CheckpointError: the save failed on some rank (the message names it); nothing was committed.
            TimeoutError: the save is still running after ``timeout`` seconds (it goes on).
        """
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the background save to {self.path} is still running after {timeout} s") from None
        except BaseException:
            self._observed = True
            raise

    def _outcome(self) -> BaseException | None:
        """Wait; the error not yet raised to the caller, if any."""
        error = self._future.exception()
        return None if error is None or self._observed else error


class AsyncCheckpointer:
    """Saves checkpoints in the background: `save` returns once the tensors are copied, training goes on while a
    thread writes them, and the checkpoint is committed (renamed into place) as soon as every rank has written.

    The files and the index are exactly those of `save_checkpoint` (same pieces, same bytes, same CRCs); only the
    writing moves to a thread. At most one save is in flight: `save` first waits for the previous one. An error
    of a background save (a full disk on one rank, say) is raised, on every rank, by the next `save` (which then
    does not start) or by `wait` -- whichever comes first -- or by `SaveHandle.wait`.

    Why a process group of its own: after writing, the ranks must agree on the index and learn the commit's
    outcome, which takes collectives. Collectives of one process group must be issued in the same order on
    every rank; the background thread's gather and broadcast would interleave unpredictably with the training
    thread's all-reduces on the same group, so ranks would pair different operations and hang or exchange
    garbage (gloo and NCCL alike). The checkpointer therefore creates, once, a separate gloo group over the
    same ranks that only its own thread uses: independent connections, so no ordering constraint with
    training's collectives, and no GPU stream or NCCL communicator touched from the thread (the piece lists are
    small Python objects). This is what torch DCP's ``async_save`` with a dedicated gloo ``process_group``
    does. The alternative, doing the collectives in the training thread at the next `save`/`wait`, would leave
    a fully written checkpoint uncommitted until then, so a crash in between would lose it.

    Snapshots: a tensor is copied into a staging buffer on the host (pinned for CUDA tensors, so the
    device-to-host copy is asynchronous to the host and synchronised once), and `save` returns after that copy,
    so training may modify its tensors right away. Only the pieces this rank writes are copied (a replica that
    another rank writes is not). With ``reuse_buffers`` the staging buffers are kept for the next save of the
    same names and shapes, which saves allocating (and page-faulting) host memory each time, at the cost of
    holding one copy of this rank's share of the state between saves.

    The save's temporary directory stays locked by rank 0 until the thread has committed (or failed), so pruning
    (`remove_partial_saves`) during a background save keeps it. Call `close` (or `wait`) before destroying the
    process groups. At interpreter exit a save in flight is
    finished first (its thread is joined). An active `colo.comm.CommTracker` records the thread's few object
    collectives under the group name ``"checkpoint"``.

    Args:
        group: the ranks that save together (a `colo.comm.Group`), default the world. Every rank of the job
            must construct the checkpointer at the same point of the program, members of ``group`` or not (it
            creates a process group, as ``torch.distributed.new_group`` requires); only members call `save`.
            Without ``torch.distributed`` initialised, the process saves alone.
        timeout: seconds a rank waits for the others in the checkpoint's collectives (for example for a slower
            rank to finish writing) before the save fails; default the group's timeout.
        reuse_buffers: keep the staging buffers between saves (default ``True``).

    Example::

        checkpointer = AsyncCheckpointer(group=mesh.group("dp", "tp"))
        for step in range(num_steps):
            train_step()
            if step % 1000 == 0:
                checkpointer.save(f"{root}/step-{step:08d}", state_dict(), metadata={"step": step})
        checkpointer.close()   # waits for the last save; raises if it failed
    """

    def __init__(self, *, group=None, timeout: float | None = None, reuse_buffers: bool = True):
        self._saving_group = saving_group(group)
        self._io_group: Group | None = None
        if self._saving_group is not None:
            ranks = self._saving_group.ranks
            seconds = float(timeout if timeout is not None else self._saving_group.timeout)
            process_group, ranks = create_process_group(
                ranks, timeout=datetime.timedelta(seconds=seconds), backend="gloo"
            )
            member = process_group not in (None, dist.GroupMember.NON_GROUP_MEMBER)
            self._io_group = Group("checkpoint", process_group if member else None, ranks, seconds)
        self._reuse_buffers = reuse_buffers
        self._staging: dict[str, torch.Tensor] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="colo-checkpoint"
        )
        self._pending: SaveHandle | None = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the error already on its way with the save's own
            try:
                self.close()
            except Exception:
                pass

    @property
    def pending(self) -> SaveHandle | None:
        """The save in flight (or finished but not yet waited for), if any."""
        return self._pending

    def wait(self) -> None:
        """Block until the save in flight, if any, is committed.

        Raises:
            CheckpointError: it failed (unless that error was already raised by its `SaveHandle.wait`).
        """
        handle, self._pending = self._pending, None
        if handle is not None:
            error = handle._outcome()
            if error is not None:
                raise error

    def save(
        self,
        path: str | os.PathLike,
        tensors: Mapping[str, torch.Tensor | FlatShard],
        *,
        metadata: dict | None = None,
        expected_names=None,
    ) -> SaveHandle:
        """Start saving ``tensors`` to the new checkpoint directory ``path``; every rank of the group calls it.

        Waits for the previous save, agrees with the other ranks on a temporary directory, copies this rank's
        pieces to staging buffers, and returns; a background thread writes them, and rank 0 commits the
        checkpoint once every rank has written. ``tensors`` and ``metadata`` are read only during this call.

        Args:
            path: the checkpoint directory to create; it must not exist yet.
            tensors: name -> local tensor (with or without a layout) or `FlatShard`, as for `save_checkpoint`.
            metadata: JSON-serialisable state stored in the index. Default ``{}``.
            expected_names: tensors the checkpoint must hold besides those passed, as for `save_checkpoint`.

        Returns:
            A `SaveHandle` to wait on (optional: the next `save`, `wait` or `close` does it).

        Raises:
            CheckpointError: the previous background save failed (this one is not started).
            FileExistsError: ``path`` already exists.
        """
        if self._executor is None:
            raise RuntimeError("AsyncCheckpointer.save: the checkpointer is closed; create a new one")
        group = self._io_group
        if group is not None and group.process_group is None:
            raise ValueError(
                f"AsyncCheckpointer.save: rank {dist.get_rank()} is not in the saving group {group.describe()}"
            )
        started = time.perf_counter()
        self.wait()
        path = os.fspath(path).rstrip("/")
        metadata = check_metadata(metadata)
        expected_names = check_expected_names(expected_names)
        rank = group.rank if group is not None else 0
        tmp, lock = begin_save(path, group)  # rank 0 holds the directory's lock until the thread commits
        declared: dict = {}
        try:  # a failure here is reported through the background collectives, so the other ranks do not hang
            declared = declared_tensors(tensors)
            pieces, failure = self._snapshot(tensors, rank), None
        except Exception as error:
            pieces, failure = [], failure_message(rank, error)
        held = {"declared": declared, "expected_names": expected_names, "lock": lock}
        try:
            future = self._executor.submit(_write_and_commit, path, tmp, pieces, failure, rank, metadata, group, held)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self._pending = SaveHandle(path, future, time.perf_counter() - started)
        return self._pending

    def _snapshot(self, tensors: Mapping[str, torch.Tensor | FlatShard], rank: int) -> list[OwnedPiece]:
        """Copy this rank's pieces to host staging buffers (reused when the name, shape and dtype match)."""
        previous, staging, devices = self._staging, {}, set()

        def copy(name: str, tensor: torch.Tensor) -> torch.Tensor:
            buffer = previous.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                pin = tensor.is_cuda and torch.cuda.is_available()
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            if tensor.is_cuda:
                devices.add(tensor.device)
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)
            staging[name] = buffer
            return buffer

        self._staging = {}  # a failed snapshot must not leave half-filled buffers for the next save
        pieces = owned_pieces(tensors, rank, copy=copy)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        if self._reuse_buffers:
            self._staging = staging
        return pieces

    def close(self) -> None:
        """Wait for the save in flight, then release the thread and the checkpoint process group.

        Raises:
            CheckpointError: the save in flight failed.
        """
        if self._executor is None:
            return
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._executor = None
            self._staging = {}
            if self._io_group is not None and self._io_group.process_group is not None:
                dist.destroy_process_group(self._io_group.process_group)
            self._io_group = None


def _write_and_commit(
    path: str, tmp: str, pieces: list[OwnedPiece], failure: str | None, rank: int, metadata: dict, group, held: dict
) -> None:
    """The background part of a save: write this rank's file, then the collective commit on the checkpoint group."""
    records = []
    if failure is None:
        try:
            records = write_pieces(tmp, pieces, rank)
        except Exception as error:
            failure = failure_message(rank, error)
    finish_save(path, tmp, records, failure, metadata, group, **held)
