"""Reusable flat buffers for the transient full-chunk tensors of ZeRO (gathered parameters, gradient buckets).

Stages 2 and 3 need a full-chunk buffer for a short while, many times a step: stage 3 gathers every chunk in
forward and again in backward, and stages 0/2/3 fill a gradient bucket per chunk every backward. Allocating each
afresh is not free: large host allocations come from fresh pages (a page fault and a zero fill per 4 KiB) once
the allocator has handed the previous ones back to the system, and on this path that cost is of the same order as
the communication itself. `BufferPool` keeps a few such buffers and hands them out again (DeepSpeed's and
Megatron's persistent buffers for the same reason).

A buffer is taken back only when nothing else references its memory (no view, no tensor sharing its storage, no
collective holding it): otherwise it is dropped and freed by its last user, so reusing memory can never change a
tensor someone still reads.
"""

from __future__ import annotations

import torch


def _storage_users(tensor: torch.Tensor) -> int:
    """How many holders the tensor's storage has (tensors sharing it, views, and the storage object itself)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class BufferPool:
    """Flat buffers kept for reuse, by ``(numel, dtype, device)``.

    Args:
        max_free: how many unused buffers of each kind the pool keeps; more are freed.
    """

    def __init__(self, max_free: int = 4) -> None:
        if max_free < 0:
            raise ValueError(f"BufferPool(max_free={max_free}) must be at least 0")
        self.max_free = max_free
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.num_allocated = 0
        """Buffers allocated because none was free (the rest of `take` calls reused one)."""
        self._exclusive: tuple[int, int] | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of ``numel`` elements with undefined contents: a free one when the pool has it."""
        free = self.free.get((numel, dtype, torch.device(device)))
        if free:
            return free.pop()
        self.num_allocated += 1
        buffer = torch.empty(numel, dtype=dtype, device=device)
        if self._exclusive is None:  # what an unshared buffer's reference counts read, on this torch build
            self._exclusive = (buffer._use_count(), _storage_users(buffer))
        return buffer

    def give(self, buffer: torch.Tensor) -> bool:
        """Return ``buffer`` (a tensor `take` handed out, with the caller's other references to it dropped).

        Returns:
            Whether the pool keeps it; it is not kept when something else still references its memory (it is then
            freed when that goes), or when the pool already holds ``max_free`` buffers of its kind.
        """
        if self._exclusive != (buffer._use_count(), _storage_users(buffer)):
            return False
        free = self.free.setdefault((buffer.numel(), buffer.dtype, buffer.device), [])
        if len(free) >= self.max_free:
            return False
        free.append(buffer)
        return True

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held free."""
        return sum(b.numel() * b.element_size() for buffers in self.free.values() for b in buffers)

    def clear(self) -> None:
        """Free every buffer the pool holds."""
        self.free.clear()
