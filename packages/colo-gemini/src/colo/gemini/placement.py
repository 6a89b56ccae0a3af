"""Placement: which tier holds each chunk's parameters and optimizer state, checked against the capacities, and
the policies that pick what to evict and what to prefetch while training.

Two kinds of data per chunk are placed:

- the **parameters**, this rank's shard of the compute copy (bf16/fp16/fp32); its *home* is a tier. A chunk homed
  on the host or disk is copied to the device when a module needs it and the copy is kept as a cache until
  evicted; the home is updated at every optimizer step (write-through), so evicting a copy costs no transfer.
- the **optimizer state**: the fp32 master shard, the two Adam moments and the fp32 gradient shard. It lives on
  one tier and the chunk's Adam step runs there (see `colo.gemini.optimizer`); on disk the master and moments
  are files streamed through the host, and the gradient shard stays in host memory.

`static` placement fixes the homes from fractions per tier (Colossal-AI's ``offload_param_frac`` is
``1 - param_fractions["device"]``, its ``offload_optim_frac`` is ``1 - optim_fractions["device"]``). `auto`
placement homes everything off the device first, records a warm-up step, and then plans with what it saw
(`AutoPolicy`). Both are checked before training: a tier given more than it holds, or a model larger than all
tiers together, raises with the bytes missing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from .tiers import DeviceArena, format_bytes

TIERS = ("device", "host", "disk")
CAPACITY_FIELDS = {"device": "device_capacity", "host": "host_capacity", "disk": "disk_capacity"}


@dataclass(frozen=True)
class ChunkSizes:
    """The bytes one chunk needs on this rank, per kind of data (arena sizes rounded as the arena rounds them)."""

    index: int
    trainable: bool
    param: int
    """This rank's shard of the compute copy."""
    full: int
    """The gathered full compute copy, needed on the device while the chunk is in use (0 on one rank, where the
    shard is the full copy)."""
    bucket: int
    """The full-chunk gradient bucket of backward, in the compute dtype (0 for frozen chunks)."""
    master: int
    """The fp32 master shard (0 for frozen chunks)."""
    states: int
    """The two fp32 Adam moments."""
    grad: int
    """The fp32 gradient shard."""

    @property
    def optimizer(self) -> int:
        """Master, moments and gradient shard."""
        return self.master + self.states + self.grad


def chunk_sizes(chunk, *, compute_dtype: torch.dtype) -> ChunkSizes:
    """The `ChunkSizes` of a `colo.zero.Chunk` whose compute copy has ``compute_dtype``."""
    block = DeviceArena.block_bytes
    shard = chunk.shard_numel
    trainable = chunk.trainable
    return ChunkSizes(
        index=chunk.index,
        trainable=trainable,
        param=block(shard, compute_dtype),
        full=block(chunk.numel, compute_dtype) if chunk.num_shards > 1 else 0,
        bucket=block(chunk.numel, compute_dtype) if trainable else 0,
        master=block(shard, torch.float32) if trainable else 0,
        states=2 * block(shard, torch.float32) if trainable else 0,
        grad=block(shard, torch.float32) if trainable else 0,
    )


@dataclass
class Placement:
    """Where each chunk's parameters are homed and where its optimizer state lives."""

    param_home: dict[int, str]
    optim_tier: dict[int, str]
    """Trainable chunks only."""


def _by_fractions(sizes: list[tuple[int, int]], fractions: dict[str, float]) -> dict[int, str]:
    """Assign items ``(index, bytes)``, in order, to tiers so each tier gets about its fraction of the bytes.

    An item goes to the tier whose share of the cumulative byte range holds the item's midpoint.
    """
    total = sum(nbytes for _, nbytes in sizes) or 1
    bounds, running = [], 0.0
    for tier in TIERS:
        running += fractions.get(tier, 0.0)
        bounds.append(running)
    result, start = {}, 0
    for index, nbytes in sizes:
        middle = (start + nbytes / 2) / total
        position = min(bisect.bisect_right(bounds, middle), len(TIERS) - 1)
        while fractions.get(TIERS[position], 0.0) == 0.0 and position > 0:  # never onto a tier given nothing
            position -= 1
        while fractions.get(TIERS[position], 0.0) == 0.0:
            position += 1
        result[index] = TIERS[position]
        start += nbytes
    return result


