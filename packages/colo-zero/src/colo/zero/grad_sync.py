"""Gradient synchronization strategies of the chunk optimizers: how a chunk's gradients reach its gradient shard.

- `PersistentGradSync` (ZeRO stage 1): gradients accumulate in a persistent full flat buffer per chunk
  (``.grad`` are views into it). In a `backward` that syncs, a post-accumulate-grad hook starts each chunk's
  async reduce-scatter into the gradient shard as soon as all the chunk's gradients are in, so it runs during the
  rest of backward; gradients accumulated any other way are reduced at the step.
- `BucketGradSync` (ZeRO stages 0/2/3, and Gemini through a subclass): a post-accumulate-grad hook copies each
  gradient into its chunk's bucket, taken from a pool, and once the chunk is complete starts an async reduction
  into the gradient shard; at most ``max_in_flight`` reductions are in flight, and a bucket goes back to the pool
  once its reduction has landed.

Either strategy can defer every reduction to the step (``deferred=True``, `colo.zero.ZeroConfig.grad_reduction`
``"step"``): gradients then accumulate in full, over all of a step's backward passes, and each chunk is reduced
once, when `GradSync.finish` runs (`ZeroOptimizer.reduce_gradients` or the step). That is how a pipeline schedule
drives ZeRO 0-3: its weight-gradient (W) steps write ``.grad`` through ``torch.autograd.grad``, which fires no
gradient hook, and the executor sums gradients of parameters tied across stages in ``.grad`` after the last
backward; only a reduction after both sees every gradient of the step. At stages 0/2/3 the full gradients are the
parameters' own ``.grad`` tensors (autograd's accumulation), copied into a pooled bucket per chunk at `finish` and
freed once copied (Megatron's distributed optimizer under pipelining accumulates full gradient buffers the same
way and reduce-scatters after the last microbatch).

A strategy never asks colo.comm which algorithm it will use: what a reduction did to a buffer it goes on using
is read from the handle (`colo.comm.Handle.input_reduced`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from colo.comm import Group, all_reduce, reduce_scatter

from .buffer_pool import BufferPool
from .chunk import Chunk


class LocalResult:
    """A finished `Handle` look-alike: a reduction over a group of one is the tensor itself."""

    input_reduced = False

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


def to_state_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; host copies of device tensors are pinned when CUDA is present (fast, async copies)."""
    if tensor.device == device:
        return tensor
    moved = tensor.to(device)
    return moved.pin_memory() if device.type == "cpu" and torch.cuda.is_available() else moved


def all_reduce_async(group: Group) -> Callable[[torch.Tensor], object]:
    """The reduction of a chunk whose shard is the whole chunk (ZeRO stage 0): an async all-reduce."""
    return lambda sent: all_reduce(sent, group=group, async_op=True) if group.size > 1 else LocalResult(sent)


def reduce_scatter_async(group: Group, *, donate: bool) -> Callable[[torch.Tensor], object]:
    """The reduction of a sharded chunk: an async reduce-scatter into this rank's part."""
    return lambda sent: reduce_scatter(sent, "sum", group=group, async_op=True, donate=donate)


class GradSync:
    """What a gradient strategy does for a chunk optimizer.

    Args:
        chunks: the trainable chunks.
        group: the data-parallel group gradients are averaged over.
        reduce_dtype: the dtype gradients travel in (``None``: their own).
        deferred: reduce nothing during backward; `finish` reduces each chunk's accumulated gradients once.
    """

    def __init__(
        self, chunks: list[Chunk], *, group: Group, reduce_dtype: torch.dtype | None, deferred: bool = False
    ) -> None:
        self.chunks = chunks
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.deferred = deferred
        """Reduce nothing during backward: gradients accumulate in full and `finish` reduces each chunk once."""
        self.sync_enabled = True
        """Off inside the optimizer's ``no_sync``: gradients accumulate without communication."""
        self._ready: dict[int, int] = {chunk.index: 0 for chunk in chunks}

    def install(self) -> list:
        """Register the gradient hooks on the chunks' parameters; returns their handles."""
        raise NotImplementedError

    def run_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, in whatever state the hooks need to know it is the optimizer's backward."""
        loss.backward()

    def finish(self) -> None:
        """Reduce whatever is not reduced yet and wait for every reduction to land in the gradient shards."""
        raise NotImplementedError

    def discard(self) -> None:
        """Zero the gradients: reductions still in flight land and are dropped, buckets too."""
        raise NotImplementedError

    def _all_grads_in(self, chunk: Chunk) -> bool:
        """Count one more gradient of the chunk in; whether that was its last (the count then starts afresh)."""
        self._ready[chunk.index] += 1
        if self._ready[chunk.index] < len(chunk.slots):
            return False
        self._ready[chunk.index] = 0
        return True

    def _sent(self, bucket: torch.Tensor) -> torch.Tensor:
        """The bucket in the dtype gradients travel in (itself when it already is)."""
        if self.reduce_dtype is not None and bucket.dtype != self.reduce_dtype:
            return bucket.to(self.reduce_dtype)
        return bucket


