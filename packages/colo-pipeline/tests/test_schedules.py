"""Every generator builds valid schedules; the validator rejects broken ones with a message naming the problem."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colo.pipeline import (
    BW,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    peak_live_activations,
    validate,
    with_communication,
    zero_bubble_h1,
)


@st.composite
def _cases(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1"]))
    p = draw(st.integers(1, 8))
    if name == "interleaved_1f1b":
        return name, p, p * draw(st.integers(1, 4)), draw(st.integers(1, 4))
    low = 1 if name == "gpipe" else p
    return name, p, draw(st.integers(low, 4 * p + 3)), 1


def _build(name, p, m, v):
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "zero_bubble_h1":
        return zero_bubble_h1(p, m)
    return interleaved_1f1b(p, m, num_chunks=v)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(_cases())
def test_every_generator_builds_valid_schedules(case):
    name, p, m, v = case
    schedule = _build(name, p, m, v)
    report = validate(schedule)
    assert schedule.num_stages == p * v
    for rank in range(p):
        compute = schedule.compute_actions(rank)
        assert sum(a.op == "F" for a in compute) == m * v
    # peak live activations: what each schedule is known for
    if name == "gpipe":
        assert report.peak_live_activations == (m,) * p
    if name == "1f1b":
        assert report.peak_live_activations == tuple(p - r for r in range(p))
    if name == "zero_bubble_h1":
        assert max(report.peak_live_activations) == p  # 1F1B's peak (its first rank's)


def test_one_f_one_b_warmup_and_steady_state():
    schedule = one_f_one_b(4, 8)
    assert [str(a) for a in schedule.compute_actions(0)[:6]] == ["F0", "F1", "F2", "F3", "BW0", "F4"]
    assert [str(a) for a in schedule.compute_actions(3)[:4]] == ["F0", "BW0", "F1", "BW1"]
    # the steady state's "send forward, receive backward" pair is one batch
    assert (Action("SEND_F", 3), Action("RECV_B", 0)) in schedule.batches(0)


def test_zero_bubble_defers_weights_on_later_ranks():
    schedule = zero_bubble_h1(4, 8)
    last = [str(a) for a in schedule.compute_actions(3)]
    assert last[:8] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]  # W0 waits until B3
    assert last[8] == "W0" and last[-4:] == ["W4", "W5", "W6", "W7"]


def test_interleaved_assigns_looping_stages():
    schedule = interleaved_1f1b(4, 8, num_chunks=2)
    assert schedule.stages == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert schedule.location_of(5) == (1, 1)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: one_f_one_b(4, 3), "num_microbatches=3 is smaller than the pipeline size num_ranks=4"),
        (lambda: zero_bubble_h1(4, 2), "use num_microbatches >= 4"),
        (lambda: interleaved_1f1b(4, 6), "num_microbatches=6 is not a multiple of num_ranks=4"),
        (lambda: interleaved_1f1b(2, 4, num_chunks=0), "num_chunks=0 must be a positive int"),
        (lambda: gpipe(0, 4), "num_ranks=0 must be a positive int"),
    ],
)
def test_generators_reject_bad_sizes_with_the_fix(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


def _two_rank(actions0, actions1, m=1):
    return Schedule("hand", 2, m, 1, ((0,), (1,)), (tuple(actions0), tuple(actions1)))


def test_validator_rejects_a_missing_backward():
    broken = _two_rank([F(0), Action("SEND_F", 0), Action("RECV_B", 0)], [Action("RECV_F", 0), F(0), BW(0)])
    with pytest.raises(ScheduleError, match="rank 0: microbatch 0 chunk 0 has no full backward"):
        validate(broken)


def test_validator_rejects_w_before_b_and_unmatched_sends():
    with pytest.raises(ScheduleError, match="W runs before B"):
        validate(Schedule("hand", 1, 1, 1, ((0,),), ((F(0), W(0), B(0)),)))
    unmatched = _two_rank(
        [F(0), Action("SEND_F", 0), Action("RECV_B", 0), BW(0)],
        [Action("RECV_F", 0), F(0), BW(0)],  # never sends the gradient back
    )
    with pytest.raises(ScheduleError, match="missing SEND_B"):
        validate(unmatched)


def test_validator_finds_a_deadlock_under_blocking_p2p():
    send_f, recv_f = (lambda mb: Action("SEND_F", mb)), (lambda mb: Action("RECV_F", mb))
    send_b, recv_b = (lambda mb: Action("SEND_B", mb)), (lambda mb: Action("RECV_B", mb))
    rank1 = [recv_f(0), F(0), recv_f(1), F(1), BW(0), send_b(0), BW(1), send_b(1)]
    # rank 0 sends microbatch 1 before waiting for the first gradient: fine
    fine = [F(0), send_f(0), F(1), send_f(1), recv_b(0), BW(0), recv_b(1), BW(1)]
    validate(_two_rank(fine, rank1, 2))
    # rank 0 waits for the first gradient before sending microbatch 1, which rank 1 needs to produce it
    stuck = [F(0), send_f(0), F(1), recv_b(0), BW(0), send_f(1), recv_b(1), BW(1)]
    with pytest.raises(ScheduleError, match=r"deadlock under blocking p2p: rank 0 waits in \[RECV_B0\]"):
        validate(_two_rank(stuck, rank1, 2))


def test_validator_rejects_messages_out_of_order():
    rank0 = [F(0), F(1), Action("SEND_F", 1), Action("SEND_F", 0), Action("RECV_B", 0), Action("RECV_B", 1)]
    rank0 += [BW(0), BW(1)]
    rank1 = [Action("RECV_F", 0), Action("RECV_F", 1), F(0), F(1), BW(0), BW(1), Action("SEND_B", 0)]
    rank1 += [Action("SEND_B", 1)]
    with pytest.raises(ScheduleError, match="must be posted in the same order"):
        validate(_two_rank(rank0, rank1, 2))


def test_a_new_schedule_is_a_new_compute_order():
    """A hand-written compute order (all forwards, then backwards in reverse) gets its communication inserted."""
    p, m = 3, 4
    compute = [[F(mb) for mb in range(m)] + [BW(mb) for mb in reversed(range(m))] for _ in range(p)]
    schedule = with_communication("reverse-gpipe", num_microbatches=m, stages=((0,), (1,), (2,)), compute=compute)
    assert validate(schedule).peak_live_activations == (m, m, m)
    assert peak_live_activations(schedule) == (m, m, m)
