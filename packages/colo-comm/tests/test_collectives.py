"""Every collective equals the same computation done locally on the gathered inputs, on 2 and 4 ranks.

Inputs are integer-valued so sums are exact in every dtype and reduction order (bf16 and fp16 included).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    force_algorithm,
    reduce_scatter,
    world_group,
)
from colo.comm.testing import run_distributed

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The input rank ``rank`` contributes: small integers, exact in every dtype under any summation order."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-8, 9, shape, generator=generator).to(dtype)


def _all_inputs(world: int, shape, dtype) -> list[torch.Tensor]:
    return [_rank_input(r, shape, dtype) for r in range(world)]


def _reduce_local(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([t.float() for t in inputs])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / len(inputs)
    if op == "max":
        return stacked.max(0).values
    return stacked.min(0).values


def _all_reduce(shape, dtype, op, async_op):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = _rank_input(rank, shape, dtype)
    result = all_reduce(tensor, op, async_op=async_op)
    if async_op:
        result = result.wait()
    assert result is tensor, "all_reduce works in place and returns its tensor"
    expected = _reduce_local(_all_inputs(world, shape, dtype), op).to(dtype)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_all_reduce_equals_local_reduction(world_size, dtype, op):
    # avg divides by 2 or 4: exact in every dtype for these small integers
    run_distributed(_all_reduce, (5, 3), dtype, op, op == "max", world_size=world_size)


def _broadcast(src, dtype):
    rank = dist.get_rank()
    tensor = _rank_input(rank, (7,), dtype)
    handle = broadcast(tensor, src=src, async_op=True)
    torch.testing.assert_close(handle.wait(), _rank_input(src, (7,), dtype), rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_broadcast_from_every_source(world_size):
    for src in range(world_size):
        run_distributed(_broadcast, src, torch.bfloat16, world_size=world_size)


def _all_gather(shape, dim, dtype, uneven, algorithm):
    with force_algorithm("all_gather", algorithm):
        _all_gather_checked(shape, dim, dtype, uneven)


def _all_gather_checked(shape, dim, dtype, uneven):
    rank, world = dist.get_rank(), dist.get_world_size()
    if uneven:
        sizes = [(r % 3) + 1 for r in range(world)]
        shape = list(shape)
        shape[dim] = sizes[rank]
        inputs = []
        for r in range(world):
            piece_shape = list(shape)
            piece_shape[dim] = sizes[r]
            inputs.append(_rank_input(r, tuple(piece_shape), dtype))
        result = all_gather(inputs[rank], dim=dim, sizes=sizes)
    else:
        inputs = _all_inputs(world, shape, dtype)
        result = all_gather(inputs[rank], dim=dim, async_op=True).wait()
    torch.testing.assert_close(result, torch.cat(inputs, dim=dim), rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("algorithm", ["native", "all_reduce", "p2p"])
def test_all_gather_concatenates_in_rank_order(world_size, dim, uneven, algorithm):
    run_distributed(_all_gather, (2, 3, 4), dim, torch.float16, uneven, algorithm, world_size=world_size)


def _reduce_scatter(algorithm, dim, op, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = [3, 3, 3]
    shape[dim] = 2 * world
    inputs = _all_inputs(world, tuple(shape), dtype)
    with force_algorithm("reduce_scatter", algorithm):
        result = reduce_scatter(inputs[rank], op, dim=dim)
    expected = _reduce_local(inputs, op).to(dtype).chunk(world, dim=dim)[rank]
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert result.shape == expected.shape


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("algorithm", ["native", "all_reduce", "all_to_all", "p2p"])
@pytest.mark.parametrize("dim", [0, 2])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_reduce_scatter_equals_local_reduction_then_chunk(world_size, algorithm, dim, op):
    run_distributed(_reduce_scatter, algorithm, dim, op, torch.bfloat16, world_size=world_size)


def _all_to_all(uneven, pass_output_splits):
    rank, world = dist.get_rank(), dist.get_world_size()
    # splits[src][dst]: rows rank src sends to rank dst
    splits = [
        [(src + 2 * dst) % 3 + (0 if uneven else 2 - (src + 2 * dst) % 3) for dst in range(world)]
        for src in range(world)
    ]
    inputs = [_rank_input(src, (sum(splits[src]), 2), torch.float32) for src in range(world)]
    kwargs = {}
    if uneven:
        kwargs["input_split_sizes"] = splits[rank]
        if pass_output_splits:
            kwargs["output_split_sizes"] = [splits[src][rank] for src in range(world)]
    result = all_to_all(inputs[rank], **kwargs)
    expected = torch.cat([inputs[src].split(splits[src])[rank] for src in range(world)])
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "uneven, pass_output_splits", [(False, False), (True, False), (True, True)], ids=["even", "uneven", "uneven-given"]
)
def test_all_to_all_routes_slice_i_to_rank_i(world_size, uneven, pass_output_splits):
    run_distributed(_all_to_all, uneven, pass_output_splits, world_size=world_size)


def _async_overlap():
    """Several async collectives in flight at once complete correctly, in any wait order."""
    world = dist.get_world_size()
    a = torch.ones(1000)
    b = torch.full((world * 4,), 2.0)
    h1 = all_reduce(a, async_op=True)
    h2 = reduce_scatter(b, async_op=True)
    h3 = all_gather(torch.full((2,), float(dist.get_rank())), async_op=True)
    gathered = h3.wait()
    shard = h2.wait()
    reduced = h1.wait()
    assert h1.is_completed() and h2.is_completed() and h3.is_completed()
    torch.testing.assert_close(reduced, torch.full((1000,), float(world)))
    torch.testing.assert_close(shard, torch.full((4,), 2.0 * world))
    torch.testing.assert_close(gathered, torch.arange(world).float().repeat_interleave(2))
    barrier()


def test_async_handles_overlap():
    run_distributed(_async_overlap, world_size=2)


def _bad_inputs():
    world = dist.get_world_size()
    errors = {}
    cases = {
        "op": lambda: all_reduce(torch.ones(2), "mean"),
        "avg_int": lambda: all_reduce(torch.ones(2, dtype=torch.int64), "avg"),
        "contiguous": lambda: all_reduce(torch.ones(4, 4).t()),
        "not_tensor": lambda: all_reduce([1.0, 2.0]),
        "src": lambda: broadcast(torch.ones(2), src=world),
        "rs_divisible": lambda: reduce_scatter(torch.ones(world + 1)),
        "ag_sizes": lambda: all_gather(torch.ones(2), sizes=[2] * (world + 1)),
        "ag_own_size": lambda: all_gather(torch.ones(2), sizes=[3] * world),
        "a2a_splits": lambda: all_to_all(torch.ones(4), input_split_sizes=[1] * world),
        "group": lambda: all_reduce(torch.ones(2), group="dp"),
        "scalar": lambda: all_gather(torch.tensor(1.0)),
    }
    for name, call in cases.items():
        try:
            call()
        except (ValueError, TypeError) as error:
            errors[name] = str(error)
    # Every rank must still be in step: a failed validation issued no collective.
    torch.testing.assert_close(all_reduce(torch.ones(1)), torch.full((1,), float(world)))
    return errors


def test_bad_input_raises_before_any_collective():
    errors = run_distributed(_bad_inputs, world_size=2)[0]
    assert set(errors) == {
        "op",
        "avg_int",
        "contiguous",
        "not_tensor",
        "src",
        "rs_divisible",
        "ag_sizes",
        "ag_own_size",
        "a2a_splits",
        "group",
        "scalar",
    }
    assert "use one of" in errors["op"]
    assert "use op='sum'" in errors["avg_int"]
    assert "tensor.contiguous()" in errors["contiguous"]
    assert "src=2" in errors["src"] and "[0, 2)" in errors["src"]
    assert "pad it to a multiple of 2" in errors["rs_divisible"]
    assert "Mesh.group" in errors["group"]


def _group_of_world():
    group = world_group()
    return group.name, group.ranks, group.rank, group.size


def test_world_group_describes_every_rank():
    results = run_distributed(_group_of_world, world_size=2)
    assert results == [("world", (0, 1), 0, 2), ("world", (0, 1), 1, 2)]


def _gather_into_out(algorithm):
    rank, n = dist.get_rank(), dist.get_world_size()
    results = {}
    with force_algorithm("all_gather", algorithm):
        out = torch.full((2 * n, 3), -1.0)
        piece = torch.full((2, 3), float(rank))
        returned = all_gather(piece, out=out)
        results["separate"] = (returned is out, out.clone())
        out = torch.full((2 * n, 3), -1.0)
        own = out.narrow(0, 2 * rank, 2)
        own.fill_(float(rank))
        all_gather(own, out=out)  # in place: this rank's piece is its region of out
        results["in_place"] = out.clone()
    return results


@pytest.mark.parametrize("algorithm", ["native", "all_reduce", "p2p"])
def test_all_gather_into_a_given_output_also_in_place(algorithm):
    expected = torch.arange(2).repeat_interleave(2).float()[:, None].expand(4, 3)
    for results in run_distributed(_gather_into_out, algorithm, world_size=2):
        is_out, separate = results["separate"]
        assert is_out
        assert torch.equal(separate, expected)
        assert torch.equal(results["in_place"], expected)


def _donated_reduce_scatter(algorithm):
    rank = dist.get_rank()
    with force_algorithm("reduce_scatter", algorithm):
        bucket = torch.arange(8.0) * (rank + 1)
        part = reduce_scatter(bucket, donate=True)
        shares_memory = part.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
    return part, shares_memory


@pytest.mark.parametrize("algorithm", ["native", "all_reduce", "all_to_all", "p2p"])
def test_a_donated_reduce_scatter_gives_the_same_part_without_a_copy(algorithm):
    for rank, (part, shares_memory) in enumerate(run_distributed(_donated_reduce_scatter, algorithm, world_size=2)):
        assert torch.equal(part, (torch.arange(8.0) * 3)[rank * 4 : (rank + 1) * 4])
        # the all-reduce form reduces in the bucket itself, the p2p form adds the copies it got into its own part
        assert shares_memory == (algorithm in ("all_reduce", "p2p"))


def _reduce_scatter_donating_the_whole(algorithm):
    rank = dist.get_rank()
    with force_algorithm("reduce_scatter", algorithm):
        bucket = torch.arange(8.0) * (rank + 1)
        handle = reduce_scatter(bucket, donate="whole", async_op=True)
        part = handle.wait()
    return part, bucket, handle.input_reduced


@pytest.mark.parametrize("algorithm", ["native", "all_reduce", "all_to_all", "p2p"])
def test_donating_the_whole_tensor_leaves_it_intact_or_says_it_holds_the_sum(algorithm):
    total = torch.arange(8.0) * 3
    for rank, (part, bucket, input_reduced) in enumerate(
        run_distributed(_reduce_scatter_donating_the_whole, algorithm, world_size=2)
    ):
        assert torch.equal(part, total[rank * 4 : (rank + 1) * 4])
        # only the all-reduce form sums in the tensor, all of it; the p2p form would sum its own part only, so it
        # is not given the tensor
        assert input_reduced == (algorithm == "all_reduce")
        assert torch.equal(bucket, total if input_reduced else torch.arange(8.0) * (rank + 1))


def _overlapping_p2p_collectives():
    rank, n = dist.get_rank(), dist.get_world_size()
    with force_algorithm("all_gather", "p2p"), force_algorithm("reduce_scatter", "p2p"):
        pieces = [torch.full((3, 2), 10.0 * k + rank) for k in range(3)]
        bucket = torch.arange(4.0 * n) * (rank + 1)
        handles = [all_gather(pieces[0], async_op=True), reduce_scatter(bucket, async_op=True)]
        handles.append(all_reduce(torch.full((5,), float(rank)), async_op=True))
        handles += [all_gather(piece, async_op=True) for piece in pieces[1:]]
        return [handle.wait() for handle in handles]


@pytest.mark.parametrize("world_size", [2, 4])
def test_p2p_collectives_in_flight_together_match_each_one_alone(world_size):
    # point-to-point messages between a pair are matched in the order they were posted, so several p2p
    # collectives in flight at once (ZeRO-3's prefetch) and a collective between them all land where they belong
    n = world_size
    total = sum(range(1, n + 1))
    for rank, results in enumerate(run_distributed(_overlapping_p2p_collectives, world_size=n)):
        gathered = [results[0], *results[3:]]
        for k, result in enumerate(gathered):
            assert torch.equal(result, torch.cat([torch.full((3, 2), 10.0 * k + r) for r in range(n)]))
        assert torch.equal(results[1], (torch.arange(4.0 * n) * total)[rank * 4 : (rank + 1) * 4])
        assert torch.equal(results[2], torch.full((5,), float(sum(range(n)))))


def _bad_out():
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of shape \(4, 3\)"):
        all_gather(torch.zeros(2, 3), out=torch.zeros(5, 3))
    return all_reduce(torch.ones(1)).item()  # no rank started a collective for the rejected call


def test_a_wrong_output_is_rejected_before_communicating():
    assert run_distributed(_bad_out, world_size=2) == [2.0, 2.0]


def _exchange_forms_reuse_their_receive_buffer(algorithm):
    from colo.comm import scratch

    rank, n = dist.get_rank(), dist.get_world_size()
    scratch.release_scratch()
    results = []
    with force_algorithm("reduce_scatter", algorithm):
        for step in range(3):  # one after the other: the second and third reuse the first one's buffer
            results.append(reduce_scatter(torch.arange(4.0 * n) * (rank + 1) + step))
        held_after_sequential = scratch.held_bytes()
        handles = [reduce_scatter(torch.full((4 * n,), float(k + rank)), async_op=True) for k in range(2)]
        results += [handle.wait() for handle in handles]  # two in flight at once: two buffers
    return results, held_after_sequential, scratch.held_bytes()


@pytest.mark.parametrize("algorithm", ["all_to_all", "p2p"])
def test_exchange_forms_reuse_their_receive_buffer(algorithm):
    n = 2
    scale = sum(range(1, n + 1))
    for rank, (results, held_sequential, held_after) in enumerate(
        run_distributed(_exchange_forms_reuse_their_receive_buffer, algorithm, world_size=n)
    ):
        part = slice(rank * 4, (rank + 1) * 4)
        for step in range(3):
            assert torch.equal(results[step], (torch.arange(4.0 * n) * scale + n * step)[part])
        for k in range(2):
            assert torch.equal(results[3 + k], torch.full((4,), float(n * k + sum(range(n)))))
        received = 4 * n * 4 if algorithm == "all_to_all" else 4 * (n - 1) * 4  # bytes one call receives into
        assert held_sequential == received
        assert held_after == 2 * received


def _user_p2p_around_p2p_collectives():
    from colo.comm import irecv, isend

    rank = dist.get_rank()
    user = torch.full((4, 2), 100.0 + rank)
    piece = torch.full((4, 2), float(rank))
    bucket = torch.arange(16.0) * (rank + 1)
    with force_algorithm("all_gather", "p2p"), force_algorithm("reduce_scatter", "p2p"):
        if rank == 0:  # a user's send (say, a pipeline's activations) goes out before the collectives
            sent = isend(user, dst=1)
            gathered = all_gather(piece)
            part = reduce_scatter(bucket)
            sent.wait()
            received = None
        else:  # and is received after them: same pair, same sizes, opposite order
            gathered = all_gather(piece)
            part = reduce_scatter(bucket)
            received = irecv(torch.empty(4, 2), src=0).wait()
    return gathered, part, received


def test_user_p2p_in_flight_is_not_matched_with_a_p2p_collective():
    results = run_distributed(_user_p2p_around_p2p_collectives, world_size=2)
    (gathered0, part0, _), (gathered1, part1, received) = results
    expected = torch.cat([torch.zeros(4, 2), torch.ones(4, 2)])
    assert torch.equal(gathered0, expected) and torch.equal(gathered1, expected)
    assert torch.equal(part0, (torch.arange(16.0) * 3)[:8]) and torch.equal(part1, (torch.arange(16.0) * 3)[8:])
    assert torch.equal(received, torch.full((4, 2), 100.0))
