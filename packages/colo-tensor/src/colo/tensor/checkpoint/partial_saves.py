"""Partial saves: the ``<path>.tmp-<id>`` directory a save writes into, locked for the save's lifetime, and the
removal of those no live save holds (what a crash leaves behind).

The protocol. The saving process (rank 0 of the saving group) creates ``<path>.tmp-<id>``, opens ``.save.lock`` in
it (creating it), takes an exclusive non-blocking ``fcntl.flock`` on it, and checks that the file it locked is still
the directory's lock file (same device and inode). It holds the lock until the save has committed (renamed into
place; the lock file is then removed) or failed (the directory removed) -- on `AsyncCheckpointer`'s thread too. The
kernel releases the lock when the process dies, however it is killed.

`remove_partial_saves` deletes a ``*.tmp-<id>`` directory only while holding that directory's lock itself: it opens
(creating if absent) ``.save.lock`` and tries the lock without blocking; if a live save holds it, the directory is
kept. Why a save in progress is never deleted: a save writes into its directory only after its lock check succeeded
and holds the lock from then on, and the remover deletes only while holding the same lock, so the two never
overlap. If the remover wins the race for a brand-new directory (between its creation and the writer's lock), the
writer finds its lock taken or its lock file gone and starts over in a new directory; it had written nothing yet. A
directory whose save committed in the meantime no longer exists under its temporary name, so nothing committed is
touched. Within one process (the trainer prunes right after starting a background save) the remover also skips the
directories the process itself holds, since file systems that emulate ``flock`` with POSIX record locks (NFS) do not
make one process's locks exclude each other. The lock needs a file system with working ``flock`` across the
processes that save and prune (local disks, NFSv4; Lustre mounted with ``-o flock``).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import uuid

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so no directory can be shown dead and none is removed
    fcntl = None

LOCK_FILE = ".save.lock"
"""The file inside a save's temporary directory whose ``flock`` the live save holds."""

_TEMPORARY_NAME = re.compile(r"\.tmp-[0-9a-f]{12}$")
"""How `create_save_directory` names a temporary directory: ``<path>.tmp-<12 hex digits>``."""

_held: set[str] = set()
"""Real paths of the temporary directories this process holds (or is creating)."""
_held_guard = threading.Lock()


class SaveLock:
    """The lock a live save holds on its temporary directory; `release` it once the save committed or failed."""

    def __init__(self, directory: str, fd: int | None):
        self.directory = directory
        self._fd = fd

    def release(self) -> None:
        """Release the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        with _held_guard:
            _held.discard(self.directory)


def _take_lock(directory: str) -> int | None:
    """An fd holding ``directory``'s lock, or ``None`` if another process holds it or removed the directory.

    Raises:
        OSError: the lock file cannot be opened (other than because the directory is gone).
    """
    lock_path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # the directory is gone
        return None
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = os.stat(lock_path)
        mine = os.fstat(fd)
        if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
    except OSError:  # held by another process, or removed by it
        pass
    os.close(fd)
    return None


def create_save_directory(path: str) -> tuple[str, SaveLock]:
    """Create ``path.tmp-<id>`` and take its lock; returns the directory and the `SaveLock` to release when the save
    has committed or failed.

    Raises:
        OSError: the directory cannot be created or locked.
    """
    for _ in range(8):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        key = os.path.realpath(tmp)
        with _held_guard:
            _held.add(key)
        try:
            os.makedirs(tmp)
            fd = _take_lock(tmp)
        except BaseException:
            with _held_guard:
                _held.discard(key)
            raise
        if fd is not None:
            return tmp, SaveLock(key, fd)
        with _held_guard:  # a remover took the brand-new directory for a dead one: start over
            _held.discard(key)
    raise OSError(f"cannot lock a temporary directory for {path}: every one was removed by another process")


def release_committed(path: str, lock: SaveLock | None) -> None:
    """After the commit's rename: remove the lock file from the committed checkpoint ``path``, release the lock."""
    try:
        os.unlink(os.path.join(path, LOCK_FILE))
    except FileNotFoundError:
        pass
    if lock is not None:
        lock.release()


def remove_partial_saves(root: str | os.PathLike) -> list[str]:
    """Delete the temporary directories (``*.tmp-<id>``) directly under ``root`` that no live save holds: partial
    saves left by a process that died (killed while writing, or before the commit's rename).

    Safe to call at any time, from any process, while saves run: a directory is deleted only while this call holds
    its lock, which a live save holds from before it writes until it commits or fails (see the module docstring). On
    a platform without ``fcntl`` nothing is deleted.

    Args:
        root: the directory holding the checkpoints (e.g. ``output_dir/checkpoints``).

    Returns:
        The deleted directories, sorted.
    """
    root = os.fspath(root)
    if fcntl is None:
        return []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry in entries:
        if not _TEMPORARY_NAME.search(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        with _held_guard:
            if os.path.realpath(entry.path) in _held:
                continue
        try:
            fd = _take_lock(entry.path)
        except OSError:  # not ours to lock (permissions, a read-only file system): leave it
            continue
        if fd is None:
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)
        if not os.path.exists(entry.path):
            removed.append(entry.path)
    return sorted(removed)
