"""Memory tiers with capacities: the device arena, host memory and a disk directory.

- `DeviceArena`: the device tier. Without CUDA it is one preallocated block of host memory from which chunk
  buffers are carved (first fit, holes coalesced on free), so the device tier cannot exceed its capacity by
  construction. On CUDA the buffers come from the caching allocator and are counted against the capacity
  before they are allocated (so memory a chunk frees serves activations), with the same interface and errors.
- `HostTier`: host memory, pinned when CUDA is present (``torch.empty(..., pin_memory=True)`` raises without
  it), counted against an optional capacity.
- `DiskTier`: a directory of one file per buffer (NVMe offload), written and read by background threads;
  operations on one file run in the order they were issued.

Every tier reports ``used``, ``high_water`` and ``capacity`` in bytes; a request beyond the capacity raises
`GeminiMemoryError` with the figures, before anything is allocated.
"""

from __future__ import annotations

import bisect
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

ALIGNMENT = 64
"""Bytes every arena block is aligned (and rounded) to: any dtype can view it, and cache lines are not shared."""


class GeminiMemoryError(RuntimeError):
    """A tier cannot hold what it is asked to; the message gives the figures and the setting to change."""


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``'1.50 KiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Accounting:
    """Capacity, bytes in use and the high-water mark of a tier, and observers told of every change."""

    def __init__(self, name: str, capacity: float) -> None:
        self.name = name
        self.capacity = capacity
        self.used = 0
        self.high_water = 0
        self.num_allocations = 0
        self.observers: list[Callable[[str, int, int], None]] = []
        """``observer(tier name, signed delta in bytes, bytes in use after)`` for every allocation and free."""

    def _check(self, nbytes: int, what: str, setting: str) -> None:
        if self.used + nbytes > self.capacity:
            raise GeminiMemoryError(
                f"the {self.name} tier cannot hold {what} ({format_bytes(nbytes)}): {format_bytes(self.used)} of "
                f"its {format_bytes(self.capacity)} are in use; raise GeminiConfig.{setting}"
            )

    def _account(self, delta: int) -> None:
        self.used += delta
        if delta > 0:
            self.num_allocations += 1
        self.high_water = max(self.high_water, self.used)
        for observer in self.observers:
            observer(self.name, delta, self.used)

    def reset_high_water(self) -> None:
        """Start a new high-water mark from the bytes in use now."""
        self.high_water = self.used


