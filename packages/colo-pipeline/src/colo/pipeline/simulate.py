"""`simulate`: run a `Schedule` on a cost model and report makespan, bubble ratio and peak live activations.

The simulation follows the executor's rules: each rank runs its actions in order; a compute action takes its
cost; at a communication batch the rank posts its sends and leaves them in flight, and waits until every
receive of the batch has its send posted, plus one p2p transfer time (messages of a batch travel in
parallel). `validate` checks the stricter rule where sends block too (what gloo does to a waited send), so a
schedule that passes cannot deadlock either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, Schedule
from .validate import match_messages, peak_live_activations, validate


@dataclass(frozen=True)
class CostModel:
    """Durations, in any unit, of one action on one model chunk.

    Attributes:
        forward: time of ``F``.
        backward_input: time of ``B``.
        backward_weight: time of ``W``.
        backward: time of a fused ``BW``; ``None`` means ``backward_input + backward_weight``.
        p2p: time of one batch of transfers once both sides have posted it.
        stage_scale: optional per-stage multipliers of the compute times (unequal stages); ``None``: all 1.
        overrides: optional exact times of single (op, stage) pairs, e.g. ``{("B", 0): 0.0}`` for a first
            stage whose input needs no gradient (its ``W`` then does the whole backward).
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    backward: float | None = None
    p2p: float = 0.0
    stage_scale: tuple[float, ...] | None = None
    overrides: dict[tuple[str, int], float] | None = None

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "p2p"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name}={getattr(self, name)} must be >= 0")
        if self.backward is not None and self.backward < 0:
            raise ValueError(f"CostModel.backward={self.backward} must be >= 0 (or None for B + W)")

    def compute_time(self, op: str, stage: int) -> float:
        """Duration of compute action ``op`` on ``stage``."""
        if self.overrides and (op, stage) in self.overrides:
            return self.overrides[(op, stage)]
        base = {
            "F": self.forward,
            "B": self.backward_input,
            "W": self.backward_weight,
            "BW": self.backward if self.backward is not None else self.backward_input + self.backward_weight,
        }[op]
        if self.stage_scale is not None:
            if stage >= len(self.stage_scale):
                raise ValueError(f"CostModel.stage_scale has {len(self.stage_scale)} entries; stage {stage} has none")
            base *= self.stage_scale[stage]
        return base


@dataclass(frozen=True)
class TimelineEvent:
    """One action as the simulation (or a measurement) placed it on a rank's timeline."""

    rank: int
    action: Action | tuple[Action, ...]
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """What `simulate` found.

    Attributes:
        schedule: the schedule simulated.
        cost: the cost model used.
        makespan: time from the first action to the last, over all ranks.
        busy: per rank, the time spent in compute actions.
        events: every compute action and communication batch, with start and end times.
        peak_live_activations: per rank, the most (microbatch, chunk) pairs alive at once.
    """

    schedule: Schedule
    cost: CostModel
    makespan: float
    busy: tuple[float, ...]
    events: tuple[TimelineEvent, ...] = field(repr=False)
    peak_live_activations: tuple[int, ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank, time within the makespan not spent computing (waiting and communicating)."""
        return tuple(self.makespan - busy for busy in self.busy)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the step over all ranks: ``sum(idle) / (num_ranks * makespan)``."""
        if self.makespan == 0:
            return 0.0
        return sum(self.idle) / (len(self.busy) * self.makespan)

    @property
    def bubble_time(self) -> float:
        """Idle time of the busiest-waiting rank (the "bubble" of the papers, for equal stage costs)."""
        return max(self.idle)


def simulate(schedule: Schedule, cost: CostModel | None = None, *, check: bool = True) -> SimulationResult:
    """Run ``schedule`` on ``cost`` (default: unit F, B and W, free p2p).

    Args:
        schedule: the schedule.
        cost: durations of the actions and of a p2p batch.
        check: `validate` the schedule first (a deadlocking schedule cannot be simulated).

    Returns:
        The `SimulationResult`.
    """
    cost = cost or CostModel()
    if check:
        validate(schedule)
    counterpart, _ = match_messages(schedule)
    num_ranks = schedule.num_ranks
    items = [schedule.batches(rank) for rank in range(num_ranks)]
    # index of the batch item each comm action index belongs to
    item_of: list[dict[int, int]] = []
    for rank in range(num_ranks):
        lookup, index = {}, 0
        for position, item in enumerate(items[rank]):
            for _ in item if isinstance(item, tuple) else (item,):
                lookup[index] = position
                index += 1
        item_of.append(lookup)
    first_index = [[0] * len(items[r]) for r in range(num_ranks)]
    for rank in range(num_ranks):
        index = 0
        for position, item in enumerate(items[rank]):
            first_index[rank][position] = index
            index += len(item) if isinstance(item, tuple) else 1

    clock = [0.0] * num_ranks
    position = [0] * num_ranks
    posted: list[dict[int, float]] = [{} for _ in range(num_ranks)]
    events: list[TimelineEvent] = []
    busy = [0.0] * num_ranks
    progress = True
    while progress:
        progress = False
        for rank in range(num_ranks):
            while position[rank] < len(items[rank]):
                item = items[rank][position[rank]]
                if not isinstance(item, tuple):
                    duration = cost.compute_time(item.op, schedule.stage_of(rank, item.chunk))
                    events.append(TimelineEvent(rank, item, clock[rank], clock[rank] + duration))
                    clock[rank] += duration
                    busy[rank] += duration
                    position[rank] += 1
                    progress = True
                    continue
                posted[rank].setdefault(position[rank], clock[rank])
                start = clock[rank]
                ready_at = start
                base = first_index[rank][position[rank]]
                for offset, action in enumerate(item):
                    if action.op.startswith("SEND"):
                        continue  # a send is posted and left in flight: it does not hold the rank up
                    peer, peer_index = counterpart[(rank, base + offset)]
                    peer_item = item_of[peer][peer_index]
                    if peer_item not in posted[peer]:
                        ready_at = None
                        break
                    ready_at = max(ready_at, posted[peer][peer_item])
                if ready_at is None:
                    break
                receives = any(action.op.startswith("RECV") for action in item)
                end = ready_at + cost.p2p if receives else start
                events.append(TimelineEvent(rank, item, start, end))
                clock[rank] = end
                position[rank] += 1
                progress = True
    if any(position[r] < len(items[r]) for r in range(num_ranks)):
        raise RuntimeError(f"schedule {schedule.name!r} deadlocks in simulation; run validate() for details")
    start = min((e.start for e in events), default=0.0)
    makespan = max((e.end for e in events), default=0.0) - start
    return SimulationResult(
        schedule=schedule,
        cost=cost,
        makespan=makespan,
        busy=tuple(busy),
        events=tuple(events),
        peak_live_activations=peak_live_activations(schedule),
    )
