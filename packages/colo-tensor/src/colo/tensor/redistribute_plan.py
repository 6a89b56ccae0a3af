"""What a redistribution is: its steps (`RedistributeStep`, one mesh axis changing placement) and the plan
(`RedistributePlan`) with its volume on this rank. `colo.tensor.redistribute` searches for plans; the runner of
one step (`colo.tensor._transforms`) reads them; both import this module, which imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout
from .placement import Placement


@dataclass(frozen=True)
class RedistributeStep:
    """One step of a redistribution: the placement of ``axis`` changes from ``src`` to ``dst``.

    Attributes:
        axis: the mesh axis.
        src: its placement before the step.
        dst: its placement after the step.
        kind: ``"local"`` (no data moves), ``"slice"``, ``"to_partial"``, ``"all_gather"``, ``"all_reduce"``,
            ``"reduce_scatter"``, ``"all_reduce_slice"`` or ``"all_to_all"``.
        collective: the colo collective the step calls (the `CommTracker` op name), ``None`` for local steps and
            for collectives skipped because every piece in the group is empty.
        bytes: this rank's volume as the `CommTracker` counts it (0 for local steps).
        before: the layout before the step.
        after: the layout after the step.
        note: why the step is what it is when that is not obvious (padding, fallbacks).
    """

    axis: str
    src: Placement
    dst: Placement
    kind: str
    collective: str | None
    bytes: float
    before: Layout
    after: Layout
    note: str = ""


@dataclass(frozen=True)
class RedistributePlan:
    """The steps from one layout to another, in order, with their planned volume on this rank."""

    src: Layout
    dst: Layout
    steps: tuple[RedistributeStep, ...]

    @property
    def bytes(self) -> float:
        """Total volume on this rank, as the `CommTracker` counts it."""
        return sum(step.bytes for step in self.steps)

    def bytes_by(self, collective: str | None = None, *, axis: str | None = None) -> float:
        """Volume of the steps calling ``collective`` on ``axis`` (``None``: any), like `CommTracker.bytes`."""
        return sum(
            s.bytes
            for s in self.steps
            if s.collective is not None
            and (collective is None or s.collective == collective)
            and (axis is None or s.axis == axis)
        )

    @property
    def num_collectives(self) -> int:
        """Number of collective calls the plan makes."""
        return sum(step.collective is not None for step in self.steps)

    def __str__(self) -> str:
        lines = [f"{self.src} -> {self.dst}"]
        for step in self.steps:
            what = step.collective or "local"
            note = f"  ({step.note})" if step.note else ""
            lines.append(f"  {step.axis}: {step.src!r} -> {step.dst!r}  {step.kind} [{what}] {step.bytes:.0f} B{note}")
        return "\n".join(lines)
