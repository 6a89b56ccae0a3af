"""Chunks: parameters packed into flat, padded buffers that are the unit of all-gather, reduce-scatter and placement.

A `Chunk` owns a contiguous range of parameters that share a parameter group, a dtype and ``requires_grad``.
Its capacity is a multiple of the number of data-parallel shards, so every rank owns an equal flat slice
(``shard_numel`` elements at ``shard_offset``). The chunk holds *named* flat buffers (`ChunkBuffer`), each
tagged with a tier (``"device"``, ``"host"`` or ``"disk"``), so a placement policy (Gemini) can move each one
independently. The buffer names used by `colo.zero` are listed in `BUFFER_NAMES`.

Packing order is the order parameters are handed in: registration order (``model.named_parameters()``) by
default, or the order a forward pass first uses them (`execution_order`), which is what ZeRO-3's prefetch and
the gradient buckets' completion follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TIERS = ("device", "host", "disk")
"""Where a buffer may live. `colo.zero` keeps everything on ``"device"``; Gemini moves buffers between tiers."""

BUFFER_NAMES = {
    "param": "the full compute copy of the chunk (parameters are views into it while it is gathered)",
    "param_shard": "this rank's slice of the compute copy (ZeRO-3 only, where the full copy is transient)",
    "master": "this rank's fp32 master slice, the tensor the torch optimizer steps",
    "grad": "full gradients of the chunk in the compute dtype (stage 1: persistent; stages 2/3: a transient bucket)",
    "grad_shard": "this rank's reduced gradient slice in the reduce dtype (fp32 copy as the master's ``.grad``)",
    "optim/<state>": "the optimizer's state for the master (``optim/exp_avg`` ...), registered after the first step",
}


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is at least ``value``."""
    return -(-value // multiple) * multiple


@dataclass
class ChunkBuffer:
    """A named flat buffer of a chunk and the tier it lives on."""

    tensor: torch.Tensor
    tier: str = "device"
    aliases: str | None = None
    """Name of another buffer this one is a view of (its bytes are counted there, not twice)."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier={self.tier!r} is not a tier; use one of {TIERS}")


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its chunk."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class ChunkPlan:
    """The parameters of one chunk before any buffer exists (the output of `plan_chunks`)."""

    group_index: int
    dtype: torch.dtype
    trainable: bool
    capacity: int
    entries: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    used: int = 0


class Chunk:
    """A flat, padded run of parameters sharded evenly over ``num_shards`` data-parallel ranks.

    Args:
        index: position of the chunk in packing order.
        plan: the parameters, parameter group, dtype and capacity (from `plan_chunks`).
        num_shards: size of the data-parallel group; ``plan.capacity`` must divide by it.
        shard_rank: this rank's index in that group.
    """

    def __init__(self, index: int, plan: ChunkPlan, *, num_shards: int, shard_rank: int) -> None:
        if plan.capacity % num_shards:
            raise ValueError(f"chunk capacity {plan.capacity} must be a multiple of num_shards={num_shards}")
        self.index = index
        self.group_index = plan.group_index
        self.dtype = plan.dtype
        self.trainable = plan.trainable
        self.numel = plan.capacity
        self.num_shards = num_shards
        self.shard_numel = plan.capacity // num_shards
        self.shard_offset = shard_rank * self.shard_numel
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, param in plan.entries:
            self.slots.append(ParamSlot(name, param, offset, param.numel(), param.shape))
            offset += param.numel()
        self.used_numel = offset
        self.buffers: dict[str, ChunkBuffer] = {}

    @property
    def padding_numel(self) -> int:
        """Elements of the chunk that hold no parameter."""
        return self.numel - self.used_numel

    # --- buffers ----------------------------------------------------------------------------------------------

    def set_buffer(self, name: str, tensor: torch.Tensor, *, tier: str = "device", aliases: str | None = None) -> None:
        """Store ``tensor`` as the buffer ``name`` on ``tier`` (replacing any previous one)."""
        self.buffers[name] = ChunkBuffer(tensor, tier, aliases)

    def buffer(self, name: str) -> torch.Tensor:
        """The tensor of buffer ``name``; raises a `KeyError` naming the buffers present when it is absent."""
        if name not in self.buffers:
            raise KeyError(f"chunk {self.index} has no buffer {name!r}; it holds {sorted(self.buffers)}")
        return self.buffers[name].tensor

    def has_buffer(self, name: str) -> bool:
        """Whether buffer ``name`` is present."""
        return name in self.buffers

    def drop_buffer(self, name: str) -> None:
        """Forget buffer ``name`` (its memory is freed once nothing else references it)."""
        self.buffers.pop(name, None)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-chunk flat tensor (a view)."""
        return full.narrow(0, self.shard_offset, self.shard_numel)

    def slot_view(self, full: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """The region of ``slot`` in a full-chunk flat tensor, shaped like the parameter (a view)."""
        return full.narrow(0, slot.offset, slot.numel).view(slot.shape)

    # --- parameters -------------------------------------------------------------------------------------------

    def pack(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new full-chunk flat tensor holding the parameters' current values, zero padded."""
        full = torch.zeros(self.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for slot in self.slots:
                full.narrow(0, slot.offset, slot.numel).copy_(slot.param.detach().reshape(-1))
        return full

    def bind_params(self, full: torch.Tensor) -> None:
        """Make every parameter of the chunk a view into ``full`` (the gathered compute copy)."""
        for slot in self.slots:
            slot.param.data = self.slot_view(full, slot)

    def unbind_params(self, dtype: torch.dtype | None = None) -> None:
        """Point every parameter at an empty tensor, so the full compute copy can be freed (ZeRO-3).

        The placeholder keeps the compute dtype (``dtype``, default the dtype the parameter has now): code that reads
        ``param.dtype`` before the chunk is gathered again (peft casts a LoRA layer's input to its weight's dtype)
        must see the dtype the module computes in, not the chunk's storage dtype."""
        for slot in self.slots:
            slot.param.data = torch.empty(0, dtype=dtype or slot.param.dtype, device=slot.param.device)

    def __repr__(self) -> str:
        names = [slot.name for slot in self.slots]
        return (
            f"Chunk({self.index}, numel={self.numel}, used={self.used_numel}, dtype={self.dtype}, "
            f"group={self.group_index}, trainable={self.trainable}, params={names})"
        )


def execution_order(model: torch.nn.Module, *args, **kwargs) -> list[str]:
    """The model's parameter names in the order a forward pass first uses the modules that own them.

    Runs one forward (without autograd) on ``args``/``kwargs``, with pre-hooks recording each module's own
    parameters the first time it is called; parameters the pass never reaches follow in registration order.
    Pass the result as ``ZeroOptimizer(..., param_order=...)``.
    """
    names = {id(param): name for name, param in model.named_parameters()}
    order: dict[str, None] = {}

    def record(module: torch.nn.Module, _inputs) -> None:
        for param in module.parameters(recurse=False):
            if id(param) in names:
                order.setdefault(names[id(param)])

    handles = [module.register_forward_pre_hook(record) for module in model.modules()]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return list(order) + [name for name in names.values() if name not in order]


def _pack(entries, *, num_shards: int, capacity: int) -> list[ChunkPlan]:
    """Greedy packing in the given order; one open chunk per (group, dtype, trainable) key."""
    capacity = round_up(capacity, num_shards)
    open_chunks: dict[tuple, ChunkPlan] = {}
    plans: list[ChunkPlan] = []
    for name, param, group_index in entries:
        key = (group_index, param.dtype, param.requires_grad)
        numel = param.numel()
        if numel > capacity:  # an oversized parameter gets a chunk of its own
            plan = ChunkPlan(group_index, param.dtype, param.requires_grad, round_up(numel, num_shards))
            plan.entries.append((name, param))
            plan.used = numel
            plans.append(plan)
            continue
        plan = open_chunks.get(key)
        if plan is None or plan.used + numel > plan.capacity:
            plan = ChunkPlan(group_index, param.dtype, param.requires_grad, capacity)
            open_chunks[key] = plan
            plans.append(plan)
        plan.entries.append((name, param))
        plan.used += numel
    return plans


def padding_of(plans: list[ChunkPlan]) -> int:
    """Total padding elements of a packing."""
    return sum(plan.capacity - plan.used for plan in plans)


def plan_chunks(
    entries: list[tuple[str, torch.nn.Parameter, int]],
    *,
    num_shards: int,
    chunk_numel: int | None = None,
    max_chunk_numel: int = 1 << 22,
    num_candidates: int = 256,
    padding_tolerance: float = 0.01,
) -> list[ChunkPlan]:
    """Pack parameters into chunks, choosing a chunk size with near-least padding unless one is given.

    Chunks never mix parameter groups, dtypes, or frozen and trainable parameters: each such key has its own
    sequence of chunks, filled in the order of ``entries``. Every chunk has the same capacity (a multiple of
    ``num_shards``), except a parameter larger than the capacity, which gets a chunk of its own.

    Args:
        entries: ``(name, parameter, param group index)`` in packing order.
        num_shards: data-parallel size; capacities are rounded up to a multiple of it.
        chunk_numel: the capacity in elements; ``None`` searches: the smallest capacity whose padding is within
            ``padding_tolerance`` (a fraction of all elements) of the least padding found.
        max_chunk_numel: upper end of the search (the largest parameter sets the lower end; the search reaches
            at least twice the largest parameter).
        num_candidates: how many evenly spaced capacities the search tries.
        padding_tolerance: padding, as a fraction of the parameters, traded for smaller (more) chunks.

    Returns:
        The chunk plans in packing order.
    """
    if not entries:
        raise ValueError("the model has no parameters to pack into chunks")
    if chunk_numel is not None:
        return _pack(entries, num_shards=num_shards, capacity=chunk_numel)
    largest = round_up(max(param.numel() for _, param, _ in entries), num_shards)
    totals: dict[tuple, int] = {}
    for _, param, group_index in entries:
        key = (group_index, param.dtype, param.requires_grad)
        totals[key] = totals.get(key, 0) + param.numel()
    # the search spans [largest parameter, max_chunk_numel], and at least up to twice the largest parameter, so
    # a parameter as large as the cap does not force one capacity (and its padding) on the whole model
    ceiling = max(round_up(max_chunk_numel, num_shards), 2 * largest)
    high = max(largest, min(round_up(max(totals.values()), num_shards), ceiling))
    step = max(num_shards, round_up((high - largest) // max(num_candidates, 1), num_shards))
    candidates = [_pack(entries, num_shards=num_shards, capacity=c) for c in list(range(largest, high, step)) + [high]]
    # the smallest capacity whose padding is within `padding_tolerance` of the least: near-minimal padding, and as
    # many chunks as that allows (chunks are the unit of overlap and prefetch)
    least = min(padding_of(plans) for plans in candidates)
    allowed = least + padding_tolerance * sum(totals.values())
    return next(plans for plans in candidates if padding_of(plans) <= allowed)
