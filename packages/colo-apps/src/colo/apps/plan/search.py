"""The search over layouts: every combination of the degrees, ZeRO stage, checkpointing, microbatch size and schedule
that colo runs for a workload on a cluster, evaluated with the memory and time models; the fastest that fit.

Exhaustive over the candidates when there are few (`brute_force`); otherwise (`search`) pruned without changing the
answer: the model-state memory of a (plugin, degrees, stage) does not depend on checkpointing or the microbatch size,
so when it alone does not fit every variant is skipped, and activation memory grows with the microbatch size, so
larger microbatches are skipped once one does not fit for a checkpointing mode.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..booster.parallel_dims import LayoutError
from ..models.llama import LlamaConfig
from .cluster import Cluster
from .layout import Layout
from .memory import MemoryBreakdown, check_layout, is_moe, memory_breakdown
from .time import StepTime, step_time

CHECKPOINTING = (None, "selective", "full")


@dataclass(frozen=True)
class Workload:
    """What to train: a model, the sequence length and the global batch (sequences per step)."""

    config: LlamaConfig
    seq_len: int
    global_batch_size: int
    model_name: str = "custom"
    precision: str = "bf16"

    def __post_init__(self) -> None:
        from .layout import PRECISIONS

        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not supported; use one of {PRECISIONS}")
        for name in ("seq_len", "global_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name}={value!r} must be a positive integer")
        if self.seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"Workload.seq_len={self.seq_len} exceeds the model's max_position_embeddings="
                f"{self.config.max_position_embeddings}; shorten --seq or raise max_position_embeddings"
            )


@dataclass(frozen=True)
class PlanResult:
    """One evaluated layout."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    capacity: float

    @property
    def fits(self) -> bool:
        return self.memory.device_total <= self.capacity

    @property
    def shortfall(self) -> float:
        """Bytes over the device's usable memory (0 when it fits)."""
        return max(0.0, self.memory.device_total - self.capacity)


