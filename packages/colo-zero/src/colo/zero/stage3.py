"""ZeRO-3 parameter gathering: all-gather a chunk before the modules that use it, free it after, prefetch the next.

Hooks, installed on every module that owns parameters directly:

- forward pre-hook: gather the module's chunks (waiting on a prefetch in flight), then start the async
  all-gather of the chunk after them in packing order;
- forward hook: once every module owning parameters of a chunk has run, free the chunk's full copy; wrap the
  module's outputs in `_RegatherInBackward`, whose backward gathers the chunks again before the module's own
  backward needs them and starts the all-gather of the chunk that backward needs next (the nearest earlier one
  whose outputs were wrapped in this forward). The chunk is freed again once all its gradients have been
  reduce-scattered (done by `ZeroOptimizer`'s gradient hooks). The chunk a forward with gradients finishes with is
  not freed at all: backward would gather it again first thing.
- frozen chunks (LoRA's base weights) have no gradients whose reduction would free them: a module owning one gets
  an identity on its inputs (`_ReleaseAfterBackward`) whose backward counts the module's backward as done; the chunk
  is freed once the backward of every module that used it in this forward has run.
- activation checkpointing recomputes a block in backward, outside the model's forward: its modules gather what
  they own but free nothing after (the recomputed saved tensors are the parameters themselves) and prefetch nothing
  in forward order; the chunks are freed as above once the block's backward is through. A frozen chunk that no
  backward uses (its modules' inputs need no gradient: LoRA's first block) is freed right after the recomputation.

Parameters keep their identity: gathering sets ``param.data`` to a view of the chunk's full buffer, freeing
sets it to an empty tensor. Full buffers come from a `BufferPool` and go back to it when freed, so a step reuses
a few buffers instead of allocating one per gather. Autograd would keep a freed buffer alive (and unusable for
reuse) through the weights a forward saves for backward (``F.linear`` saves ``weight.t()``, a view of it), so
while the model's forward runs with gradients, saved-tensor hooks store such a tensor as *where it lies in
which chunk* and rebuild it from the chunk's current full copy when backward unpacks it (gathering the chunk if
it is not gathered then). A buffer anything else still references is not reused.

With ``hold_until_reduced`` (`colo.zero.ZeroConfig.grad_reduction` ``"step"``, what a pipeline's microbatches use)
a chunk gathered by a forward or backward with gradients stays gathered until its gradients are reduced, once per
step: each microbatch after the first finds it gathered, and the W steps of a zero-bubble schedule and the tied
stages' gradient sum find full-size parameters. Memory: the stage's full compute copy from its first forward to the
reduction (torchtitan's FSDP under pipelining, ``reshard_after_forward=False``, for the same reason);
communication: one all-gather per chunk per step instead of two per microbatch. Forwards without gradients
(evaluation) release as usual.

Limits: prefetch follows packing order (pack in execution order with ``param_order=execution_order(...)`` when
registration order differs); a parameter used by a module that does not own it (``F.linear(x, other.weight)``)
must be registered on that module too (tie it as ``lm_head.weight = embed.weight``); a module called twice per
forward makes its chunks be gathered twice.
"""

from __future__ import annotations

import torch
from torch.nn import Parameter

from colo.comm import Group, Handle, all_gather

from .buffer_pool import BufferPool
from .chunk import Chunk


