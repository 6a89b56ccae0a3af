"""Parameter strategies of `ZeroOptimizer`: where the compute copy of a chunk lives and how a step refreshes it.

- `FullParams` (stages 0/1/2): every rank keeps the chunk's full compute copy (the ``param`` buffer the
  parameters are views of); after a step each rank's updated shard is all-gathered back into it (copied, when the
  shard is the whole chunk), optionally overlapped with the next forward (Megatron's overlapped parameter gather).
- `ShardedParams` (stage 3): each rank keeps only its shard (``param_shard``); a `ChunkGatherer` gathers the full
  copy before the modules that use it and frees it after.
"""

from __future__ import annotations

import functools

import torch

from colo.comm import Group, all_gather

from .buffer_pool import BufferPool
from .chunk import Chunk
from .param_reads import wait_on_parameter_reads
from .stage3 import ChunkGatherer


class FullParams:
    """The full compute copy on every rank (stages 0/1/2).

    Args:
        chunks: all chunks.
        group: the data-parallel group the shards are gathered over.
        device: the compute device.
        overlap: leave the gather of the updated parameters in flight when `refresh` returns; a forward pre-hook
            and a state-dict pre-hook of each module wait for its chunks (`install`).
    """

    gatherer = None

    def __init__(self, chunks: list[Chunk], *, group: Group, device: torch.device, overlap: bool) -> None:
        self.chunks = chunks
        self.group = group
        self.device = device
        self.overlap = overlap
        self.in_flight: dict[int, object] = {}
        """Chunk index -> the handle of its parameter all-gather still in flight."""

    def place(self, chunk: Chunk, full: torch.Tensor) -> tuple[torch.Tensor, str]:
        """Give the chunk its compute buffer from the packed ``full`` copy; returns this rank's shard of it and the
        name of the buffer the shard is a part of (a master that aliases it names it)."""
        chunk.set_buffer("param", full)
        chunk.bind_params(full)
        return chunk.shard_of(full), "param"

    def install(self, model: torch.nn.Module, chunk_of: dict[int, Chunk]) -> list:
        """With ``overlap``: forward and state-dict pre-hooks that wait for the in-flight gather of a module's chunks,
        so a forward, and a ``state_dict()`` of the module or of any module holding it, see the parameters `refresh`
        wrote; and ``module.parameters()`` / ``named_parameters()`` outside a forward wait for the chunks they
        return (`colo.zero.param_reads`). Returns the hook handles."""
        hooks = []
        if not self.overlap:
            return hooks
        for module in model.modules():
            owned = sorted({chunk_of[id(p)].index for p in module.parameters(recurse=False) if id(p) in chunk_of})
            subtree = sorted({chunk_of[id(p)].index for p in module.parameters() if id(p) in chunk_of})
            if owned:
                wait = functools.partial(self.wait_chunks, owned)
                hooks.append(module.register_forward_pre_hook(wait))
                hooks.append(module.register_state_dict_pre_hook(wait))
            if subtree:
                hooks.append(wait_on_parameter_reads(module, subtree=functools.partial(self.wait_chunks, subtree)))
        return hooks

    @torch.no_grad()
    def refresh(self, chunks: list[Chunk]) -> None:
        """Bring the compute copies of ``chunks`` up to date with their masters."""
        for chunk in chunks:
            master = chunk.buffer("master")
            aliased = chunk.buffers["master"].aliases is not None
            param = chunk.buffer("param")
            if chunk.num_shards == 1:  # the shard is the whole chunk
                if not aliased:
                    param.copy_(master, non_blocking=True)
                continue
            piece = master if aliased else master.to(self.device, param.dtype, non_blocking=True)
            # in place when the master is the param's own shard; overlapped with the next forward when configured
            self.in_flight[chunk.index] = all_gather(piece, group=self.group, out=param, async_op=True)
        if not self.overlap:
            self.wait()

    @torch.no_grad()
    def refresh_frozen(self) -> None:
        """Rebuild frozen chunks' compute copies from their shards (after a checkpoint load)."""
        for chunk in self.chunks:
            if not chunk.trainable and chunk.num_shards > 1:
                param = chunk.buffer("param")
                param.copy_(all_gather(chunk.shard_of(param).clone(), group=self.group))

    def wait_chunks(self, indices: list[int], *_) -> None:
        for index in indices:
            handle = self.in_flight.pop(index, None)
            if handle is not None:
                handle.wait()

    def wait(self) -> None:
        """Wait for every parameter gather still in flight."""
        self.wait_chunks(list(self.in_flight))

    def release(self, chunk: Chunk) -> None:
        """Nothing to free: the full copy stays."""

    def release_all(self) -> None:
        """Nothing to free: the full copies stay."""


class ShardedParams:
    """Only this rank's shard of the compute copy (stage 3); gathered around the modules that use it.

    Args:
        chunks: all chunks.
        group: the data-parallel group.
        pool: where the gathered full copies come from.
    """

    def __init__(self, chunks: list[Chunk], *, group: Group, pool: BufferPool) -> None:
        self.chunks = chunks
        self.in_flight: dict[int, object] = {}
        """Always empty: nothing is gathered ahead of a forward by `refresh`."""
        self.gatherer = ChunkGatherer(chunks, group=group, pool=pool)

    def place(self, chunk: Chunk, full: torch.Tensor) -> tuple[torch.Tensor, str]:
        shard = chunk.shard_of(full).clone()
        chunk.set_buffer("param_shard", shard)
        chunk.unbind_params(full.dtype)
        return shard, "param_shard"

    def install(self, model: torch.nn.Module, chunk_of: dict[int, Chunk]) -> list:
        self.gatherer.install(model, chunk_of)
        return []

    @torch.no_grad()
    def refresh(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            if chunk.buffers["master"].aliases is None:
                chunk.buffer("param_shard").copy_(chunk.buffer("master"), non_blocking=True)
        self.gatherer.release_all()

    def refresh_frozen(self) -> None:
        """Frozen shards are loaded in place; the next gather sees them."""

    def wait(self) -> None:
        """Nothing is left in flight by `refresh`."""

    def release(self, chunk: Chunk) -> None:
        self.gatherer.release(chunk)

    def release_all(self) -> None:
        self.gatherer.release_all()