def static_placement(
    sizes: list[ChunkSizes], *, param_fractions: dict[str, float], optim_fractions: dict[str, float]
) -> Placement:
    """Homes by fractions of the bytes per tier, filled in packing order: device, then host, then disk."""
    param_home = _by_fractions([(s.index, s.param) for s in sizes], param_fractions)
    optim_tier = _by_fractions([(s.index, s.optimizer) for s in sizes if s.trainable], optim_fractions)
    return Placement(param_home, optim_tier)


def working_set(sizes: list[ChunkSizes], module_chunks: list[list[int]], param_home: dict[int, str]) -> int:
    """The least device memory in use while modules run, from the modules' order of registration.

    A chunk is in use from the first module that owns it to the last (in forward, and mirrored in backward,
    where its gradient bucket is held as well); its device copy counts unless it is homed on the device. The
    maximum over modules of what is in use together is the floor the device must hold beyond resident data.
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for position, chunks in enumerate(module_chunks):
        for index in chunks:
            first.setdefault(index, position)
            last[index] = position
    by_index = {s.index: s for s in sizes}
    peak = 0
    for position in range(len(module_chunks)):
        total = 0
        for index in first:
            if first[index] <= position <= last[index]:
                s = by_index[index]
                total += (s.param if param_home[index] != "device" else 0) + s.full + s.bucket
        peak = max(peak, total)
    return peak


def disk_staging_bytes(sizes: list[ChunkSizes], optim_tier: dict[int, str]) -> int:
    """Host buffers that stream disk-resident optimizer state: two chunks' master and moments (double buffering)."""
    largest = max((s.master + s.states for s in sizes if optim_tier.get(s.index) == "disk"), default=0)
    return 2 * largest


def tier_demand(sizes: list[ChunkSizes], placement: Placement, *, working: int) -> dict[str, dict[str, int]]:
    """Bytes each tier must hold under ``placement``, by purpose."""
    demand = {tier: {"parameters": 0, "optimizer states": 0} for tier in TIERS}
    demand["device"]["working set"] = working
    for s in sizes:
        demand[placement.param_home[s.index]]["parameters"] += s.param
        tier = placement.optim_tier.get(s.index)
        if tier is None:
            continue
        if tier == "disk":
            demand["disk"]["optimizer states"] += s.master + s.states
            demand["host"]["gradient shards"] = demand["host"].get("gradient shards", 0) + s.grad
        else:
            demand[tier]["optimizer states"] += s.optimizer
    staging = disk_staging_bytes(sizes, placement.optim_tier)
    if staging:
        demand["host"]["disk staging"] = staging
    return demand


def check_capacities(demand: dict[str, dict[str, int]], capacities: dict[str, float], *, policy: str) -> None:
    """Raise a `ValueError` naming the field to change when the model does not fit, before training starts.

    The error for a model larger than all tiers together says how many bytes are missing in all; otherwise the
    first tier over its capacity is named with what it was given.
    """
    need = {tier: sum(parts.values()) for tier, parts in demand.items()}
    total_need = sum(need.values())
    total_capacity = sum(capacities.values())
    if total_need > total_capacity:
        shown = " + ".join(
            f"{tier} {format_bytes(capacities[tier])}" for tier in TIERS if capacities[tier] != float("inf")
        )
        raise ValueError(
            f"the model does not fit in the tiers: it needs {format_bytes(total_need)} (parameters, optimizer "
            f"states and the device working set) but {shown} hold {format_bytes(total_capacity)}; "
            f"{format_bytes(total_need - total_capacity)} are missing. Raise GeminiConfig.device_capacity, "
            "host_capacity or disk_capacity, or add a disk tier with disk_dir="
        )
    for tier in TIERS:
        if need[tier] > capacities[tier]:
            parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in demand[tier].items() if value)
            move = (
                "move part of param_fractions / optim_fractions to another tier"
                if policy == "static"
                else "add capacity elsewhere"
            )
            raise ValueError(
                f"GeminiConfig.{CAPACITY_FIELDS[tier]}={format_bytes(capacities[tier])} is too small: the "
                f"{policy} placement puts {format_bytes(need[tier])} on the {tier} tier ({parts}); "
                f"{format_bytes(need[tier] - capacities[tier])} are missing. Raise {CAPACITY_FIELDS[tier]} or {move}"
            )


