"""Placing sends and receives between the compute actions of a schedule (used by the generators).

With blocking p2p a message moves only while both ends have posted it, so a good placement puts the send and
the receive of each message into gaps of the two ranks that are open at the same moment. The moments come
from the ideal timeline of the compute orders (unit F, B and W, BW = 2, free communication).
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import Action, Schedule


def _meeting_gaps(gap, starts, sender: int, produced: int, receiver: int, consumer: int, sender_len: int):
    """``(send_gap, recv_gap)`` for one message: gaps of sender and receiver that overlap in the ideal timeline.

    The receiver gap is the latest one before the consumer that overlaps some sender gap after the producer.
    Without any overlap, the receive goes right before the consumer and the send into the sender's first gap
    at or after the moment the consumer starts.
    """
    for recv_gap in range(consumer, -1, -1):
        r_begin, r_end = gap(receiver, recv_gap)
        if r_end < starts[sender][produced]:
            break
        for send_gap in range(produced + 1, sender_len + 1):
            s_begin, s_end = gap(sender, send_gap)
            if s_begin > r_end:
                break
            if max(s_begin, r_begin) <= min(s_end, r_end):
                return send_gap, recv_gap
    needed = starts[receiver][consumer]
    send_gap = produced + 1
    while send_gap < sender_len and starts[sender][send_gap] < needed:
        send_gap += 1
    return send_gap, consumer


def _ideal_start_times(stages: Sequence[Sequence[int]], compute: Sequence[Sequence[Action]]) -> list[list[float]]:
    """Start time of every compute action with unit F, B, W (BW = 2) and free communication, as soon as possible."""
    location = {stage: (rank, chunk) for rank, per_rank in enumerate(stages) for chunk, stage in enumerate(per_rank)}
    last_stage = len(location) - 1
    duration = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}
    ends: dict[tuple[str, int, int], float] = {}
    starts: list[list[float]] = [[0.0] * len(order) for order in compute]
    position, clock = [0] * len(compute), [0.0] * len(compute)
    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(compute):
            while position[rank] < len(order):
                action = order[position[rank]]
                stage = stages[rank][action.chunk]
                needs = []
                if action.op == "F" and stage > 0:
                    needs.append([("F", action.microbatch, stage - 1)])
                if action.op in ("B", "BW"):
                    needs.append([("F", action.microbatch, stage)])
                    if stage < last_stage:
                        needs.append([("B", action.microbatch, stage + 1), ("BW", action.microbatch, stage + 1)])
                if action.op == "W":
                    needs.append([("B", action.microbatch, stage)])
                ready = [next((ends[k] for k in alternatives if k in ends), None) for alternatives in needs]
                if any(time is None for time in ready):
                    break
                start = max([clock[rank], *ready])
                starts[rank][position[rank]] = start
                clock[rank] = start + duration[action.op]
                ends[(action.op, action.microbatch, stage)] = clock[rank]
                position[rank] += 1
                progress = True
    stuck = [rank for rank, order in enumerate(compute) if position[rank] < len(order)]
    if stuck:
        raise ValueError(
            f"the compute orders wait on each other forever: rank {stuck[0]} cannot run "
            f"{compute[stuck[0]][position[stuck[0]]]} (its input is produced after it on some rank)"
        )
    return starts


def with_communication(
    name: str,
    *,
    num_microbatches: int,
    stages: Sequence[Sequence[int]],
    compute: Sequence[Sequence[Action]],
    comm_points: Sequence[Sequence[int]] | None = None,
) -> Schedule:
    """Build a `Schedule` from per-rank compute orders by inserting the sends and receives.

    A receive goes right before the action that needs it. A send goes into the sender's gap between compute
    actions that is current when the receiver needs the message in the ideal timeline (unit F, B and W, free
    communication): with blocking p2p both sides then post the message at the same moment, and each batch of
    one rank meets the matching batches of its neighbours (1F1B's "send forward, receive backward" pairs).

    Args:
        name: the schedule's name.
        num_microbatches: microbatches per step.
        stages: ``stages[rank][chunk]``, the stage each chunk runs.
        compute: ``compute[rank]``, the rank's ``F`` / ``B`` / ``W`` / ``BW`` actions in order.
        comm_points: optional, per rank, the gaps (index of the compute action they precede; ``len(order)``
            for the end) where communication may happen, for schedules that exchange in lockstep (Megatron's
            interleaved 1F1B): a receive goes to the last point before its consumer, a send to the first point
            after its producer.

    Returns:
        The schedule; check it with `validate`.
    """
    num_ranks = len(stages)
    num_chunks = len(stages[0]) if stages else 0
    location = {stage: (rank, chunk) for rank, per_rank in enumerate(stages) for chunk, stage in enumerate(per_rank)}
    last_stage = num_ranks * num_chunks - 1
    starts = _ideal_start_times(stages, compute)

    def remote(rank: int, chunk: int, step: int) -> tuple[int, int] | None:
        stage = stages[rank][chunk] + step
        if stage < 0 or stage > last_stage or location[stage][0] == rank:
            return None
        return location[stage]

    durations = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}

    def gap(rank: int, index: int) -> tuple[float, float]:
        """Ideal-time interval of the gap before compute action ``index`` of ``rank``."""
        order = compute[rank]
        begin = starts[rank][index - 1] + durations[order[index - 1].op] if index > 0 else 0.0
        end = starts[rank][index] if index < len(order) else float("inf")
        return begin, end

    producer_of: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, order in enumerate(compute):
        for index, action in enumerate(order):
            stage = stages[rank][action.chunk]
            if action.op == "F" and remote(rank, action.chunk, +1):
                producer_of[("act", action.microbatch, stage + 1)] = (rank, index)
            if action.op in ("B", "BW") and remote(rank, action.chunk, -1):
                producer_of[("grad", action.microbatch, stage - 1)] = (rank, index)

    # Each message goes into a sender gap and a receiver gap that overlap in the ideal timeline (so both sides
    # post it at the same moment); the receiver gap is the latest one before the consumer that allows it.
    sends_in: list[dict[int, list[tuple[float, int, Action]]]] = [{} for _ in range(num_ranks)]
    recvs_in: list[dict[int, list[Action]]] = [{} for _ in range(num_ranks)]
    for rank, order in enumerate(compute):
        for index, action in enumerate(order):
            stage = stages[rank][action.chunk]
            if action.op == "F" and remote(rank, action.chunk, -1):
                key, send_op, recv_op = ("act", action.microbatch, stage), "SEND_F", "RECV_F"
            elif action.op in ("B", "BW") and remote(rank, action.chunk, +1):
                key, send_op, recv_op = ("grad", action.microbatch, stage), "SEND_B", "RECV_B"
            else:
                continue
            sender, produced = producer_of[key]
            if comm_points is not None:
                choice = (
                    min(g for g in comm_points[sender] if g > produced),
                    max(g for g in comm_points[rank] if g <= index),
                )
            else:
                choice = _meeting_gaps(gap, starts, sender, produced, rank, index, len(compute[sender]))
            send_gap, recv_gap = choice
            peer_chunk = location[stage - 1 if send_op == "SEND_F" else stage + 1][1]
            sends_in[sender].setdefault(send_gap, []).append(
                (gap(rank, recv_gap)[0], produced, Action(send_op, action.microbatch, peer_chunk))
            )
            recvs_in[rank].setdefault(recv_gap, []).append(Action(recv_op, action.microbatch, action.chunk))

    laid_out: list[list[Action | list[Action]]] = []
    for rank, order in enumerate(compute):
        items: list[Action | list[Action]] = []
        for index in range(len(order) + 1):
            sends = [a for _, _, a in sorted(sends_in[rank].get(index, []), key=lambda e: (e[0], e[1]))]
            batch = sends + recvs_in[rank].get(index, [])
            if batch:
                items.append(batch)
            if index < len(order):
                items.append(order[index])
        laid_out.append(items)

    # Position of every send on its rank, to order each batch's receives like the peer's sends.
    send_position: dict[tuple[str, int, int], int] = {}
    for rank, items in enumerate(laid_out):
        position = 0
        for item in items:
            for action in item if isinstance(item, list) else [item]:
                if action.op in ("SEND_F", "SEND_B"):
                    send_position[(action.op, action.microbatch, stages[rank][action.chunk])] = position
                position += 1

    def recv_key(rank: int, action: Action) -> tuple[int, int]:
        stage = stages[rank][action.chunk]
        if action.op == "RECV_F":
            return location[stage - 1][0], send_position[("SEND_F", action.microbatch, stage - 1)]
        return location[stage + 1][0], send_position[("SEND_B", action.microbatch, stage + 1)]

    actions = []
    for rank, items in enumerate(laid_out):
        flat: list[Action] = []
        for item in items:
            if isinstance(item, list):
                sends = [a for a in item if a.op.startswith("SEND")]
                recvs = sorted((a for a in item if a.op.startswith("RECV")), key=lambda a: recv_key(rank, a))
                flat.extend(sends + recvs)
            else:
                flat.append(item)
        actions.append(tuple(flat))
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        stages=tuple(tuple(s) for s in stages),
        actions=tuple(actions),
    )
