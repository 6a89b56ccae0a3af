"""Under COLO_DEBUG_CHECKS=1 a collective whose ranks disagree on sizes raises on every rank, naming the op, the group
and each rank's shape, instead of aborting rank 0 inside gloo (SIGABRT, no message); calls that agree run unchanged
and the exchange is not counted by the CommTracker."""

from __future__ import annotations

import torch
import torch.distributed as dist

from colo.comm import CommError, CommTracker, Mesh, all_gather, all_reduce, all_to_all
from colo.comm.debug import debug_checks, debug_checks_enabled, disagreement, fingerprint
from colo.comm.testing import run_distributed


def _error_of(call) -> str | None:
    try:
        call()
    except CommError as error:
        return str(error)
    return None


def _mismatched_collectives():
    mesh = Mesh(tp=2)
    group, rank = mesh.group("tp"), dist.get_rank()
    with debug_checks_enabled():
        errors = {
            "all_reduce": _error_of(lambda: all_reduce(torch.ones(8 if rank == 0 else 4), group=group)),
            "all_gather": _error_of(lambda: all_gather(torch.ones(2, 3 if rank == 0 else 5), group=group)),
            "all_to_all": _error_of(  # rank 0 sends rank 1 two rows, rank 1 expects three
                lambda: all_to_all(
                    torch.ones(4, 2),
                    group=group,
                    input_split_sizes=[2, 2] if rank == 0 else [1, 3],
                    output_split_sizes=[2, 2] if rank == 0 else [3, 1],
                )
            ),
        }
        with CommTracker() as tracker:  # calls that agree: the result as ever, the exchange not counted
            summed = all_reduce(torch.full((4,), float(rank)), group=group)
    return errors, summed.tolist(), tracker.calls(), tracker.bytes()


def test_a_size_mismatch_raises_on_every_rank_naming_op_group_and_each_shape():
    for errors, summed, calls, volume in run_distributed(_mismatched_collectives, world_size=2):
        assert errors["all_reduce"] is not None, "the mismatched all_reduce must raise under COLO_DEBUG_CHECKS"
        assert "all_reduce on group 'tp' (ranks [0, 1])" in errors["all_reduce"]
        assert "rank 0: all_reduce of (8,) torch.float32" in errors["all_reduce"]
        assert "rank 1: all_reduce of (4,) torch.float32" in errors["all_reduce"]
        assert "rank 0: all_gather of (2, 3)" in errors["all_gather"]
        assert "rank 1: all_gather of (2, 5)" in errors["all_gather"]
        assert "rank 0 sends 2 rows to rank 1, which expects 3" in errors["all_to_all"]
        assert summed == [1.0] * 4
        assert calls == 1 and volume == 2 * 1 / 2 * 4 * 4  # the all_reduce alone: ring 2 (n-1)/n * 16 bytes


def test_the_setting_and_the_fingerprint():
    with debug_checks_enabled():
        assert debug_checks()
    with debug_checks_enabled(False):
        assert not debug_checks()
    ids = torch.arange(64).reshape(4, 16)
    assert fingerprint(ids) == fingerprint(ids.clone()) and fingerprint(ids) != fingerprint(ids.flip(1))
    changed = ids.clone()
    changed[3, 15] += 1
    assert fingerprint(changed) != fingerprint(ids)
    assert fingerprint(torch.tensor([0.5, -0.0])) != fingerprint(torch.tensor([0.5, 0.0]))  # bits, not values
    assert torch.equal(ids, torch.arange(64).reshape(4, 16))  # left as it was


class _FourRanks:
    ranks = (0, 1, 2, 3)


def test_disagreement_names_the_ranks_of_each_value():
    assert disagreement([7, 7, 7, 7], _FourRanks()) is None
    assert disagreement([7, 8, 7, 8], _FourRanks()) == "ranks [0, 2] hold one value, ranks [1, 3] hold another"
    assert disagreement([7, 7, 7, 9], _FourRanks()) == "ranks [0, 1, 2] hold one value, rank 3 holds another"