def auto_initial_placement(
    sizes: list[ChunkSizes], capacities: dict[str, float], *, working: int, has_disk: bool
) -> Placement:
    """Auto placement before the warm-up: everything off the device where it fits.

    The device keeps its capacity for the working set and the cache until the warm-up has shown what fits.
    Parameters go first (they are read twice a step): host, then disk, then the device. Then optimizer state:
    the first ``k`` trainable chunks on the host and the rest on disk (their gradient shards and the streaming
    buffers on the host), with the largest ``k`` the host and disk can hold; what still does not fit goes to the
    device. `check_capacities` then reports anything that fits nowhere.
    """
    free = {
        "host": capacities["host"],
        "disk": capacities["disk"] if has_disk else 0.0,
        "device": capacities["device"] - working,
    }
    param_home: dict[int, str] = {}
    for s in sizes:
        tier = next((t for t in ("host", "disk", "device") if free[t] >= s.param), "host")
        free[tier] -= s.param
        param_home[s.index] = tier
    trainable = [s for s in sizes if s.trainable]
    optim_tier: dict[int, str] = {}
    for k in range(len(trainable), -1, -1):
        on_host, rest = trainable[:k], trainable[k:]
        host_need = sum(s.optimizer for s in on_host) + sum(s.grad for s in rest)
        host_need += 2 * max((s.master + s.states for s in rest), default=0)  # disk streaming buffers
        disk_need = sum(s.master + s.states for s in rest)
        if host_need <= free["host"] and disk_need <= free["disk"]:
            optim_tier = {s.index: "host" for s in on_host} | {s.index: "disk" for s in rest}
            break
        if not has_disk and k < len(trainable):
            break
    if not optim_tier:  # host and disk cannot take all: fill the host, then the device, then report the rest
        for s in trainable:
            tier = next((t for t in ("host", "device") if free[t] >= s.optimizer), "host")
            free[tier] -= s.optimizer
            optim_tier[s.index] = tier
    return Placement(param_home, optim_tier)


class StaticPolicy:
    """Eviction and prefetch for `static` placement: least recently used first; prefetch the neighbouring chunks
    in packing order (the next ones in forward, the previous ones in backward), into free room only.

    Args:
        num_chunks: number of chunks.
        capacity: the device arena's capacity.
        prefetch: how many chunks ahead to prefetch.
    """

    name = "static"

    def __init__(self, num_chunks: int, *, capacity: int, prefetch: int) -> None:
        self.num_chunks = num_chunks
        self.capacity = capacity
        self.prefetch = prefetch
        self.clock = 0
        self.last_use: dict[int, int] = {}

    def on_access(self, chunk: int, *, non_model: int) -> None:
        """A chunk is needed now."""
        self.clock += 1
        self.last_use[chunk] = self.clock

    def device_limit(self, *, until: int | None = None) -> int:
        """Device bytes the policy allows now: the capacity."""
        return self.capacity

    def choose_victim(self, candidates: list[int]) -> int:
        """The least recently used candidate."""
        return min(candidates, key=lambda c: self.last_use.get(c, 0))

    def prefetch_candidates(self, chunk: int, *, backward: bool) -> list[tuple[int, int | None]]:
        """``(chunk, position)`` pairs to bring to the device next (positions are unknown here)."""
        step = -1 if backward else 1
        ahead = [chunk + step * k for k in range(1, self.prefetch + 1)]
        return [(c, None) for c in ahead if 0 <= c < self.num_chunks]

    def may_evict_for(self, victim: int, target_position: int | None) -> bool:
        """Static prefetch only uses free room."""
        return False

    def on_pause(self, *, non_model: int) -> None:
        """Counting pauses (a backward ended)."""

    def end_step(self) -> None:
        """A training step ended."""


