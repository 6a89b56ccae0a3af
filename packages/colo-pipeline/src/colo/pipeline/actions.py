"""Schedules as data: an `Action` on (microbatch, model chunk) and a `Schedule`, one action list per rank.

A pipeline of ``num_ranks`` ranks runs ``num_ranks * num_chunks`` *stages* (virtual stages when a rank holds
several model chunks). ``Schedule.stages[rank][chunk]`` is the stage that chunk ``chunk`` of ``rank`` runs;
stage ``s`` feeds stage ``s + 1``. Each rank executes its list of actions in order:

========  ==============================================================================================
op        meaning
========  ==============================================================================================
``F``     forward of the microbatch through the chunk (the last stage also computes the loss)
``B``     backward for the input: the gradient of the chunk's input, weights untouched (zero-bubble)
``W``     backward for the weights: the parameters' gradients, after the matching ``B``
``BW``    full backward, ``B`` and ``W`` fused (GPipe, 1F1B, interleaved 1F1B)
``SEND_F`` / ``RECV_F``  send this stage's output to the next stage / receive this stage's input
``SEND_B`` / ``RECV_B``  send the gradient of this stage's input back / receive the gradient of its output
========  ==============================================================================================

Consecutive communication actions of a rank form one *batch*: the executor posts them together (the sends,
then the receives, each as one ``batch_send_recv``) before the next compute action; the validator proves the
schedule deadlock-free even if a batch had to wait for all of its messages, sends included.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_OPS = ("F", "B", "W", "BW")
"""Operations that run the model."""

COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
"""Operations that move activations (``_F``) or gradients (``_B``) between ranks."""

BACKWARD_OPS = ("B", "W", "BW")
"""Operations that run (part of) a backward."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's schedule.

    Attributes:
        op: one of `COMPUTE_OPS` or `COMM_OPS`.
        microbatch: the microbatch index, ``0 <= microbatch < num_microbatches``.
        chunk: the rank's model chunk (``0`` unless the schedule is interleaved).
    """

    op: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.op not in COMPUTE_OPS and self.op not in COMM_OPS:
            raise ValueError(f"Action op={self.op!r} is unknown; use one of {COMPUTE_OPS + COMM_OPS}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"Action {self.op}: microbatch={self.microbatch} and chunk={self.chunk} must be >= 0")

    @property
    def is_compute(self) -> bool:
        """Whether the action runs the model (``F``, ``B``, ``W``, ``BW``)."""
        return self.op in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        """Whether the action is a send or a receive."""
        return self.op in COMM_OPS

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def F(microbatch: int, chunk: int = 0) -> Action:  # noqa: N802 - reads like the papers' notation
    """A forward action."""
    return Action("F", microbatch, chunk)


def B(microbatch: int, chunk: int = 0) -> Action:  # noqa: N802
    """A backward-for-input action."""
    return Action("B", microbatch, chunk)


def W(microbatch: int, chunk: int = 0) -> Action:  # noqa: N802
    """A backward-for-weights action."""
    return Action("W", microbatch, chunk)


def BW(microbatch: int, chunk: int = 0) -> Action:  # noqa: N802
    """A full (input and weights) backward action."""
    return Action("BW", microbatch, chunk)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: for each rank, the ordered list of actions it runs in one training step.

    Build one with a generator (`gpipe`, `one_f_one_b`, `interleaved_1f1b`, `zero_bubble_h1`) or by hand, and
    check it with `validate`.

    Attributes:
        name: a label for tables and pictures (``"1f1b"``).
        num_ranks: pipeline ranks (the size of the ``pp`` mesh axis).
        num_microbatches: microbatches per step.
        num_chunks: model chunks per rank (``v``; 1 unless interleaved).
        stages: ``stages[rank][chunk]`` is the pipeline stage of that chunk; stages run ``0 .. num_stages - 1``.
        actions: ``actions[rank]`` is the rank's action list.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    num_chunks: int
    stages: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if len(self.stages) != self.num_ranks or len(self.actions) != self.num_ranks:
            raise ValueError(
                f"Schedule {self.name!r}: stages and actions need one entry per rank (num_ranks={self.num_ranks}), "
                f"got {len(self.stages)} and {len(self.actions)}"
            )
        flat = sorted(s for per_rank in self.stages for s in per_rank)
        if any(len(per_rank) != self.num_chunks for per_rank in self.stages) or flat != list(range(self.num_stages)):
            raise ValueError(
                f"Schedule {self.name!r}: stages={self.stages} must give each rank num_chunks={self.num_chunks} "
                f"distinct stages covering 0..{self.num_stages - 1}"
            )

    @property
    def num_stages(self) -> int:
        """Pipeline stages (``num_ranks * num_chunks``)."""
        return self.num_ranks * self.num_chunks

    def stage_of(self, rank: int, chunk: int) -> int:
        """The stage that chunk ``chunk`` of ``rank`` runs."""
        return self.stages[rank][chunk]

    def location_of(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that runs ``stage``."""
        for rank, per_rank in enumerate(self.stages):
            if stage in per_rank:
                return rank, per_rank.index(stage)
        raise ValueError(f"stage {stage} is not in schedule {self.name!r} (stages 0..{self.num_stages - 1})")

    def compute_actions(self, rank: int) -> list[Action]:
        """The rank's compute actions, in order, without the communication."""
        return [action for action in self.actions[rank] if action.is_compute]

    def batches(self, rank: int) -> list[Action | tuple[Action, ...]]:
        """The rank's actions with each run of consecutive communication actions grouped into one tuple."""
        grouped: list[Action | tuple[Action, ...]] = []
        run: list[Action] = []
        for action in self.actions[rank]:
            if action.is_comm:
                run.append(action)
                continue
            if run:
                grouped.append(tuple(run))
                run = []
            grouped.append(action)
        if run:
            grouped.append(tuple(run))
        return grouped

    def describe(self) -> str:
        """One line per rank listing its actions (communication batches in brackets)."""
        lines = [f"{self.name}: p={self.num_ranks} m={self.num_microbatches} v={self.num_chunks}"]
        for rank in range(self.num_ranks):
            items = [
                "[" + " ".join(str(a) for a in item) + "]" if isinstance(item, tuple) else str(item)
                for item in self.batches(rank)
            ]
            lines.append(f"  rank {rank}: " + " ".join(items))
        return "\n".join(lines)
