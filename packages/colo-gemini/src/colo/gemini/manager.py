"""`ChunkManager`: where each chunk's parameters are, and moving them between tiers just in time.

Each chunk's compute shard has a *home* (device, host or disk, from the placement). A chunk homed off the device
is copied into the device arena when a module needs it (or earlier, by a prefetch) and the copy stays there as a
cache until the policy evicts it to make room; homes are rewritten at every optimizer step, so a cached copy is
never newer than its home and evicting it moves nothing. While a chunk is *in use* (between its gather and its
release) its device copy, and on several ranks its all-gathered full copy, are pinned.

Transfers that prefetch runs ahead of use go through a background thread on CPU (a copy into the arena releases
the GIL) or a side CUDA stream from pinned memory, and through the disk tier's I/O threads; an access waits for
its chunk's transfer only.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from colo.comm import Group, all_gather
from colo.zero import Chunk

from .tiers import DeviceArena, DiskTier, GeminiMemoryError, HostTier, format_bytes
from .tracer import MemoryTracer, NonModelMemory


class _Pending:
    """A transfer in flight into a device buffer; `wait` makes the buffer usable on the current stream."""

    def __init__(self, future: Future | None = None, event=None, then=None) -> None:
        self.future = future
        self.event = event
        self.then = then

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
        if self.then is not None:
            then, self.then = self.then, None
            self.event = then()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None


@dataclass
class _Residency:
    """Where one chunk's parameters are."""

    home: str
    home_tensor: torch.Tensor | None = None
    """The home copy on the device or host (``None`` on disk)."""
    disk_key: str | None = None
    cached: torch.Tensor | None = None
    """The device copy (the home copy itself when homed on the device)."""
    pending: _Pending | None = None
    prefetched: bool = False
    full: torch.Tensor | None = None
    """The all-gathered full copy on several ranks, while in use."""
    in_use: bool = False
    bucket: torch.Tensor | None = None