class SavedChunkView:
    """A tensor autograd saved that lies inside a chunk's full copy: where it lies, not the memory itself."""

    __slots__ = ("chunk", "offset", "size", "stride")

    def __init__(self, chunk: Chunk, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.chunk, self.offset, self.size, self.stride = chunk, offset, size, stride


class ChunkGatherer:
    """Gathers and frees the full compute copy of ZeRO-3 chunks; see the module docstring.

    Args:
        chunks: all chunks, in packing order.
        group: the data-parallel group the shards are spread over.
        pool: where full buffers come from and go back to (a pool of its own by default).
        keep_last_for_backward: leave the chunk a forward with gradients finishes with gathered, since backward
            starts by gathering it again (FSDP2 does the same for its root module); learned from the first forward.
        hold_until_reduced: free nothing after a forward or backward with gradients: a chunk stays gathered until
            the optimizer releases it once its gradients are reduced (see the module docstring).
    """

    def __init__(
        self,
        chunks: list[Chunk],
        *,
        group: Group,
        pool: BufferPool | None = None,
        keep_last_for_backward: bool = True,
        hold_until_reduced: bool = False,
    ) -> None:
        self.chunks = chunks
        self.hold_until_reduced = hold_until_reduced
        self.group = group
        self.pool = pool if pool is not None else BufferPool()
        self.keep_last_for_backward = keep_last_for_backward
        self.kept_for_backward: int | None = None
        """The chunk forward finishes with (known after the first forward with gradients), kept gathered."""
        self._last_finished: int | None = None
        self.in_flight: dict[int, tuple[Handle, torch.Tensor]] = {}
        self.gathered_at: dict[int, Chunk] = {}
        """Gathered chunks by the data pointer of their full buffer (what the saved-tensor hook looks up)."""
        self.users: dict[int, set[int]] = {chunk.index: set() for chunk in chunks}
        self.finished: dict[int, set[int]] = {chunk.index: set() for chunk in chunks}
        self.module_chunks: dict[int, list[Chunk]] = {}
        self.needed_in_backward: set[int] = set()
        self.backward_users: dict[int, int] = {}
        """Frozen chunks: how many module calls of this forward still have their backward to run."""
        self.handles: list = []
        self._saved_hooks: list = []
        self.num_gathers = 0
        """Chunks gathered for use (forward and backward), since construction."""
        self.num_prefetch_hits = 0
        """Of those, how many were already in flight (prefetched) when needed."""
        self.gathered_bytes = 0
        """Bytes of full copies held now: gathered chunks and all-gathers in flight."""
        self.peak_gathered_bytes = 0
        """The most `gathered_bytes` reached since construction or the last `reset_peak` (the parameter memory
        stage 3 adds to the shards: the chunks in use, the prefetched one, the one kept for backward)."""

    # --- gathering --------------------------------------------------------------------------------------------

    def is_gathered(self, chunk: Chunk) -> bool:
        """Whether the chunk's full compute copy is present."""
        return chunk.has_buffer("param")

    def prefetch(self, chunk: Chunk) -> None:
        """Start the all-gather of ``chunk`` unless it is gathered or already in flight."""
        if self.is_gathered(chunk) or chunk.index in self.in_flight:
            return
        shard = chunk.buffer("param_shard")
        full = self.pool.take(chunk.numel, shard.dtype, shard.device)
        self.gathered_bytes += full.numel() * full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        handle = all_gather(shard, group=self.group, out=full, async_op=True)
        self.in_flight[chunk.index] = (handle, full)

    def gather(self, chunk: Chunk) -> None:
        """Make the chunk's parameters views of its full compute copy (all-gathering it if needed)."""
        if self.is_gathered(chunk):
            return
        self.num_gathers += 1
        self.num_prefetch_hits += chunk.index in self.in_flight
        self.prefetch(chunk)
        handle, full = self.in_flight.pop(chunk.index)
        handle.wait()
        chunk.set_buffer("param", full)
        chunk.bind_params(full)
        self.gathered_at[full.data_ptr()] = chunk

    def release(self, chunk: Chunk) -> None:
        """Free the chunk's full compute copy (back to the pool unless something still references it)."""
        if chunk.index in self.in_flight:  # a prefetch nobody used: finish it so the collective order holds
            handle, full = self.in_flight.pop(chunk.index)
            handle.wait()
            del handle
            self._give_back(full)
        if self.is_gathered(chunk):
            chunk.unbind_params()
            full = chunk.buffer("param")
            chunk.drop_buffer("param")
            del self.gathered_at[full.data_ptr()]
            self._give_back(full)
        self.finished[chunk.index].clear()
        # released in backward once its gradients are reduced: not to be prefetched again this step (a forward
        # release is followed, in the same hook, by marking the chunk needed again)
        self.needed_in_backward.discard(chunk.index)

    def _give_back(self, full: torch.Tensor) -> None:
        self.gathered_bytes -= full.numel() * full.element_size()
        self.pool.give(full)

    def reset_peak(self) -> None:
        """Start measuring `peak_gathered_bytes` afresh from what is held now."""
        self.peak_gathered_bytes = self.gathered_bytes

    def release_all(self) -> None:
        """Free every chunk (after the optimizer step, the full copies are stale)."""
        for chunk in self.chunks:
            self.release(chunk)
        self.needed_in_backward.clear()
        self.backward_users.clear()

    def backward_done(self, chunks: list[Chunk]) -> None:
        """A module using the frozen ``chunks`` is through its backward: free each that no other use still needs."""
        for chunk in chunks:
            left = self.backward_users.get(chunk.index, 0) - 1
            if left > 0:
                self.backward_users[chunk.index] = left
                continue
            self.backward_users.pop(chunk.index, None)
            self.release(chunk)

    def prefetch_for_backward(self, chunks: list[Chunk]) -> None:
        """Start gathering the chunk backward reaches after ``chunks``: the nearest earlier one it will regather."""
        earlier = [index for index in self.needed_in_backward if index < min(chunk.index for chunk in chunks)]
        if earlier:
            self.prefetch(self.chunks[max(earlier)])

    # --- saved tensors ----------------------------------------------------------------------------------------

    def locate_saved(self, tensor: torch.Tensor) -> tuple[Chunk, int] | None:
        """``(chunk, element offset in its full copy)`` when ``tensor`` lies in a gathered chunk, else ``None``."""
        chunk = self.gathered_at.get(tensor.untyped_storage().data_ptr())
        return None if chunk is None else (chunk, tensor.storage_offset())

    def full_copy_for_backward(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's full compute copy, gathered if it is not (a saved tensor is being unpacked from it)."""
        self.gather(chunk)
        return chunk.buffer("param")

    def pack_saved(self, tensor: torch.Tensor):
        """Saved-tensor pack hook: a tensor lying in a gathered chunk becomes a `SavedChunkView`."""
        if tensor.layout is not torch.strided or type(tensor) not in (torch.Tensor, Parameter) or tensor.is_meta:
            return tensor
        found = self.locate_saved(tensor)
        if found is None:
            # detached: the graph holding the tensor object itself (an op's saved output, whose grad_fn is that graph)
            # is a reference cycle through C++ that Python's collector cannot break, so a graph kept alive by
            # ``retain_graph`` (a ZB-H1 pipeline's split backward) leaked its saved activations every step
            return tensor.detach()
        chunk, offset = found
        return SavedChunkView(chunk, offset, tuple(tensor.shape), tuple(tensor.stride()))

    def unpack_saved(self, saved):
        """Saved-tensor unpack hook: a `SavedChunkView` becomes a view of the chunk's current full copy."""
        if not isinstance(saved, SavedChunkView):
            return saved
        full = self.full_copy_for_backward(saved.chunk)
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    # --- hooks ------------------------------------------------------------------------------------------------

    def install(self, model: torch.nn.Module, chunk_of: dict[int, Chunk]) -> None:
        """Register the forward hooks on every module that owns parameters of the chunks, and the saved-tensor
        hooks around ``model``'s own forward."""
        self.add_forward_root(model)
        for module in model.modules():
            owned = []
            for param in module.parameters(recurse=False):
                chunk = chunk_of.get(id(param))
                if chunk is not None and chunk not in owned:
                    owned.append(chunk)
            if not owned:
                continue
            self.module_chunks[id(module)] = owned
            for chunk in owned:
                self.users[chunk.index].add(id(module))
            self.handles.append(module.register_forward_pre_hook(self._before_forward))
            self.handles.append(module.register_forward_hook(self._after_forward))

    def add_forward_root(self, module: torch.nn.Module) -> None:
        """Treat a call of ``module`` as a whole forward (saved-tensor hooks around it, the chunk it ends with kept
        for backward): the model itself, or each model chunk of an interleaved pipeline stage, whose container is
        never called."""
        self.handles.append(module.register_forward_pre_hook(self._before_model_forward))
        self.handles.append(module.register_forward_hook(self._after_model_forward, always_call=True))

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _before_model_forward(self, module: torch.nn.Module, args) -> None:
        context = None
        if torch.is_grad_enabled():
            context = torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved)
            context.__enter__()
        self._saved_hooks.append(context)
        self._last_finished = None

    def _after_model_forward(self, module: torch.nn.Module, args, output) -> None:
        context = self._saved_hooks.pop() if self._saved_hooks else None
        if context is not None:
            context.__exit__(None, None, None)
            if self.keep_last_for_backward and self.kept_for_backward is None:
                self.kept_for_backward = self._last_finished

    def _recomputing(self) -> bool:
        """Whether a module runs with gradients outside the model's forward: activation checkpointing recomputing a
        block in backward (its saved tensors are the parameters themselves, not chunk positions)."""
        return not self._saved_hooks and torch.is_grad_enabled()

    def _holding(self) -> bool:
        """Whether what is gathered now stays gathered until the gradients are reduced (`hold_until_reduced`)."""
        return self.hold_until_reduced and torch.is_grad_enabled()

    def _before_forward(self, module: torch.nn.Module, args):
        owned = self.module_chunks[id(module)]
        for chunk in owned:
            self.gather(chunk)
        if self._recomputing():  # backward goes the other way: its own wrappers prefetch
            return None
        following = max(chunk.index for chunk in owned) + 1
        if following < len(self.chunks):
            self.prefetch(self.chunks[following])
        if self._holding():  # nothing is freed in backward: no frozen chunk needs counting
            return None
        return self.release_after_backward([chunk for chunk in owned if not chunk.trainable], args)

    def release_after_backward(self, frozen: list[Chunk], args: tuple) -> tuple | None:
        """A forward pre-hook's result for a module owning the ``frozen`` chunks: its inputs that need a gradient
        pass through an identity whose backward calls `backward_done` (the module's backward is through), and each
        chunk counts one more backward user. ``None`` (inputs unchanged) without frozen chunks, without autograd, or
        when no input needs a gradient (backward never uses the chunks for this call)."""
        if not frozen or not torch.is_grad_enabled():
            return None
        positions = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor) and arg.requires_grad]
        if not positions:
            return None
        for chunk in frozen:
            self.backward_users[chunk.index] = self.backward_users.get(chunk.index, 0) + 1
        wrapped = _ReleaseAfterBackward.apply(self, frozen, *[args[i] for i in positions])
        args = list(args)
        for i, tensor in zip(positions, wrapped):
            args[i] = tensor
        return tuple(args)

    def _after_forward(self, module: torch.nn.Module, args, output):
        owned = self.module_chunks[id(module)]
        if self._holding():  # held until the gradients are reduced: backward needs no regathering
            return output
        if self._recomputing():
            # the recomputed block's saved tensors are the gathered parameters: they stay gathered until the
            # gradients are reduced (trainable chunks) or the last module using them is through its backward (frozen
            # ones); a frozen chunk no backward of this forward uses (its modules' inputs need no gradient) was
            # gathered for the recomputed values only
            for chunk in owned:
                if not chunk.trainable and not self.backward_users.get(chunk.index):
                    self.release(chunk)
            return output
        for chunk in owned:
            done = self.finished[chunk.index]
            done.add(id(module))
            if done < self.users[chunk.index]:
                continue
            self._last_finished = chunk.index
            if chunk.index == self.kept_for_backward and torch.is_grad_enabled():
                done.clear()  # backward starts with it: it stays gathered until its gradients are reduced
            else:
                self.release(chunk)
        if not torch.is_grad_enabled():
            return output
        wrapped = _wrap_outputs(output, self, owned)
        if wrapped is not output:
            self.needed_in_backward.update(chunk.index for chunk in owned)
        return wrapped


