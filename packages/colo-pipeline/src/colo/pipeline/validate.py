"""`validate`: check that a `Schedule` computes every gradient once, communicates consistently and cannot deadlock.

The checks, in order:

1. every (microbatch, chunk) of every rank has one ``F`` and either one ``BW`` or one ``B`` and one ``W``,
   ordered ``F`` < ``B`` < ``W``;
2. every input comes from somewhere: a ``RECV_F`` / ``RECV_B`` before the action that needs it when the
   neighbouring stage lives on another rank, the neighbour's action earlier on the same rank otherwise; every
   ``SEND_F`` / ``SEND_B`` follows the action that produced what it sends;
3. every send is matched by a receive, in order: the k-th message from rank a to rank b is the one b expects
   k-th (p2p messages between two ranks match in posting order);
4. no deadlock under blocking p2p: consecutive communication actions form a batch that completes only when
   every message in it has its counterpart posted (the strictest transport; a schedule that passes also runs
   where sends are buffered);
5. it reports the peak of live activations per rank: microbatches whose ``F`` ran and whose ``W`` (or
   ``BW``) has not.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .actions import Action, Schedule


class ScheduleError(ValueError):
    """A schedule breaks one of `validate`'s rules; the message lists the problems found."""


@dataclass(frozen=True)
class ScheduleReport:
    """What `validate` found about a valid schedule.

    Attributes:
        peak_live_activations: per rank, the most microbatch-chunks alive at once (``F`` done, ``W`` not yet).
        num_batches: per rank, the number of communication batches.
    """

    peak_live_activations: tuple[int, ...]
    num_batches: tuple[int, ...]


def _fail(schedule: Schedule, problems: list[str]) -> None:
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise ScheduleError(f"schedule {schedule.name!r} is invalid:\n  {shown}{more}")


def _check_compute(schedule: Schedule) -> list[str]:
    problems = []
    m, v = schedule.num_microbatches, schedule.num_chunks
    for rank in range(schedule.num_ranks):
        seen: dict[tuple[int, int], dict[str, int]] = defaultdict(dict)
        for index, action in enumerate(schedule.actions[rank]):
            if action.microbatch >= m or action.chunk >= v:
                problems.append(f"rank {rank}: {action} is outside num_microbatches={m}, num_chunks={v}")
                continue
            if action.is_compute:
                ops = seen[(action.microbatch, action.chunk)]
                if action.op in ops:
                    problems.append(f"rank {rank}: {action} appears twice")
                ops[action.op] = index
        for mb in range(m):
            for chunk in range(v):
                ops = seen.get((mb, chunk), {})
                where = f"rank {rank}: microbatch {mb} chunk {chunk}"
                if "F" not in ops:
                    problems.append(f"{where} has no F")
                    continue
                if "BW" in ops and ("B" in ops or "W" in ops):
                    problems.append(f"{where} has BW and also B or W; use either BW or the B/W pair")
                elif "BW" not in ops and not ("B" in ops and "W" in ops):
                    problems.append(f"{where} has no full backward: add BW, or both B and W")
                if ops.get("BW", ops.get("B", 1 << 30)) < ops["F"]:
                    problems.append(f"{where}: its backward runs before its F")
                if "W" in ops and "B" in ops and ops["W"] < ops["B"]:
                    problems.append(f"{where}: W runs before B")
    return problems


def _check_dependencies(schedule: Schedule) -> list[str]:
    problems = []
    last = schedule.num_stages - 1
    for rank in range(schedule.num_ranks):
        done: set[tuple[str, int, int]] = set()
        for action in schedule.actions[rank]:
            mb, chunk = action.microbatch, action.chunk
            if chunk >= schedule.num_chunks:
                continue
            stage = schedule.stage_of(rank, chunk)
            prev_remote = stage > 0 and schedule.location_of(stage - 1)[0] != rank
            next_remote = stage < last and schedule.location_of(stage + 1)[0] != rank
            backward_done = ("B", mb, stage) in done or ("BW", mb, stage) in done
            if action.op == "F" and stage > 0:
                needed = ("RECV_F", mb, stage) if prev_remote else ("F", mb, stage - 1)
                if needed not in done:
                    problems.append(f"rank {rank}: {action} (stage {stage}) runs before its input ({needed[0]})")
            elif action.op in ("B", "BW") and stage < last:
                if next_remote:
                    ready = ("RECV_B", mb, stage) in done
                else:
                    ready = ("B", mb, stage + 1) in done or ("BW", mb, stage + 1) in done
                if not ready:
                    problems.append(f"rank {rank}: {action} (stage {stage}) runs before its output's gradient")
            elif action.op in ("SEND_F", "RECV_B") and not next_remote:
                problems.append(f"rank {rank}: {action}: stage {stage} has no next stage on another rank")
            elif action.op in ("RECV_F", "SEND_B") and not prev_remote:
                problems.append(f"rank {rank}: {action}: stage {stage} has no previous stage on another rank")
            elif action.op == "SEND_F" and ("F", mb, stage) not in done:
                problems.append(f"rank {rank}: {action} sends before its F ran")
            elif action.op == "SEND_B" and not backward_done:
                problems.append(f"rank {rank}: {action} sends before its B ran")
            key = (action.op, mb, stage)
            if action.is_comm and key in done:
                problems.append(f"rank {rank}: {action} appears twice")
            done.add(key)
        for chunk in range(schedule.num_chunks):
            stage = schedule.stage_of(rank, chunk)
            for mb in range(schedule.num_microbatches):
                if stage < last and schedule.location_of(stage + 1)[0] != rank:
                    for op in ("SEND_F", "RECV_B"):
                        if (op, mb, stage) not in done:
                            problems.append(f"rank {rank}: missing {op} of microbatch {mb} chunk {chunk}")
                if stage > 0 and schedule.location_of(stage - 1)[0] != rank:
                    for op in ("RECV_F", "SEND_B"):
                        if (op, mb, stage) not in done:
                            problems.append(f"rank {rank}: missing {op} of microbatch {mb} chunk {chunk}")
    return problems