class ChunkManager:
    """Moves chunk parameters between the tiers; see the module docstring.

    Args:
        chunks: every chunk, in packing order.
        group: the data-parallel group the shards are spread over.
        arena: the device tier.
        host: the host tier.
        disk: the disk tier, or ``None``.
        policy: a `StaticPolicy` or `AutoPolicy` (eviction, prefetch, device limit).
        compute_dtype: dtype of the compute copy (``None``: each chunk's own dtype).
        tracer: the memory tracer.
        non_model: the non-model memory counter (suspended while the manager allocates).
    """

    def __init__(
        self,
        chunks: list[Chunk],
        *,
        group: Group,
        arena: DeviceArena,
        host: HostTier,
        disk: DiskTier | None,
        policy,
        compute_dtype: torch.dtype | None,
        tracer: MemoryTracer,
        non_model: NonModelMemory,
    ) -> None:
        self.chunks = chunks
        self.group = group
        self.num_shards = group.size
        self.arena = arena
        self.host = host
        self.disk = disk
        self.policy = policy
        self.compute_dtype = compute_dtype
        self.tracer = tracer
        self.non_model = non_model
        self.device = arena.device
        self.residency: dict[int, _Residency] = {}
        self.transient_bytes = 0
        """Bytes of gathered full copies and gradient buckets on the device now."""
        self.transient_peak = 0
        """The most `transient_bytes` seen (the auto plan reserves it)."""
        self.relocatables = None
        """A callable returning ``(device buffer, rebind)`` pairs of other owners (the optimizer's device state),
        so `compact` can move those buffers too."""
        self._copier = (
            ThreadPoolExecutor(1, thread_name_prefix="colo-gemini-copy") if self.device.type != "cuda" else None
        )
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def dtype_of(self, chunk: Chunk) -> torch.dtype:
        """The compute dtype of a chunk."""
        return self.compute_dtype or chunk.dtype

    def _nbytes(self, chunk: Chunk, numel: int) -> int:
        return numel * torch.empty((), dtype=self.dtype_of(chunk)).element_size()

    # --- homes ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def initialize(self, chunk: Chunk, shard: torch.Tensor, home: str) -> None:
        """Store the chunk's initial compute shard ``shard`` (any device) at ``home``."""
        dtype = self.dtype_of(chunk)
        residency = _Residency(home=home)
        what = f"chunk {chunk.index}'s parameters"
        if home == "device":
            tensor = self.arena.allocate(chunk.shard_numel, dtype, what=what)
            tensor.copy_(shard)
            residency.home_tensor = residency.cached = tensor
        elif home == "host":
            residency.home_tensor = self.host.allocate(chunk.shard_numel, dtype, what=what)
            residency.home_tensor.copy_(shard)
        else:
            residency.disk_key = f"chunk{chunk.index:05d}-params"
            self.disk.create(residency.disk_key, self._nbytes(chunk, chunk.shard_numel), what=what)
            self.disk.write(residency.disk_key, shard.detach().to("cpu", dtype=dtype, copy=True).contiguous())
        self.residency[chunk.index] = residency
        self._register(chunk)

    def _register(self, chunk: Chunk) -> None:
        residency = self.residency[chunk.index]
        tensor = residency.home_tensor
        if tensor is None:
            tensor = torch.empty(chunk.shard_numel, dtype=self.dtype_of(chunk), device="meta")
        chunk.set_buffer("param_shard", tensor, tier=residency.home)

    @torch.no_grad()
    def make_resident(self, chunk: Chunk) -> None:
        """Home the chunk on the device from now on (its host or disk home is released)."""
        residency = self.residency[chunk.index]
        if residency.home == "device":
            return
        self._fetch(chunk, asynchronous=False)
        self._wait(chunk)
        if residency.home == "host":
            self.host.free(residency.home_tensor)
        else:
            self.disk.remove(residency.disk_key)
            residency.disk_key = None
        residency.home = "device"
        residency.home_tensor = residency.cached
        residency.prefetched = False
        self._register(chunk)

    @torch.no_grad()
    def write_params(self, chunk: Chunk, values: torch.Tensor, source: str) -> None:
        """Store new compute values of the chunk's shard at its home and device copy (after an optimizer step).

        Args:
            chunk: the chunk.
            values: the new compute shard.
            source: the tier ``values`` were computed on (``"device"`` or ``"host"``), for the traffic count.
        """
        residency = self.residency[chunk.index]
        nbytes = self._nbytes(chunk, chunk.shard_numel)
        if residency.cached is not None:
            self._wait(chunk)
            residency.cached.copy_(values)
            if source != "device":
                self.tracer.moved("host->device", nbytes)
        if residency.home == "host":
            residency.home_tensor.copy_(values)
            if source == "device":
                self.tracer.moved("device->host", nbytes)
        elif residency.home == "disk":
            staged = values.detach().to("cpu", dtype=self.dtype_of(chunk), copy=True).contiguous()
            self.disk.write(residency.disk_key, staged)
            self.tracer.moved(f"{source}->disk", nbytes)

    @torch.no_grad()
    def read_params(self, chunk: Chunk) -> torch.Tensor:
        """A CPU copy of the chunk's compute shard (for checkpoints of frozen chunks)."""
        residency = self.residency[chunk.index]
        if residency.home == "disk":
            out = torch.empty(chunk.shard_numel, dtype=self.dtype_of(chunk))
            self.disk.read(residency.disk_key, out).result()
            return out
        self._wait(chunk)
        return residency.home_tensor.detach().to("cpu", copy=True)

    # --- the device copy --------------------------------------------------------------------------------------

    def _wait(self, chunk: Chunk) -> None:
        residency = self.residency[chunk.index]
        if residency.pending is not None:
            residency.pending.wait()
            residency.pending = None

    def _evictable(self) -> list[int]:
        return [
            index for index, r in self.residency.items() if r.cached is not None and r.home != "device" and not r.in_use
        ]

    def _evict(self, index: int) -> None:
        residency = self.residency[index]
        self._wait(self.chunks[index])
        if residency.prefetched:
            self.tracer.current.wasted_prefetches += 1
        self.arena.free(residency.cached)
        residency.cached = None
        residency.prefetched = False
        self.tracer.current.evictions += 1

    def _make_room(
        self, nbytes: int, *, what: str, from_top: bool = False, prefetch: bool = False, position: int | None = None
    ) -> bool:
        """Evict until ``nbytes`` fit under the policy's device limit; for a prefetch of a chunk needed at
        ``position``, evict only what the policy allows and return ``False`` when that is not enough."""
        limit = self.policy.device_limit(until=position)
        while not (self.arena.can_fit(nbytes, from_top=from_top) and self.arena.used + nbytes <= limit):
            candidates = self._evictable()
            if prefetch:
                candidates = [c for c in candidates if self.policy.may_evict_for(c, position)]
            if candidates:
                self._evict(self.policy.choose_victim(candidates))
                continue
            if prefetch:
                return False
            if self.arena.used + nbytes <= self.arena.capacity and not self.arena.can_fit(nbytes, from_top=from_top):
                self.compact()  # enough bytes are free, in holes too small: slide the live buffers together
                continue
            if self.arena.can_fit(nbytes, from_top=from_top):
                self.tracer.current.budget_overruns += 1  # past the planned limit, within the capacity
                return True
            in_use = [i for i, r in self.residency.items() if r.in_use]
            raise GeminiMemoryError(
                f"the device tier cannot hold {what} ({format_bytes(nbytes)}): {format_bytes(self.arena.used)} of "
                f"{format_bytes(self.arena.capacity)} are in use by resident data and the chunks in use "
                f"{in_use}, and nothing more can be evicted; raise GeminiConfig.device_capacity"
            )
        return True

    def _shrink(self) -> None:
        """Evict cached copies until the device is within the policy's limit now (it drops where the recorded
        non-model memory rises); only what is in use may stay above it."""
        limit = self.policy.device_limit()
        while self.arena.used > limit:
            candidates = self._evictable()
            if not candidates:
                return
            self._evict(self.policy.choose_victim(candidates))

    def compact(self) -> int:
        """Move every live device buffer to the lowest free address, re-pointing the chunks' buffers, the bound
        parameters and the optimizer's device state (`relocatables` supplies those); returns how many moved."""
        for chunk in self.chunks:
            if chunk.index in self.residency:
                self._wait(chunk)
        buffers = self._relocatable() + (self.relocatables() if self.relocatables is not None else [])
        count = 0
        for tensor, rebind in sorted(buffers, key=lambda item: item[0].data_ptr()):
            moved = self.arena.relocate(tensor)
            if moved.data_ptr() != tensor.data_ptr():
                rebind(moved)
                count += 1
        self.tracer.current.compactions += 1
        return count

    def _relocatable(self) -> list:
        result = []
        for index, residency in self.residency.items():
            chunk = self.chunks[index]
            if residency.cached is not None:
                result.append((residency.cached, functools.partial(self._rebind_cached, chunk)))
            if residency.full is not None:
                result.append((residency.full, functools.partial(self._rebind_full, chunk)))
            if residency.bucket is not None:
                result.append((residency.bucket, functools.partial(setattr, residency, "bucket")))
        return result

    def _rebind_cached(self, chunk: Chunk, moved: torch.Tensor) -> None:
        residency = self.residency[chunk.index]
        residency.cached = moved
        if residency.home == "device":
            residency.home_tensor = moved
            self._register(chunk)
        if residency.in_use and residency.full is None:
            self._rebind_full(chunk, moved, keep=True)

    def _rebind_full(self, chunk: Chunk, moved: torch.Tensor, keep: bool = False) -> None:
        if not keep:
            self.residency[chunk.index].full = moved
        chunk.bind_params(moved)
        chunk.set_buffer("param", moved, tier="device")

    def _fetch(self, chunk: Chunk, *, asynchronous: bool, prefetch: bool = False, position: int | None = None) -> bool:
        """Give the chunk a device copy (evicting as the policy says); returns whether it has one."""
        residency = self.residency[chunk.index]
        if residency.cached is not None:
            return True
        dtype = self.dtype_of(chunk)
        what = f"chunk {chunk.index}'s parameters"
        nbytes = DeviceArena.block_bytes(chunk.shard_numel, dtype)
        if not self._make_room(nbytes, what=what, prefetch=prefetch, position=position):
            return False
        block = self.arena.allocate(chunk.shard_numel, dtype, what=what)
        residency.cached = block
        nbytes = self._nbytes(chunk, chunk.shard_numel)
        if residency.home == "host":
            self.tracer.moved("host->device", nbytes)
            residency.pending = self._copy_in(block, residency.home_tensor, asynchronous)
        else:
            self.tracer.moved("disk->device", nbytes)
            residency.pending = self._read_in(block, residency.disk_key)
        return True

    def _copy_in(self, block: torch.Tensor, source: torch.Tensor, asynchronous: bool) -> _Pending | None:
        if not asynchronous:
            block.copy_(source)
            return None
        if self._stream is None:
            return _Pending(future=self._copier.submit(block.copy_, source))
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            block.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        block.record_stream(self._stream)
        return _Pending(event=event)

    def _read_in(self, block: torch.Tensor, key: str) -> _Pending:
        if self.device.type != "cuda":
            return _Pending(future=self.disk.read(key, block))
        staging = torch.empty(block.numel(), dtype=block.dtype, pin_memory=self.host.pin_memory)
        future = self.disk.read(key, staging)
        return _Pending(future=future, then=lambda: self._copy_in(block, staging, True).event)

    # --- gather / release -------------------------------------------------------------------------------------

    def is_gathered(self, chunk: Chunk) -> bool:
        """Whether the chunk's parameters are usable now."""
        return self.residency[chunk.index].in_use

    @torch.no_grad()
    def gather(self, chunk: Chunk, *, backward: bool) -> None:
        """Make the chunk's parameters views of a full device copy, then prefetch what comes next."""
        residency = self.residency[chunk.index]
        if residency.in_use:
            return
        with self.non_model.suspended():
            self.policy.on_access(chunk.index, non_model=self.non_model.sample())
            self._shrink()
            if residency.home != "device":
                if residency.cached is None:
                    self.tracer.current.prefetch_misses += 1
                elif residency.prefetched:
                    self.tracer.current.prefetch_hits += 1
                else:
                    self.tracer.current.cache_hits += 1
            residency.in_use = True
            self._fetch(chunk, asynchronous=False)
            self._wait(chunk)
            residency.prefetched = False
            if self.num_shards > 1:
                dtype = self.dtype_of(chunk)
                what = f"chunk {chunk.index}'s gathered parameters"
                self._make_room(DeviceArena.block_bytes(chunk.numel, dtype), what=what, from_top=True)
                full = self.arena.allocate(chunk.numel, dtype, what=what, from_top=True)
                full.copy_(all_gather(residency.cached, group=self.group))
                residency.full = full
                self._transient(DeviceArena.block_bytes(chunk.numel, dtype))
            else:
                full = residency.cached
            chunk.bind_params(full)
            chunk.set_buffer("param", full, tier="device")
            self.tracer.access(chunk.index, self.arena.used, self.policy.device_limit())
            self._prefetch(chunk, backward=backward)

    def full_copy(self, chunk: Chunk) -> torch.Tensor:
        """The gathered full copy of a chunk in use."""
        residency = self.residency[chunk.index]
        if not residency.in_use:
            raise RuntimeError(f"chunk {chunk.index} is not gathered")
        return residency.full if residency.full is not None else residency.cached

    def locate(self, tensor: torch.Tensor) -> tuple[Chunk, int] | None:
        """``(chunk, element offset)`` when ``tensor`` is a view into the full copy of a chunk in use."""
        pointer = tensor.data_ptr()
        for index, residency in self.residency.items():
            if not residency.in_use:
                continue
            full = residency.full if residency.full is not None else residency.cached
            start = full.data_ptr()
            if start <= pointer < start + full.numel() * full.element_size() and tensor.dtype == full.dtype:
                return self.chunks[index], (pointer - start) // full.element_size()
        return None

    def prefetch(self, chunk: Chunk, *, position: int | None = None) -> bool:
        """Start bringing the chunk's parameters to the device, evicting only what the policy allows for a chunk
        needed at ``position``; returns whether the chunk has (or is getting) a device copy."""
        residency = self.residency[chunk.index]
        if residency.cached is not None or residency.in_use:
            return True
        if not self._fetch(chunk, asynchronous=True, prefetch=True, position=position):
            return False
        residency.prefetched = True
        return True

    def _prefetch(self, chunk: Chunk, *, backward: bool) -> None:
        for index, position in self.policy.prefetch_candidates(chunk.index, backward=backward):
            if not self.prefetch(self.chunks[index], position=position):
                break

    def release(self, chunk: Chunk) -> None:
        """Drop the chunk's full copy; its device copy stays as a cache (evictable unless homed there)."""
        residency = self.residency[chunk.index]
        if not residency.in_use:
            return
        chunk.unbind_params()
        chunk.drop_buffer("param")
        if residency.full is not None:
            self._transient(-DeviceArena.block_bytes(residency.full.numel(), residency.full.dtype))
            self.arena.free(residency.full)
            residency.full = None
        residency.in_use = False

    def release_all(self) -> None:
        """Release every chunk in use (after the optimizer step, or an evaluation forward)."""
        for chunk in self.chunks:
            self.release(chunk)

    # --- gradient buckets -------------------------------------------------------------------------------------

    def grad_bucket(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's full gradient bucket on the device; when created only its padding is zeroed (the caller
        writes every parameter's region, or zeroes the ones that got no gradient)."""
        residency = self.residency[chunk.index]
        if residency.bucket is None:
            with self.non_model.suspended():
                dtype = self.dtype_of(chunk)
                what = f"chunk {chunk.index}'s gradient bucket"
                self._make_room(DeviceArena.block_bytes(chunk.numel, dtype), what=what, from_top=True)
                residency.bucket = self.arena.allocate(chunk.numel, dtype, what=what, from_top=True)
                residency.bucket[chunk.used_numel :].zero_()
                self._transient(DeviceArena.block_bytes(chunk.numel, dtype))
        return residency.bucket

    def free_bucket(self, chunk: Chunk) -> None:
        """Return the chunk's gradient bucket to the arena."""
        residency = self.residency[chunk.index]
        if residency.bucket is not None:
            self._transient(-DeviceArena.block_bytes(residency.bucket.numel(), residency.bucket.dtype))
            self.arena.free(residency.bucket)
            residency.bucket = None

    def _transient(self, delta: int) -> None:
        self.transient_bytes += delta
        self.transient_peak = max(self.transient_peak, self.transient_bytes)

    # --- accounting -------------------------------------------------------------------------------------------

    def bytes_by_tier(self) -> dict[str, int]:
        """Parameter bytes per tier: homes, device caches, gathered copies and buckets (arena blocks rounded)."""
        result = {"device": 0, "host": 0, "disk": 0}
        for index, r in self.residency.items():
            chunk = self.chunks[index]
            dtype = self.dtype_of(chunk)
            if r.home == "host":
                result["host"] += self._nbytes(chunk, chunk.shard_numel)
            elif r.home == "disk":
                result["disk"] += self._nbytes(chunk, chunk.shard_numel)
            for tensor in (r.cached, r.full, r.bucket):
                if tensor is not None:
                    result["device"] += DeviceArena.block_bytes(tensor.numel(), dtype)
        return result

    def close(self) -> None:
        """Finish transfers in flight and stop the copy thread."""
        for chunk in self.chunks:
            if chunk.index in self.residency:
                self._wait(chunk)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