class AutoPolicy:
    """Eviction and prefetch for `auto` placement, from the access order recorded in the warm-up step.

    During the warm-up it records, for every chunk access, the chunk and the peak non-model memory until the
    next access, and evicts least recently used. Afterwards it follows the recorded order with a cursor: the
    device limit at an access is the capacity minus the non-model memory recorded there; the victim is the
    chunk whose next use is farthest (Belady's rule); prefetch brings the next chunks of the order, evicting only
    chunks needed later than the one fetched.

    Args:
        capacity: the device arena's capacity.
        prefetch: how many chunks ahead to prefetch.
    """

    name = "auto"

    def __init__(self, *, capacity: int, prefetch: int) -> None:
        self.capacity = capacity
        self.prefetch = prefetch
        self.recording = True
        self.order: list[int] = []
        self.non_model: list[int] = []
        self.positions: dict[int, list[int]] = {}
        self.cursor = 0
        self.unplanned = 0
        self._lru = StaticPolicy(0, capacity=capacity, prefetch=0)

    # --- recording --------------------------------------------------------------------------------------------

    def on_access(self, chunk: int, *, non_model: int) -> None:
        """A chunk is needed now; ``non_model`` is the peak non-model memory since the previous access."""
        if self.recording:
            if self.non_model:
                self.non_model[-1] = max(self.non_model[-1], non_model)
            self.order.append(chunk)
            self.non_model.append(non_model)
            self._lru.on_access(chunk, non_model=non_model)
            return
        where = self.positions.get(chunk, [])
        i = bisect.bisect_left(where, self.cursor)
        if i < len(where):
            self.cursor = where[i] + 1
        else:
            self.unplanned += 1

    def on_pause(self, *, non_model: int) -> None:
        """Counting pauses (a backward ended): ``non_model`` is the peak since the last access."""
        if self.recording and self.non_model:
            self.non_model[-1] = max(self.non_model[-1], non_model)

    def finish_recording(self, *, non_model: int) -> None:
        """End the warm-up: ``non_model`` is the peak since the last access."""
        if not self.recording:
            return
        self.recording = False
        if self.non_model:
            self.non_model[-1] = max(self.non_model[-1], non_model)
        for position, chunk in enumerate(self.order):
            self.positions.setdefault(chunk, []).append(position)
        self.cursor = 0

    @property
    def non_model_peak(self) -> int:
        """The largest non-model memory the warm-up saw."""
        return max(self.non_model, default=0)

    # --- decisions --------------------------------------------------------------------------------------------

    def device_limit(self, *, until: int | None = None) -> int:
        """Capacity minus the recorded non-model memory from the current access up to position ``until``."""
        if self.recording or not self.order:
            return self.capacity
        start = max(self.cursor - 1, 0)
        end = start if until is None else max(until, start)
        reserve = max(self.non_model[start : end + 1], default=0)
        return self.capacity - reserve

    def next_use(self, chunk: int, after: int | None = None) -> int:
        """The position of the chunk's next access at or after ``after`` (default: the cursor); accesses of the
        next step count from the end of this one."""
        start = self.cursor if after is None else after
        where = self.positions.get(chunk)
        if not where:
            return 2 * len(self.order) + 1
        i = bisect.bisect_left(where, start)
        return where[i] if i < len(where) else len(self.order) + where[0]

    def choose_victim(self, candidates: list[int]) -> int:
        """The candidate whose next use is farthest (least recently used during the warm-up)."""
        if self.recording:
            return self._lru.choose_victim(candidates)
        return max(candidates, key=self.next_use)

    def prefetch_candidates(self, chunk: int, *, backward: bool) -> list[tuple[int, int | None]]:
        """The next distinct chunks of the recorded order, with their positions."""
        if self.recording:
            return []
        result, seen = [], {chunk}
        for position in range(self.cursor, len(self.order)):
            upcoming = self.order[position]
            if upcoming in seen:
                continue
            seen.add(upcoming)
            result.append((upcoming, position))
            if len(result) >= self.prefetch:
                break
        return result

    def may_evict_for(self, victim: int, target_position: int | None) -> bool:
        """Evict ``victim`` to prefetch a chunk needed at ``target_position`` only if the victim is needed later."""
        if self.recording or target_position is None:
            return False
        return self.next_use(victim) > target_position

    def end_step(self) -> None:
        """A training step ended: the next accesses follow the order from its start."""
        self.cursor = 0