def _wrap_outputs(output, gatherer: ChunkGatherer, chunks: list[Chunk]):
    """``output`` with every tensor that requires grad wrapped (the same object when none does)."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            return _RegatherInBackward.apply(gatherer, chunks, output)
        return output
    if isinstance(output, (tuple, list)):
        items = [_wrap_outputs(item, gatherer, chunks) for item in output]
        if all(new is old for new, old in zip(items, output)):
            return output
        return tuple(items) if isinstance(output, tuple) else items
    return output


class _ReleaseAfterBackward(torch.autograd.Function):
    """Forward: identity on a module's inputs (no communication). Backward: the module's own backward has run, so
    count it done for its frozen chunks (they have no gradients whose reduction would free them; the last use frees
    them), and pass the gradients on."""

    @staticmethod
    def forward(ctx, gatherer: ChunkGatherer, chunks: list[Chunk], *tensors: torch.Tensor):
        ctx.gatherer = gatherer
        ctx.chunks = chunks
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gatherer.backward_done(ctx.chunks)
        return (None, None, *grads)


class _RegatherInBackward(torch.autograd.Function):
    """Forward: identity (no communication). Backward: all-gather the module's chunks (and prefetch the next
    one backward needs), pass the gradient on."""

    @staticmethod
    def forward(ctx, gatherer: ChunkGatherer, chunks: list[Chunk], tensor: torch.Tensor) -> torch.Tensor:
        ctx.gatherer = gatherer
        ctx.chunks = chunks
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        for chunk in ctx.chunks:
            ctx.gatherer.gather(chunk)
        ctx.gatherer.prefetch_for_backward(ctx.chunks)
        return None, None, grad
