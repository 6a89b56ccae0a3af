"""ZeRO-1 reduce-scatters each chunk during the backward that syncs, as soon as all the chunk's gradients are in,
and still matches a single process: with accumulation under ``no_sync``, with several backward passes without it
(each reduction superseding the last), with gradients replaced or dropped after backward, and whichever form the
reduce-scatter takes (gloo's own and the all-to-all form, which only read the persistent gradient buffer, or the
all-reduce form, which sums in the buffer itself).

Tolerances (fp32): rtol = atol = 1e-5 against a single process, for the reduction-order reasons given in
test_zero_stages.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from colo.comm import CommTracker, Mesh, force_algorithm
from colo.comm.testing import load_beside, run_distributed
from colo.zero import ZeroOptimizer

_models = load_beside(__file__, "_models.py", module_name="colo_zero_test_models")
ROWS_PER_RANK = 4
FP32 = {"rtol": 1e-5, "atol": 1e-5}
# the reduce-scatter forms: read the buffer / sum in it / read it / sum in its own part
ALGORITHMS = ["native", "all_reduce", "all_to_all", "p2p"]


def _stage1(model, mesh):
    optimizer = torch.optim.AdamW(_models.param_groups(model), lr=1e-2)
    return ZeroOptimizer(model, optimizer, mesh=mesh, stage=1, chunk_numel=48)


def _local(tensors, mesh):
    rank = mesh.rank("dp")
    return [t[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for t in tensors]


# --- when the reduce-scatters are issued ---------------------------------------------------------------------------


def _reduce_scatters_per_phase(algorithm, through_zero_backward):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = _models.make_models(frozen=False)
    tracker = CommTracker()
    issued_before_last_gradient = []
    # the embedding (tied to lm_head) is the first module of forward, so its gradient is the last one backward
    # accumulates; registered before ZeroOptimizer's hooks, this runs before ZeRO sees that gradient
    model.embed.weight.register_post_accumulate_grad_hook(
        lambda _: issued_before_last_gradient.append(tracker.calls("reduce_scatter"))
    )
    zero = _stage1(model, mesh)
    loss = model(*_local(_models.batch(0, rows=mesh.size("dp") * ROWS_PER_RANK), mesh))
    with force_algorithm("reduce_scatter", algorithm), tracker:
        zero.backward(loss) if through_zero_backward else loss.backward()
        in_backward = tracker.calls("reduce_scatter")
        zero.step()
        zero.zero_grad()
    return issued_before_last_gradient, in_backward, tracker.calls("reduce_scatter"), len(zero.trainable_chunks)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stage1_reduce_scatters_each_chunk_during_backward(algorithm):
    for before_last, in_backward, total, num_chunks in run_distributed(
        _reduce_scatters_per_phase, algorithm, True, world_size=2
    ):
        assert num_chunks > 2
        assert before_last == [num_chunks - 1]  # every chunk but the embedding's, while backward still runs
        assert in_backward == total == num_chunks  # one per chunk per step (DDP's volume), none left for the step


def test_stage1_reduces_a_bare_loss_backward_at_the_step():
    # a bare loss.backward() (a pipeline's backward) may be followed by gradient writes outside autograd: the
    # reduction waits for the step (or reduce_gradients)
    for before_last, in_backward, total, num_chunks in run_distributed(
        _reduce_scatters_per_phase, "native", False, world_size=2
    ):
        assert before_last == [0] and in_backward == 0
        assert total == num_chunks


# --- accumulation ----------------------------------------------------------------------------------------------------


def _accumulation_against_reference(algorithm, use_no_sync, num_microsteps=4, num_steps=3):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, reference = _models.make_models()
    zero = _stage1(model, mesh)
    reference_optimizer = torch.optim.AdamW(_models.param_groups(reference), lr=1e-2)
    names = [name for name, p in reference.named_parameters() if p.requires_grad]
    calls = []
    with force_algorithm("reduce_scatter", algorithm):
        for step in range(num_steps):
            tokens, targets = _models.batch(step, rows=mesh.size("dp") * ROWS_PER_RANK)
            reference(tokens, targets).backward()
            micro = list(zip(*(t.chunk(num_microsteps) for t in _local((tokens, targets), mesh))))
            with CommTracker() as tracker:
                for index, (micro_tokens, micro_targets) in enumerate(micro):
                    last = index == len(micro) - 1
                    with contextlib.nullcontext() if last or not use_no_sync else zero.no_sync():
                        zero.backward(model(micro_tokens, micro_targets) / num_microsteps)
                grads = zero.full_grads()
            calls.append(tracker.calls("reduce_scatter"))
            reference_params = dict(reference.named_parameters())
            for name in names:
                torch.testing.assert_close(grads[name], reference_params[name].grad, **FP32, msg=f"grad {name} {step}")
            zero.step()
            zero.zero_grad()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            params = zero.full_params()
            for name in names:
                torch.testing.assert_close(params[name], reference_params[name].detach(), **FP32, msg=f"{name} {step}")
    return calls, len(zero.trainable_chunks)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_no_sync_then_one_reducing_backward_equals_the_big_batch(algorithm):
    for calls, num_chunks in run_distributed(_accumulation_against_reference, algorithm, True, world_size=2):
        assert calls == [num_chunks] * 3  # only the last micro-step's backward reduces


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_backward_passes_without_no_sync_each_reduce_and_the_last_one_wins(algorithm):
    # with the all-reduce form the first three reductions leave the rank sum in the buffer, which the next backward
    # must not add its gradient to as it is
    for calls, num_chunks in run_distributed(_accumulation_against_reference, algorithm, False, world_size=2):
        assert calls == [4 * num_chunks] * 3  # every backward reduces again; the shard keeps the last reduction


# --- gradients changed after backward --------------------------------------------------------------------------------


def _gradients_changed_after_backward(algorithm):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, reference = _models.make_models()
    zero = _stage1(model, mesh)
    tokens, targets = _models.batch(0, rows=mesh.size("dp") * ROWS_PER_RANK)
    reference(tokens, targets).backward()
    with force_algorithm("reduce_scatter", algorithm):
        zero.backward(model(*_local((tokens, targets), mesh)))
        model.up.weight.grad = torch.ones_like(model.up.weight)  # replaced on every rank: the mean is ones
        model.norm.bias.grad = None  # dropped: no gradient; its chunk's other parameters keep theirs
        grads = zero.full_grads()
        zero.step()
        zero.zero_grad()
        zero.backward(model(*_local((tokens, targets), mesh)))
        model.down.weight.grad.mul_(2.0)  # in place, under the reduction backward started
        try:
            zero.step()
            error = None
        except RuntimeError as raised:
            error = str(raised)
        zero.zero_grad()  # lets every reduction still in flight land
    assert torch.equal(grads["up.weight"], torch.ones_like(model.up.weight))
    assert torch.equal(grads["norm.bias"], torch.zeros_like(model.norm.bias))
    for name, p in reference.named_parameters():
        if p.requires_grad and name not in ("up.weight", "norm.bias"):
            torch.testing.assert_close(grads[name], p.grad, **FP32, msg=name)
    return error


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gradients_replaced_after_backward_are_reduced_and_changed_in_place_ones_are_an_error(algorithm):
    for error in run_distributed(_gradients_changed_after_backward, algorithm, world_size=2):
        assert error is not None and "changed in place after backward had started reducing them" in error
        assert "down.weight" in error