class NothingFits(ValueError):
    """No candidate layout fits; the message names the closest one, its shortfall and the setting to change."""

    def __init__(self, message: str, *, closest: PlanResult | None, setting: str) -> None:
        super().__init__(message)
        self.closest = closest
        self.setting = setting


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_pp(config, cluster: Cluster):
    """The ``(tp, pp)`` pairs a search tries: tp within a node that the model's shape allows, pp dividing the
    layers and the ranks left."""
    from ..models.llama.parallelize import check_tp_size

    world = cluster.world_size
    for tp in _divisors(min(world, cluster.devices_per_node)):
        try:
            check_tp_size(config, tp)
        except ValueError:
            continue
        for pp in _divisors(world // tp):
            if config.num_hidden_layers % pp == 0:
                yield tp, pp


def candidate_structures(workload: Workload, cluster: Cluster, *, max_sp: int = 1) -> list[Layout]:
    """Plugins and degrees (microbatch fields left at 1): every split of the world into dp x tp x pp x sp that the
    model's shape allows (tp within a node), each with the ZeRO stages colo runs with it. A mixture-of-experts model
    runs under the ``expert`` plugin or ``hybrid`` with ``ep`` (`_moe_structures`)."""
    config = workload.config
    world = cluster.world_size
    layouts = []
    precision = workload.precision
    if is_moe(config):
        return _moe_structures(workload, cluster, max_sp=max_sp)
    for tp, pp in _tp_pp(config, cluster):
        for sp in _divisors(world // (tp * pp)):
            if sp > max_sp:
                continue
            dp = world // (tp * pp * sp)
            if workload.global_batch_size % dp:
                continue
            modes = [None] if sp == 1 else ["ulysses"]
            if tp > 1 and sp == 1 and pp == 1:
                modes.append("megatron")
            for sp_mode, stage in itertools.product(modes, (0, 1, 2, 3)):
                if sp > 1 and (config.num_attention_heads // tp) % sp:
                    continue
                fields = dict(dp=dp, tp=tp, pp=pp, sp=sp, sp_mode=sp_mode, zero_stage=stage, precision=precision)
                if pp > 1:
                    fields["num_microbatches"] = pp  # placeholder, set per microbatch size
                layouts.append(fields)
    result = []
    for fields in layouts:
        try:
            result.append(Layout(plugin="hybrid", **fields))
        except (LayoutError, ValueError):
            continue
    return result


def _moe_structures(workload: Workload, cluster: Cluster, *, max_sp: int = 1) -> list[Layout]:
    """A mixture-of-experts model's structures, as the trainer runs them: the ``expert`` plugin (every ``ep``
    dividing the experts and the world, ``dp = world / ep``, ZeRO 0-2) and ``hybrid`` with ``ep > 1``: tp within a
    node (whole experts, or split with ``expert_tensor_parallel``), pp dividing the layers, ``ep`` dividing the
    experts and the data ranks, ZeRO 0-3; without a pipeline also Ulysses ``sp`` up to ``max_sp`` (the sp ranks
    count as data ranks of both gradient groups; `check_layout` drops what colo does not run or plan: a capacity
    factor, multi-head latent attention)."""
    config = workload.config
    world = cluster.world_size
    precision = workload.precision
    fields = []
    for ep in _divisors(world):
        if config.num_local_experts % ep or workload.global_batch_size % world:
            continue
        fields += [dict(plugin="expert", dp=world // ep, ep=ep, zero_stage=stage) for stage in (0, 1, 2)]
    for tp, pp in _tp_pp(config, cluster):
        for ep, sp in itertools.product(_divisors(world // (tp * pp))[1:], _divisors(world // (tp * pp))):
            if sp > max_sp or (sp > 1 and pp > 1) or (world // (tp * pp)) % (ep * sp):
                continue
            dp = world // (tp * pp * ep * sp)
            if config.num_local_experts % ep or workload.global_batch_size % (dp * ep):
                continue
            for split, stage in itertools.product((False, True) if tp > 1 else (False,), (0, 1, 2, 3)):
                structure = dict(plugin="hybrid", dp=dp, ep=ep, tp=tp, pp=pp, sp=sp, zero_stage=stage)
                structure["sp_mode"] = "ulysses" if sp > 1 else None
                structure["expert_tensor_parallel"] = split
                if pp > 1:
                    structure["num_microbatches"] = pp  # placeholder, set per microbatch size
                fields.append(structure)
    result = []
    for structure in fields:
        try:
            layout = Layout(precision=precision, **structure)
            check_layout(config, layout)
        except (LayoutError, ValueError):
            continue
        result.append(layout)
    return result


def candidate_layouts(workload: Workload, cluster: Cluster, *, micro_batch_sizes=(1, 2, 4, 8), max_sp: int = 1):
    """Every candidate layout: `candidate_structures` x checkpointing x microbatch size (x interleaving)."""
    for structure in candidate_structures(workload, cluster, max_sp=max_sp):
        yield from _variants(structure, workload, micro_batch_sizes)


def _variants(structure: Layout, workload: Workload, micro_batch_sizes):
    per_rank = workload.global_batch_size // (structure.dp * structure.ep)  # the expert plugin's data ranks: dp x ep
    for mode, mbs in itertools.product(CHECKPOINTING, micro_batch_sizes):
        if per_rank % mbs:
            continue
        if mode == "selective" and structure.zero_stage == 3:
            continue
        microbatches = per_rank // mbs
        schedules = [("1f1b", 1)]
        if structure.pp > 1:
            if microbatches < structure.pp:
                continue
            layers = workload.config.num_hidden_layers
            if layers % (structure.pp * 2) == 0 and microbatches % structure.pp == 0:
                schedules.append(("interleaved_1f1b", 2))
        for schedule, chunks in schedules:
            try:
                yield structure.replace(
                    activation_checkpointing=mode,
                    micro_batch_size=mbs,
                    num_microbatches=microbatches,
                    schedule=schedule,
                    num_model_chunks=chunks,
                )
            except (LayoutError, ValueError):
                continue


def evaluate(layout: Layout, workload: Workload, cluster: Cluster) -> PlanResult:
    """The memory and time model of one layout."""
    memory = memory_breakdown(workload.config, layout, workload.seq_len)
    time = step_time(workload.config, layout, cluster, workload.seq_len)
    return PlanResult(layout, memory, time, cluster.usable_memory)


def brute_force(workload: Workload, cluster: Cluster, *, top: int = 10, **options) -> list[PlanResult]:
    """Evaluate every candidate; the ``top`` fastest that fit (no pruning)."""
    results = [evaluate(layout, workload, cluster) for layout in candidate_layouts(workload, cluster, **options)]
    return _rank([r for r in results if r.fits], top)


def _rank(results: list[PlanResult], top: int) -> list[PlanResult]:
    return sorted(results, key=lambda r: (r.time.total, r.memory.device_total, r.layout.describe()))[:top]


def search(workload: Workload, cluster: Cluster, *, top: int = 10, micro_batch_sizes=(1, 2, 4, 8), max_sp: int = 1):
    """The ``top`` fastest layouts that fit, fastest first.

    Raises:
        NothingFits: no candidate fits; names the closest layout, its shortfall and what to change.
    """
    fitting: list[PlanResult] = []
    closest: PlanResult | None = None
    structures = candidate_structures(workload, cluster, max_sp=max_sp)
    if not structures:
        raise NothingFits(
            f"no layout of {cluster.world_size} devices suits the model (tp must divide its heads and fit in a node; "
            "dp must divide the global batch); change --global-batch or --nodes",
            closest=None,
            setting="global_batch_size",
        )
    for structure in structures:
        static = memory_breakdown(workload.config, structure, workload.seq_len).static
        if static.device > cluster.usable_memory:
            probe = evaluate(structure.replace(activation_checkpointing="full"), workload, cluster)
            closest = _closer(closest, probe)
            continue
        too_big: set = set()
        for layout in _variants(structure, workload, micro_batch_sizes):
            key = (layout.activation_checkpointing, layout.schedule)
            if key in too_big:
                continue
            result = evaluate(layout, workload, cluster)
            if result.fits:
                fitting.append(result)
            else:
                closest = _closer(closest, result)
                too_big.add(key)  # a larger microbatch saves more activations: it cannot fit either
    if not fitting:
        raise _nothing_fits(closest, cluster)
    return _rank(fitting, top)


def _closer(current: PlanResult | None, candidate: PlanResult) -> PlanResult:
    if current is None or candidate.shortfall < current.shortfall:
        return candidate
    return current


def _nothing_fits(closest: PlanResult | None, cluster: Cluster) -> NothingFits:
    gib = 1 << 30
    if closest is None:
        return NothingFits("no candidate layout", closest=None, setting="nodes")
    memory = closest.memory
    static = memory.static.device
    if static > cluster.usable_memory:
        setting = "nodes"
        advice = "model states alone exceed a device: add nodes (--nodes) for more sharding, or a larger device"
    else:
        setting = "seq"
        advice = "activations exceed what is left: shorten --seq, or add nodes (--nodes)"
    return NothingFits(
        f"nothing fits on {cluster.world_size} x {cluster.usable_memory / gib:.1f} GiB: the closest layout "
        f"({closest.layout.describe()}) needs {memory.device_total / gib:.1f} GiB per device, "
        f"{closest.shortfall / gib:.1f} GiB short (model states {static / gib:.1f} GiB, activations "
        f"{memory.activations.peak / gib:.1f} GiB); {advice}",
        closest=closest,
        setting=setting,
    )
