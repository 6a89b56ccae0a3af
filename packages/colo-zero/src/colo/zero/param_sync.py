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
        self.waited_before_graph = False
        """True while a compiled module's graph runs after `WaitBeforeCompiledCall` waited for its chunks."""

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
        return and a parameter read as an attribute (``model.lm_head.weight``) wait for the chunks they read
        (`colo.zero.param_reads`). Returns the hook handles."""
        hooks = []
        if not self.overlap:
            return hooks
        for module in model.modules():
            owned = sorted({chunk_of[id(p)].index for p in module.parameters(recurse=False) if id(p) in chunk_of})
            subtree = sorted({chunk_of[id(p)].index for p in module.parameters() if id(p) in chunk_of})
            wait = functools.partial(self.wait_chunks, owned) if owned else None
            if wait is not None:
                hooks.append(module.register_forward_pre_hook(functools.partial(self._forward_wait, owned)))
                hooks.append(module.register_state_dict_pre_hook(wait))
            if subtree:
                wait_subtree = functools.partial(self.wait_chunks, subtree)
                hooks.append(wait_on_parameter_reads(module, subtree=wait_subtree, owned=wait))
                if module.__dict__.get("_compiled_call_impl") is not None:
                    hooks.append(WaitBeforeCompiledCall(module, wait_subtree, self))
        return hooks

    def _forward_wait(self, indices: list[int], *_) -> None:
        """A module's forward pre-hook: wait for its chunks, unless a compiled module holding it already waited for
        its whole subtree before entering its graph (`WaitBeforeCompiledCall`), where the hook is traced and must not
        touch the handles."""
        if self.waited_before_graph:
            return
        self.wait_chunks(indices)

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
        if not self.in_flight:
            return
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


class WaitBeforeCompiledCall:
    """Wait for a compiled module's chunks before its graph runs (``module.compile()``, the plugins'
    ``compile_blocks``).

    The forward pre-hooks of a compiled module and of its submodules are traced into its graph, where waiting on a
    communication handle cannot be: the module's compiled call is wrapped to wait for its whole subtree first and to
    mark the hooks inside as satisfied while the graph runs (a constant for the trace, so no recompilation). A model
    compiled whole after `ZeroOptimizer` was built is not wrapped: its hooks wait where the graph breaks.
    ``remove()`` restores the compiled call.
    """

    def __init__(self, module: torch.nn.Module, wait_subtree, params: FullParams) -> None:
        self.module = module
        self.compiled = module.__dict__["_compiled_call_impl"]
        self.wait_subtree = wait_subtree
        self.params = params
        module.__dict__["_compiled_call_impl"] = self

    def __call__(self, *args, **kwargs):
        self.wait_subtree()
        if self.params.waited_before_graph:  # nested inside another wrapped module's graph run
            return self.compiled(*args, **kwargs)
        self.params.waited_before_graph = True
        try:
            return self.compiled(*args, **kwargs)
        finally:
            self.params.waited_before_graph = False

    def remove(self) -> None:
        if self.module.__dict__.get("_compiled_call_impl") is self:
            self.module.__dict__["_compiled_call_impl"] = self.compiled


class ShardedParams:
    """Only this rank's shard of the compute copy (stage 3); gathered around the modules that use it.

    Args:
        chunks: all chunks.
        group: the data-parallel group.
        pool: where the gathered full copies come from.
        hold_until_reduced: keep every chunk a forward or backward with gradients gathers until its gradients are
            reduced (`ChunkGatherer`'s ``hold_until_reduced``; ``grad_reduction="step"``).
    """

    def __init__(
        self, chunks: list[Chunk], *, group: Group, pool: BufferPool, hold_until_reduced: bool = False
    ) -> None:
        self.chunks = chunks
        self.in_flight: dict[int, object] = {}
        """Always empty: nothing is gathered ahead of a forward by `refresh`."""
        self.gatherer = ChunkGatherer(chunks, group=group, pool=pool, hold_until_reduced=hold_until_reduced)

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