class BucketGradSync(GradSync):
    """Pooled gradient buckets reduced as soon as a chunk is complete, during backward, every micro-step.

    Args:
        chunks: the trainable chunks (each with a ``grad_shard`` buffer the reductions land in).
        group: the data-parallel group.
        reduce: starts a chunk's reduction: ``fn(bucket) -> handle`` whose ``wait()`` gives this rank's part.
        reduce_dtype: the dtype gradients travel in.
        pool: where buckets come from and go back to.
        device: the device of the buckets.
        state_device: the device of the gradient shards.
        max_in_flight: reductions that may be in flight at once; the next bucket first waits for the oldest.
            0: each reduction lands before the next gradient arrives.
        on_reduced: called with a chunk once its gradients are all in (reduced, or kept under ``no_sync``).
        deferred: leave gradients in ``.grad`` during backward; `finish` copies each chunk's into a bucket and
            reduces it (see the module docstring).
    """

    def __init__(
        self,
        chunks: list[Chunk],
        *,
        group: Group,
        reduce: Callable[[torch.Tensor], object],
        reduce_dtype: torch.dtype | None,
        pool: BufferPool | None = None,
        device: torch.device | None = None,
        state_device: torch.device | None = None,
        max_in_flight: int = 0,
        on_reduced: Callable[[Chunk], None] | None = None,
        deferred: bool = False,
    ) -> None:
        super().__init__(chunks, group=group, reduce_dtype=reduce_dtype, deferred=deferred)
        self.reduce = reduce
        self.pool = pool
        self.device = device
        self.state_device = state_device
        self.max_in_flight = max_in_flight
        self.on_reduced = on_reduced
        self._buckets: dict[int, torch.Tensor] = {}
        """The bucket each chunk is filling now (`_bucket_of` says where it is)."""
        self._written: dict[int, set[int]] = {}
        """Per chunk with a bucket, the offsets of the slots a gradient was written to."""
        self._pending: list = []
        """``(chunk, handle, bucket)`` of reductions in flight, oldest first; ``bucket`` goes back to the pool once
        its reduction has landed (``None``: it went back at the launch)."""
        self._shard_zero: set[int] = set()
        """Chunks whose gradient shard counts as zero (since `discard`) though it is not zeroed."""

    def install(self) -> list:
        hooks = []
        for chunk in self.chunks:
            for slot in chunk.slots:
                hook = functools.partial(self.on_grad_ready, chunk, slot)
                hooks.append(slot.param.register_post_accumulate_grad_hook(hook))
        return hooks

    # --- where buckets come from and reductions land (a subclass may keep them elsewhere) ---------------------

    def _take_bucket(self, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
        """A bucket from the pool (contents undefined until a gradient is written), once fewer than
        ``max_in_flight`` reductions are in flight."""
        while self._pending and len(self._pending) >= self.max_in_flight:
            self._land_oldest()
        return self.pool.take(chunk.numel, dtype, self.device)

    def _give_bucket(self, chunk: Chunk, bucket: torch.Tensor) -> None:
        self.pool.give(bucket)

    def _bucket_of(self, chunk: Chunk) -> torch.Tensor:
        """The bucket the chunk is filling (a subclass whose buckets may move asks where it is now)."""
        return self._buckets[chunk.index]

    def _land(self, chunk: Chunk, reduced: torch.Tensor, *, first: bool) -> None:
        """Put this rank's reduced part in the chunk's gradient shard: written over it for the step's ``first``
        reduction of the chunk, added to it after that (a reduction every micro-step)."""
        reduced = reduced.to(self.state_device, non_blocking=True)
        shard = chunk.buffer("grad_shard")
        if first:
            torch.mul(reduced.to(shard.dtype), 1.0 / self.group.size, out=shard)
        else:
            shard.add_(reduced.to(shard.dtype), alpha=1.0 / self.group.size)

    def _clear(self, chunk: Chunk) -> None:
        """A chunk no gradient reached this step: its shard becomes zero."""
        chunk.buffer("grad_shard").zero_()

    # --- the flow ---------------------------------------------------------------------------------------------

    def on_grad_ready(self, chunk: Chunk, slot, param: torch.Tensor) -> None:
        """Add the gradient into its chunk's bucket; reduce the bucket once it is complete (deferred: nothing, the
        gradient stays in ``.grad``)."""
        if self.deferred:
            return
        self._add_to_bucket(chunk, slot, param)
        if not self._all_grads_in(chunk):
            return
        if self.sync_enabled:
            self.reduce_chunk(chunk)
        elif self.on_reduced is not None:
            self.on_reduced(chunk)

    def _add_to_bucket(self, chunk: Chunk, slot, param: torch.Tensor) -> None:
        """Copy (or add, when the slot already has one) ``param.grad`` into the chunk's bucket; drop ``.grad``."""
        if chunk.index in self._buckets:
            bucket = self._bucket_of(chunk)
        else:
            bucket = self._buckets[chunk.index] = self._take_bucket(chunk, param.grad.dtype)
            self._written[chunk.index] = set()
        region = chunk.slot_view(bucket, slot)
        written = self._written[chunk.index]
        if slot.offset in written:  # ``no_sync`` accumulates in the bucket
            region.add_(param.grad)
        else:  # the bucket is not zeroed: its first gradient of a slot is copied in
            region.copy_(param.grad)
            written.add(slot.offset)
        param.grad = None

    def _zero_unwritten(self, chunk: Chunk, bucket: torch.Tensor) -> None:
        """Zero the regions of a bucket no gradient was written to: unused parameters and the padding."""
        written = self._written.pop(chunk.index, set())
        for slot in chunk.slots:
            if slot.offset not in written:
                chunk.slot_view(bucket, slot).zero_()
        bucket.narrow(0, chunk.used_numel, chunk.padding_numel).zero_()

    def reduce_chunk(self, chunk: Chunk) -> None:
        """Start reducing the chunk's bucket into its gradient shard; the bucket is the reduction's until it lands."""
        bucket = self._bucket_of(chunk)
        del self._buckets[chunk.index]
        self._zero_unwritten(chunk, bucket)
        sent = self._sent(bucket)
        handle = self.reduce(sent)
        self._ready[chunk.index] = 0
        if sent is bucket:  # the reduction holds the bucket until it lands
            self._pending.append((chunk, handle, bucket))
        else:
            self._pending.append((chunk, handle, None))
            del sent
            self._give_bucket(chunk, bucket)
        while len(self._pending) > self.max_in_flight:
            self._land_oldest()
        if self.on_reduced is not None:
            self.on_reduced(chunk)

    def _land_oldest(self) -> None:
        """Wait for the oldest reduction in flight and land it; its bucket goes back to the pool (nothing here keeps
        a reference to it: the handle and the result are dropped first)."""
        chunk, handle, bucket = self._pending.pop(0)
        reduced = handle.wait()
        first = chunk.index in self._shard_zero
        self._shard_zero.discard(chunk.index)
        self._land(chunk, reduced, first=first)
        del reduced, handle
        if bucket is not None:
            self._give_bucket(chunk, bucket)

    def _reduce_accumulated(self) -> None:
        """Deferred: every chunk's ``.grad`` into a bucket (a slot without one is zero), each bucket reduced. Every
        chunk is reduced, gradients or not, so the data ranks' collectives match whatever each one ran."""
        for chunk in self.chunks:
            for slot in chunk.slots:
                if slot.param.grad is not None:
                    self._add_to_bucket(chunk, slot, slot.param)
            if chunk.index not in self._buckets:
                self._buckets[chunk.index] = self._take_bucket(chunk, chunk.slots[0].param.dtype)
                self._written[chunk.index] = set()
            self.reduce_chunk(chunk)

    def finish(self) -> None:
        if self.deferred:
            self._reduce_accumulated()
        # chunks with unused parameters, or accumulated under no_sync, still hold a bucket: every rank flushes
        for chunk in self.chunks:
            if chunk.index in self._buckets:
                self.reduce_chunk(chunk)
        while self._pending:
            self._land_oldest()
        for chunk in self.chunks:  # chunks no gradient reached this step
            if chunk.index in self._shard_zero:
                self._clear(chunk)
        self._shard_zero.clear()

    def discard(self) -> None:
        while self._pending:  # the reductions finish (collective order) and are dropped
            chunk, handle, bucket = self._pending.pop(0)
            handle.wait()
            del handle
            if bucket is not None:
                self._give_bucket(chunk, bucket)
        for chunk in self.chunks:
            if chunk.index in self._buckets:  # a bucket still accumulating (no_sync) is dropped too
                self._give_bucket(chunk, self._bucket_of(chunk))
                del self._buckets[chunk.index]
                self._written.pop(chunk.index, None)
                self._ready[chunk.index] = 0
            self._shard_zero.add(chunk.index)  # zero in effect: the first reduction to land overwrites the shard
            for slot in chunk.slots:
                slot.param.grad = None


class PersistentGradSync(GradSync):
    """A persistent full gradient buffer per chunk, reduced once per step, overlapped with backward (ZeRO stage 1).

    Each chunk has a ``grad`` buffer (``.grad`` are views into it) and a ``grad_shard`` (this rank's region of
    ``grad`` when dtypes and devices allow). From the launch of a chunk's reduction until the step the buffer
    belongs to the optimizer: replacing or dropping a ``.grad`` is honoured (the chunk is reduced again), changing
    one in place is an error.

    Args:
        chunks: the trainable chunks, with their ``grad`` and ``grad_shard`` buffers.
        group: the data-parallel group.
        reduce_dtype: the dtype gradients travel in.
        state_device: the device of the gradient shards.
        deferred: never reduce during backward, only in `finish` (a pipeline's stage-1 gradients always were).
    """

    def __init__(
        self,
        chunks: list[Chunk],
        *,
        group: Group,
        reduce_dtype: torch.dtype | None,
        state_device: torch.device,
        deferred: bool = False,
    ) -> None:
        super().__init__(chunks, group=group, reduce_dtype=reduce_dtype, deferred=deferred)
        self.state_device = state_device
        self._in_backward = False
        self._in_flight: dict[int, tuple] = {}
        """Chunk index -> ``(handle, version of the full gradient buffer after the launch, whether the buffer
        itself was sent)`` of the one reduction of the buffer in flight; it overwrites the shard, and is superseded
        if the buffer changes."""

    def install(self) -> list:
        hooks = []
        for chunk in self.chunks:
            for slot in chunk.slots:
                hooks.append(slot.param.register_hook(functools.partial(self._before_accumulate, chunk)))
                hook = functools.partial(self._on_grad_accumulated, chunk, slot)
                hooks.append(slot.param.register_post_accumulate_grad_hook(hook))
        return hooks

    def run_backward(self, loss: torch.Tensor) -> None:
        self._ready = dict.fromkeys(self._ready, 0)  # a chunk left incomplete before (unused params) starts afresh
        self._in_backward = not self.deferred
        try:
            loss.backward()
        finally:
            self._in_backward = False

    def _before_accumulate(self, chunk: Chunk, _grad: torch.Tensor) -> None:
        """Before autograd adds a gradient into the chunk's buffer: if the buffer's reduction is still in flight
        (another backward without `no_sync`), finish it first; it is superseded by the next one."""
        if chunk.index in self._in_flight:
            self._discard_reduction(chunk)

    def _on_grad_accumulated(self, chunk: Chunk, slot, param: torch.Tensor) -> None:
        """Keep the gradient in the chunk's buffer; in a `backward` that syncs, start reducing the buffer once every
        gradient of the chunk is in."""
        region = chunk.slot_view(chunk.buffer("grad"), slot)
        if param.grad.data_ptr() != region.data_ptr():  # ``.grad`` was None or replaced before this backward
            region.copy_(param.grad)
            param.grad = region
        if not self._all_grads_in(chunk):
            return
        if self._in_backward and self.sync_enabled:
            self._reduce(chunk)

    def _reduce(self, chunk: Chunk) -> None:
        """Start reducing the chunk's full buffer into its shard. The buffer is given to the reduction only where the
        reduction sums all of it in place (``donate="whole"``), which `_discard_reduction` can undo."""
        bucket = chunk.buffer("grad")
        sent = self._sent(bucket)
        own = sent is bucket
        handle = reduce_scatter(sent, "sum", group=self.group, async_op=True, donate="whole" if own else True)
        self._ready[chunk.index] = 0
        self._in_flight[chunk.index] = (handle, bucket._version, own)

    def _discard_reduction(self, chunk: Chunk) -> None:
        """Wait for the reduction of the chunk's buffer in flight and discard it. When it summed the buffer in place
        the buffer holds the sum over ranks; divided by the rank count it is the mean, which the next reduction
        sums back to the same total, so accumulating on top of it stays correct."""
        handle, _, own = self._in_flight.pop(chunk.index)
        handle.wait()
        if own and handle.input_reduced:
            chunk.buffer("grad").div_(self.group.size)

    def _sync_full_grads(self) -> None:
        """Reduce every chunk whose buffer was not reduced during backward, or no longer holds ``.grad``."""
        for chunk in self.chunks:
            launched = self._in_flight.get(chunk.index)
            grad = chunk.buffer("grad")
            if launched is not None and grad._version != launched[1]:
                names = [slot.name for slot in chunk.slots][:3]
                raise RuntimeError(
                    f"ZeroOptimizer (stage 1): gradients of {names} were changed in place after backward had "
                    "started reducing them; once backward returns, gradients belong to the optimizer (as at "
                    "stages 2/3). Change them in a gradient hook during backward, or accumulate under no_sync() and "
                    "change them before the last backward"
                )
            regions = [(slot, chunk.slot_view(grad, slot)) for slot in chunk.slots]
            if any(s.param.grad is None or s.param.grad.data_ptr() != r.data_ptr() for s, r in regions):
                if launched is not None:  # the user dropped or replaced .grad after backward
                    self._discard_reduction(chunk)
                for slot, region in regions:
                    if slot.param.grad is None:
                        region.zero_()
                    elif slot.param.grad.data_ptr() != region.data_ptr():
                        region.copy_(slot.param.grad)
            if chunk.index not in self._in_flight:  # hooks that never completed, or gradients from outside autograd
                self._reduce(chunk)

    def finish(self) -> None:
        self._sync_full_grads()
        by_index = {chunk.index: chunk for chunk in self.chunks}
        for index in list(self._in_flight):  # one reduction of the whole buffer each: it overwrites the shard
            handle, _, _ = self._in_flight.pop(index)  # dropped once landed: its result is a shard-sized tensor
            reduced = handle.wait().to(self.state_device, non_blocking=True)
            torch.mul(reduced, 1.0 / self.group.size, out=reduced)
            by_index[index].buffer("grad_shard").copy_(reduced)
            del reduced, handle

    def discard(self) -> None:
        by_index = {chunk.index: chunk for chunk in self.chunks}
        for index in list(self._in_flight):  # a backward not followed by a step: let its reductions land
            self._discard_reduction(by_index[index])
        for chunk in self.chunks:
            chunk.buffer("grad_shard").zero_()
            grad = chunk.buffer("grad").zero_()
            for slot in chunk.slots:
                slot.param.grad = chunk.slot_view(grad, slot)