class DeviceArena(_Accounting):
    """The device tier: chunk buffers carved from a fixed capacity.

    Args:
        capacity: bytes the arena holds.
        device: where the buffers live (``cpu`` on a machine without a GPU, where the arena stands in for one).
        preallocate: carve buffers from one preallocated block (the default on CPU: the capacity then holds by
            construction); ``False`` allocates each buffer from the device's allocator after checking the
            capacity (the default on CUDA, so freed chunk memory is available to activations).
    """

    def __init__(self, capacity: int, *, device: torch.device | str, preallocate: bool | None = None) -> None:
        super().__init__("device", int(capacity))
        self.device = torch.device(device)
        self.preallocate = self.device.type == "cpu" if preallocate is None else preallocate
        self._blocks: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, size); offset -1 when not carved
        self._buffer: torch.Tensor | None = None
        self._holes: list[tuple[int, int]] = []  # free (offset, size), sorted by offset
        if self.preallocate:
            self._buffer = torch.empty(_round_up(self.capacity, ALIGNMENT), dtype=torch.uint8, device=self.device)
            self._holes = [(0, self._buffer.numel())]

    @staticmethod
    def block_bytes(numel: int, dtype: torch.dtype) -> int:
        """Bytes a buffer of ``numel`` elements of ``dtype`` takes in the arena (rounded to `ALIGNMENT`)."""
        return _round_up(max(numel, 1) * torch.empty((), dtype=dtype).element_size(), ALIGNMENT)

    def _find(self, size: int, from_top: bool) -> int | None:
        holes = reversed(range(len(self._holes))) if from_top else range(len(self._holes))
        for i in holes:
            offset, hole = self._holes[i]
            if hole >= size:
                return i
        return None

    def can_fit(self, nbytes: int, *, from_top: bool = False) -> bool:
        """Whether a buffer of ``nbytes`` (already rounded, see `block_bytes`) can be allocated now."""
        if self.used + nbytes > self.capacity:
            return False
        return not self.preallocate or self._find(nbytes, from_top) is not None

    @property
    def largest_hole(self) -> int:
        """The largest buffer that could be carved now (the free bytes, on an allocator-backed arena)."""
        if not self.preallocate:
            return int(self.capacity - self.used)
        return max((size for _, size in self._holes), default=0)

    def allocate(
        self, numel: int, dtype: torch.dtype, *, what: str = "a buffer", from_top: bool = False
    ) -> torch.Tensor:
        """A new 1-D buffer of ``numel`` elements of ``dtype`` (contents undefined).

        Args:
            numel: elements.
            dtype: element type.
            what: what the buffer is, for the error message.
            from_top: carve from the highest free address (transient buffers), keeping long-lived ones low.

        Raises:
            GeminiMemoryError: the capacity, or on a preallocated arena any single hole, is too small.
        """
        size = self.block_bytes(numel, dtype)
        self._check(size, what, "device_capacity")
        if not self.preallocate:
            tensor = torch.empty(numel, dtype=dtype, device=self.device)
            self._blocks[tensor.data_ptr()] = (-1, size)
            self._account(size)
            return tensor
        index = self._find(size, from_top)
        if index is None:
            raise GeminiMemoryError(
                f"the device arena has {format_bytes(self.capacity - self.used)} free but no hole of "
                f"{format_bytes(size)} for {what} (largest {format_bytes(self.largest_hole)}): it is fragmented; "
                "raise GeminiConfig.device_capacity"
            )
        offset, hole = self._holes[index]
        if from_top:
            start = offset + hole - size
            self._holes[index] = (offset, hole - size)
        else:
            start = offset
            self._holes[index] = (offset + size, hole - size)
        if self._holes[index][1] == 0:
            del self._holes[index]
        itemsize = torch.empty((), dtype=dtype).element_size()
        tensor = self._buffer.narrow(0, start, numel * itemsize).view(dtype)
        self._blocks[tensor.data_ptr()] = (start, size)
        self._account(size)
        return tensor

    def relocate(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move a buffer to the lowest free address that holds it (compaction); returns the buffer at its new place
        (``tensor`` itself when it cannot move lower). The caller re-points every user of the old buffer."""
        offset, size = self._blocks[tensor.data_ptr()]
        if offset < 0:
            return tensor
        del self._blocks[tensor.data_ptr()]
        self._insert_hole(offset, size)
        index = self._find(size, from_top=False)  # the hole holding the buffer's own place starts at or below it
        start, hole = self._holes[index]
        self._holes[index] = (start + size, hole - size)
        if self._holes[index][1] == 0:
            del self._holes[index]
        self._blocks[self._buffer.data_ptr() + start] = (start, size)
        if start == offset:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        source = self._buffer.narrow(0, offset, nbytes)
        target = self._buffer.narrow(0, start, nbytes)
        target.copy_(source.clone() if start + nbytes > offset else source)  # overlapping ranges go through a copy
        return target.view(tensor.dtype)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a buffer handed out by this arena (and not freed)."""
        return tensor.data_ptr() in self._blocks

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in the arena's memory (a buffer or a view of one)."""
        if self._buffer is not None:
            return tensor.untyped_storage().data_ptr() == self._buffer.untyped_storage().data_ptr()
        return tensor.untyped_storage().data_ptr() in self._blocks

    def free(self, tensor: torch.Tensor) -> None:
        """Return a buffer from `allocate` to the arena (the caller drops every view of it)."""
        block = self._blocks.pop(tensor.data_ptr(), None)
        if block is None:
            raise ValueError("DeviceArena.free: the tensor is not a live buffer of this arena")
        offset, size = block
        self._account(-size)
        if offset >= 0:
            self._insert_hole(offset, size)

    def _insert_hole(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._holes, (offset, 0))
        self._holes.insert(i, (offset, size))
        if i + 1 < len(self._holes) and self._holes[i][0] + self._holes[i][1] == self._holes[i + 1][0]:
            self._holes[i] = (offset, size + self._holes[i + 1][1])
            del self._holes[i + 1]
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == self._holes[i][0]:
            self._holes[i - 1] = (self._holes[i - 1][0], self._holes[i - 1][1] + self._holes[i][1])
            del self._holes[i]

    def live_bytes(self) -> int:
        """Bytes of the buffers handed out and not freed, counted from the blocks (an independent check)."""
        return sum(size for _, size in self._blocks.values())


class HostTier(_Accounting):
    """Host memory counted against a capacity.

    Args:
        capacity: bytes; ``None`` for no limit.
        pin_memory: allocate page-locked buffers (fast, asynchronous copies to a GPU). Only with CUDA present.
    """

    def __init__(self, capacity: int | None, *, pin_memory: bool = False) -> None:
        super().__init__("host", float("inf") if capacity is None else int(capacity))
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("HostTier(pin_memory=True) needs CUDA; torch.pin_memory raises without it")
        self.pin_memory = pin_memory
        self._sizes: dict[int, int] = {}

    def allocate(self, numel: int, dtype: torch.dtype, *, what: str = "a buffer") -> torch.Tensor:
        """A new 1-D host buffer of ``numel`` elements (contents undefined); raises past the capacity."""
        nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        self._check(nbytes, what, "host_capacity")
        tensor = torch.empty(max(numel, 1), dtype=dtype, pin_memory=self.pin_memory)[:numel]
        self._sizes[tensor.data_ptr()] = nbytes
        self._account(nbytes)
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in a live buffer of this tier (the buffer or a view of it)."""
        return tensor.untyped_storage().data_ptr() in self._sizes

    def free(self, tensor: torch.Tensor) -> None:
        """Give a buffer from `allocate` back (its memory goes once the last view is dropped)."""
        nbytes = self._sizes.pop(tensor.data_ptr(), None)
        if nbytes is None:
            raise ValueError("HostTier.free: the tensor is not a live buffer of this tier")
        self._account(-nbytes)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


class DiskTier(_Accounting):
    """A directory of one file per buffer, read and written by background threads.

    Args:
        directory: where the files go (created if missing; `close` removes the files, and the directory when it
            created it and it is empty).
        capacity: bytes; ``None`` for the free space of the directory's file system at construction.
        num_threads: background I/O threads.
    """

    def __init__(self, directory: str | os.PathLike, capacity: int | None = None, *, num_threads: int = 2) -> None:
        self._created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        if capacity is None:
            capacity = shutil.disk_usage(directory).free
        super().__init__("disk", int(capacity))
        self.directory = os.fspath(directory)
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="colo-gemini-disk")
        self._sizes: dict[str, int] = {}
        self._last: dict[str, Future] = {}  # the latest operation on each file: the next one waits for it
        self._lock = threading.Lock()
        self.bytes_written = 0
        self.bytes_read = 0

    def path(self, key: str) -> str:
        """The file of buffer ``key``."""
        return os.path.join(self.directory, f"{key}.bin")

    def create(self, key: str, nbytes: int, *, what: str = "a buffer") -> None:
        """Reserve ``nbytes`` for buffer ``key`` (an empty file of that size)."""
        if key in self._sizes:
            raise ValueError(f"DiskTier.create: buffer {key!r} exists")
        self._check(nbytes, what, "disk_capacity")
        with open(self.path(key), "wb") as file:
            file.truncate(nbytes)
        self._sizes[key] = nbytes
        self._account(nbytes)

    def _submit(self, key: str, work: Callable[[], None]) -> Future:
        with self._lock:
            before = self._last.get(key)

            def run() -> None:
                if before is not None:
                    before.result()
                work()

            future = self._pool.submit(run)
            self._last[key] = future
        return future

    def write(self, key: str, tensor: torch.Tensor) -> Future:
        """Write ``tensor`` (CPU, contiguous, exactly the reserved size) to ``key`` in the background.

        The caller keeps ``tensor`` unchanged until the returned future is done.
        """
        nbytes = self._checked(key, tensor)
        self.bytes_written += nbytes

        def work() -> None:
            with open(self.path(key), "r+b", buffering=0) as file:
                file.write(_as_bytes(tensor))

        return self._submit(key, work)

    def read(self, key: str, out: torch.Tensor) -> Future:
        """Read ``key`` into ``out`` (CPU, contiguous, exactly the reserved size) in the background."""
        nbytes = self._checked(key, out)
        self.bytes_read += nbytes

        def work() -> None:
            view = _as_bytes(out)
            with open(self.path(key), "rb", buffering=0) as file:
                done = 0
                while done < nbytes:
                    count = file.readinto(view[done:])
                    if not count:
                        raise OSError(f"{self.path(key)}: file ends after {done} of {nbytes} bytes")
                    done += count

        return self._submit(key, work)

    def _checked(self, key: str, tensor: torch.Tensor) -> int:
        if key not in self._sizes:
            raise KeyError(f"DiskTier: no buffer {key!r}; create it first")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("DiskTier: reads and writes go through contiguous CPU tensors; stage device buffers")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != self._sizes[key]:
            raise ValueError(f"DiskTier: buffer {key!r} holds {self._sizes[key]} bytes, the tensor has {nbytes}")
        return nbytes

    def wait(self, key: str | None = None) -> None:
        """Wait for the operations on ``key`` (all files when ``None``), re-raising an I/O error."""
        with self._lock:
            futures = list(self._last.values()) if key is None else [self._last.get(key)]
        for future in futures:
            if future is not None:
                future.result()

    def remove(self, key: str) -> None:
        """Delete buffer ``key`` (after its operations finish)."""
        self.wait(key)
        self._last.pop(key, None)
        nbytes = self._sizes.pop(key)
        os.remove(self.path(key))
        self._account(-nbytes)

    def close(self) -> None:
        """Finish every operation, delete the files and stop the threads."""
        try:
            self.wait()
        finally:
            for key in list(self._sizes):
                self._last.pop(key, None)
                self._account(-self._sizes.pop(key))
                try:
                    os.remove(self.path(key))
                except FileNotFoundError:
                    pass
            self._pool.shutdown(wait=True)
            if self._created and not os.listdir(self.directory):
                os.rmdir(self.directory)
