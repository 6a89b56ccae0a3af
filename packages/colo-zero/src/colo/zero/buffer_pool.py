"""Reusable flat buffers for the transient full-chunk tensors of ZeRO (gathered parameters, gradient buckets).

Stages 2 and 3 need a full-chunk buffer for a short while, many times a step: stage 3 gathers every chunk in
forward and again in backward, and stages 0/2/3 fill a gradient bucket per chunk every backward. Allocating each
afresh is not free: large host allocations come from fresh pages (a page fault and a zero fill per 4 KiB) once
the allocator has handed the previous ones back to the system, and on this path that cost is of the same order as
the communication itself. `BufferPool` keeps a few such buffers and hands them out again (DeepSpeed's and
Megatron's persistent buffers for the same reason).

A buffer is handed out again only when nothing else references its memory (no view, no tensor sharing its
storage, no collective still holding it), so reusing memory can never change a tensor someone still reads. A
buffer returned while something still holds it (a finished collective's bookkeeping often lets go a moment
later) waits aside and is handed out once it is free.
"""

from __future__ import annotations

import torch


def _storage_users(tensor: torch.Tensor) -> int:
    """How many holders the tensor's storage has (tensors sharing it, views, and the storage object itself)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class BufferPool:
    """Flat buffers kept for reuse, by ``(numel, dtype, device)``.

    A buffer is allocated only when none of its kind is free, so without ``max_free`` the pool holds at most as
    many buffers as were ever in use at once (the high-water mark), like a caching allocator.

    Args:
        max_free: how many unused buffers of each kind the pool keeps (more are freed); ``None``: no limit.
        max_waiting: how many returned buffers that something still referenced are kept until they are free (the
            oldest is let go beyond that: its memory is freed by its last holder).
    """

    def __init__(self, max_free: int | None = None, max_waiting: int = 8) -> None:
        if max_free is not None and max_free < 0:
            raise ValueError(f"BufferPool(max_free={max_free}) must be at least 0, or None for no limit")
        if max_waiting < 0:
            raise ValueError(f"BufferPool(max_waiting={max_waiting}) must be at least 0")
        self.max_free = max_free
        self.max_waiting = max_waiting
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.waiting: list[torch.Tensor] = []
        """Returned buffers something else still referenced; handed out once nothing does."""
        self.num_allocated = 0
        """Buffers allocated because none was free (the rest of `take` calls reused one)."""
        self._exclusive: tuple[int, int] | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of ``numel`` elements with undefined contents: a free one when the pool has it."""
        key = (numel, dtype, torch.device(device))
        free = self.free.get(key)
        if free:
            return free.pop()
        for index, buffer in enumerate(self.waiting):
            if (buffer.numel(), buffer.dtype, buffer.device) == key and self._is_exclusive(buffer):
                return self.waiting.pop(index)
        self.num_allocated += 1
        buffer = torch.empty(numel, dtype=dtype, device=device)
        if self._exclusive is None:  # what an unshared buffer's reference counts read, on this torch build
            self._exclusive = (buffer._use_count(), _storage_users(buffer))
        return buffer

    def give(self, buffer: torch.Tensor) -> bool:
        """Return ``buffer`` (a tensor `take` handed out, with the caller's other references to it dropped).

        Returns:
            Whether it is free for reuse now; when something else still references its memory it waits aside
            until that goes. Not kept at all beyond ``max_free`` free buffers of its kind.
        """
        if not self._is_exclusive(buffer):
            self.waiting.append(buffer)
            if len(self.waiting) > self.max_waiting:
                self.waiting.pop(0)
            return False
        free = self.free.setdefault((buffer.numel(), buffer.dtype, buffer.device), [])
        if self.max_free is not None and len(free) >= self.max_free:
            return False
        free.append(buffer)
        return True

    def _is_exclusive(self, buffer: torch.Tensor) -> bool:
        return self._exclusive == (buffer._use_count(), _storage_users(buffer))

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held free or waiting to be."""
        held = [b for buffers in self.free.values() for b in buffers] + self.waiting
        return sum(b.numel() * b.element_size() for b in held)

    def clear(self) -> None:
        """Let go of every buffer the pool holds."""
        self.free.clear()
        self.waiting.clear()