def message_of(schedule: Schedule, rank: int, action: Action) -> tuple[int, int, tuple[str, int, int]]:
    """``(src_rank, dst_rank, message)`` of a communication action; both ends name the same ``message``.

    ``message`` is ``("act", microbatch, receiving stage)`` or ``("grad", microbatch, receiving stage)``.
    """
    stage = schedule.stage_of(rank, action.chunk)
    if action.op == "SEND_F":
        return rank, schedule.location_of(stage + 1)[0], ("act", action.microbatch, stage + 1)
    if action.op == "RECV_F":
        return schedule.location_of(stage - 1)[0], rank, ("act", action.microbatch, stage)
    if action.op == "SEND_B":
        return rank, schedule.location_of(stage - 1)[0], ("grad", action.microbatch, stage - 1)
    if action.op == "RECV_B":
        return schedule.location_of(stage + 1)[0], rank, ("grad", action.microbatch, stage)
    raise ValueError(f"{action} is not a communication action")


def match_messages(schedule: Schedule) -> tuple[dict[tuple[int, int], tuple[int, int]], list[str]]:
    """Pair every send with the receive it meets (k-th send a->b with k-th receive at b from a).

    Returns:
        ``(counterpart, problems)``: ``counterpart[(rank, index)] = (peer, peer_index)`` over action indices,
        and the mismatches found.
    """
    sends: dict[tuple[int, int], list[tuple[int, tuple]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, tuple]]] = defaultdict(list)
    for rank in range(schedule.num_ranks):
        for index, action in enumerate(schedule.actions[rank]):
            if action.is_comm:
                src, dst, message = message_of(schedule, rank, action)
                (sends if action.op.startswith("SEND") else recvs)[(src, dst)].append((index, message))
    counterpart, problems = {}, []
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        outgoing, incoming = sends.get(pair, []), recvs.get(pair, [])
        for k, (sent, received) in enumerate(zip(outgoing, incoming)):
            if sent[1] != received[1]:
                problems.append(
                    f"message {k} from rank {src} to rank {dst} is {sent[1]} but rank {dst} expects {received[1]}: "
                    f"sends and receives between two ranks must be posted in the same order"
                )
            counterpart[(src, sent[0])] = (dst, received[0])
            counterpart[(dst, received[0])] = (src, sent[0])
        if len(outgoing) != len(incoming):
            problems.append(
                f"rank {src} sends {len(outgoing)} messages to rank {dst}, which receives {len(incoming)}: "
                f"every send needs a matching receive"
            )
    return counterpart, problems


def _check_deadlock(schedule: Schedule, counterpart: dict[tuple[int, int], tuple[int, int]]) -> list[str]:
    """Run the schedule's communication under blocking batches; report where every rank is stuck, if it sticks."""
    # batch_of[rank][action index] = index of the item (compute action or batch) it belongs to
    items: list[list[list[int]]] = []
    batch_of: list[dict[int, int]] = []
    for rank in range(schedule.num_ranks):
        rank_items: list[list[int]] = []
        lookup: dict[int, int] = {}
        for index, action in enumerate(schedule.actions[rank]):
            if action.is_comm and rank_items and schedule.actions[rank][rank_items[-1][0]].is_comm:
                rank_items[-1].append(index)
            else:
                rank_items.append([index])
            lookup[index] = len(rank_items) - 1
        items.append(rank_items)
        batch_of.append(lookup)
    position = [0] * schedule.num_ranks
    progress = True
    while progress:
        progress = False
        for rank in range(schedule.num_ranks):
            while position[rank] < len(items[rank]):
                item = items[rank][position[rank]]
                ready = True
                for index in item:
                    if schedule.actions[rank][index].is_comm:
                        peer, peer_index = counterpart[(rank, index)]
                        if position[peer] < batch_of[peer][peer_index]:
                            ready = False
                            break
                if not ready:
                    break
                position[rank] += 1
                progress = True
    stuck = []
    for rank in range(schedule.num_ranks):
        if position[rank] < len(items[rank]):
            waiting = " ".join(str(schedule.actions[rank][i]) for i in items[rank][position[rank]])
            stuck.append(f"rank {rank} waits in [{waiting}]")
    if stuck:
        return ["deadlock under blocking p2p: " + "; ".join(stuck)]
    return []


def peak_live_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (microbatch, chunk) pairs whose ``F`` ran and whose ``W`` / ``BW`` has not."""
    peaks = []
    for rank in range(schedule.num_ranks):
        live = peak = 0
        for action in schedule.actions[rank]:
            if action.op == "F":
                live += 1
                peak = max(peak, live)
            elif action.op in ("W", "BW"):
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def validate(schedule: Schedule) -> ScheduleReport:
    """Check ``schedule`` (see the module docstring for the rules) and report its peak live activations.

    Raises:
        ScheduleError: the schedule breaks a rule; the message names each problem by rank and action.
    """
    _fail(schedule, _check_compute(schedule))
    _fail(schedule, _check_dependencies(schedule))
    counterpart, problems = match_messages(schedule)
    _fail(schedule, problems)
    _fail(schedule, _check_deadlock(schedule, counterpart))
    batches = tuple(
        sum(isinstance(item, tuple) for item in schedule.batches(rank)) for rank in range(schedule.num_ranks)
    )
    return ScheduleReport(peak_live_activations=peak_live_activations(schedule), num_batches=batches)
