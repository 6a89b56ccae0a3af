"""ZeRO-1/2/3 match a single-process AdamW run step by step: loss, gathered gradients and parameters.

Tolerances: the reference averages the gradient over the whole batch at once, ZeRO sums per-rank averages
across ranks and divides by the rank count, so fp32 results differ in the last bits (reduction order), and
AdamW's normalisation can amplify those bits a little in the parameters; hence rtol/atol of 1e-5, not zero.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from colo.comm import CommTracker, Mesh, force_algorithm
from colo.comm.testing import load_beside, run_distributed
from colo.zero import DynamicLossScaler, MixedPrecision, ZeroOptimizer, estimate_memory

_models = load_beside(__file__, "_models.py", module_name="colo_zero_test_models")
TinyLM, param_groups, make_models, batch, VOCAB = (
    _models.TinyLM,
    _models.param_groups,
    _models.make_models,
    _models.batch,
    _models.VOCAB,
)

ROWS_PER_RANK = 4
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _train_against_reference(stage, *, num_steps=5, num_microsteps=1, max_norm=None, chunk_numel=48, forms=None):
    if forms is not None:  # run under the given collective implementations: {op: algorithm}
        with contextlib.ExitStack() as stack:
            for op, algorithm in forms.items():
                stack.enter_context(force_algorithm(op, algorithm))
            return _train_against_reference(stage, num_steps=num_steps, chunk_numel=chunk_numel)
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    model, reference = make_models()
    zero = ZeroOptimizer(
        model, torch.optim.AdamW(param_groups(model), lr=1e-2), mesh=mesh, stage=stage, chunk_numel=chunk_numel
    )
    reference_optimizer = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    names = [name for name, p in reference.named_parameters() if p.requires_grad]
    losses = []
    for step in range(num_steps):
        tokens, targets = batch(step, rows=n * ROWS_PER_RANK)
        reference_loss = reference(tokens, targets)
        reference_loss.backward()
        mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        local_loss = 0.0
        for micro_tokens, micro_targets in zip(tokens[mine].chunk(num_microsteps), targets[mine].chunk(num_microsteps)):
            loss = model(micro_tokens, micro_targets) / num_microsteps
            zero.backward(loss)
            local_loss += loss.item()
        losses.append(local_loss)
        grads = zero.full_grads()
        reference_grads = dict(reference.named_parameters())
        for name in names:
            torch.testing.assert_close(grads[name], reference_grads[name].grad, **FP32, msg=f"grad {name} {step}")
        if max_norm is not None:
            norm = zero.clip_grad_norm_(max_norm)
            reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            torch.testing.assert_close(torch.tensor(norm, dtype=torch.float32), reference_norm, **FP32)
        zero.step()
        zero.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        params = zero.full_params()
        for name in names:
            torch.testing.assert_close(params[name], reference_grads[name].detach(), **FP32, msg=f"{name} {step}")
    # after the step, the compute copies the model runs with equal the reference too
    zero.release_params()
    tokens, targets = batch(99, rows=ROWS_PER_RANK)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, targets), reference(tokens, targets), **FP32)
    return losses, len(zero.chunks)


def _reference_losses(num_steps, n):
    # the losses of the reference run, recomputed here without sharding for the test process
    _, reference = make_models()
    optimizer = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    losses = []
    for step in range(num_steps):
        tokens, targets = batch(step, rows=n * ROWS_PER_RANK)
        loss = reference(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_single_process_adamw_on_two_ranks(stage):
    results = run_distributed(_train_against_reference, stage, world_size=2)
    per_rank_losses = [losses for losses, _ in results]
    assert results[0][1] > 2  # several chunks, so bucketing and prefetch are exercised
    mean_losses = [sum(step) / len(step) for step in zip(*per_rank_losses)]
    assert mean_losses == pytest.approx(_reference_losses(5, 2), rel=1e-5)


@pytest.mark.parametrize(
    "forms",
    [
        {"all_gather": "p2p", "reduce_scatter": "p2p"},
        {"all_gather": "all_reduce", "reduce_scatter": "all_to_all"},
        {"all_gather": "native", "reduce_scatter": "native"},
    ],
    ids=["p2p", "all_reduce-all_to_all", "native"],
)
@pytest.mark.parametrize("stage", [2, 3])
def test_stage_matches_under_every_collective_form(stage, forms):
    # the tests' chunks are small enough for the default table's small-message forms; force each of the others
    results = run_distributed(_train_against_reference, stage, forms=forms, world_size=2)
    mean_losses = [sum(step) / len(step) for step in zip(*(losses for losses, _ in results))]
    assert mean_losses == pytest.approx(_reference_losses(5, 2), rel=1e-5)


def _deep_mlp_with_pooled_buffers(num_layers, num_steps):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    torch.manual_seed(0)
    layers = [module for _ in range(num_layers) for module in (torch.nn.Linear(8, 8), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers)
    reference = copy.deepcopy(model)
    # one layer (64 + 8 elements) per chunk: every chunk has the same size, so all share the pool's buffers
    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh, stage=3, chunk_numel=72)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(num_steps):
        inputs = torch.randn(4 * n, 8, generator=torch.Generator().manual_seed(step))
        reference(inputs).square().mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        zero.backward(model(inputs[rank * 4 : (rank + 1) * 4]).square().mean() * 1.0)
        zero.step()
        zero.zero_grad()
    params = zero.full_params()
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(params[name], expected.detach(), **FP32, msg=name)
    return len(zero.chunks), zero.gatherer.num_gathers, zero.pool.num_allocated


def test_stage3_gathers_and_buckets_reuse_a_few_pooled_buffers():
    # each of 8 chunks is gathered in forward and again in backward and fills a gradient bucket, 3 steps long; the
    # weights autograd saves are packed as chunk positions, so a released buffer goes back to the pool (reused by
    # the next gather: the parameters still match the single-process run), and the buffers ever allocated stay at
    # the most in use at once (current + prefetched gathers, buckets in flight), not one per gather
    for num_chunks, num_gathers, num_allocated in run_distributed(_deep_mlp_with_pooled_buffers, 8, 3, world_size=2):
        assert num_chunks == 8
        # forward and backward gather each chunk, but the one forward ends with stays gathered for backward once the
        # first forward has shown which it is
        assert num_gathers == 2 * 8 * 3 - (3 - 1)
        assert num_allocated <= 6, f"{num_allocated} buffers allocated for {num_gathers} gathers"


@pytest.mark.parametrize("stage", [2, 3])
def test_stage_matches_on_four_ranks(stage):
    results = run_distributed(_train_against_reference, stage, num_steps=5, world_size=4)
    mean_losses = [sum(step) / len(step) for step in zip(*[losses for losses, _ in results])]
    assert mean_losses == pytest.approx(_reference_losses(5, 4), rel=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_over_four_microsteps_equals_one_big_batch(stage):
    run_distributed(_train_against_reference, stage, num_microsteps=4, world_size=2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_equals_clip_grad_norm_on_the_full_model(stage):
    run_distributed(_train_against_reference, stage, max_norm=0.05, world_size=2)


def _volume_per_step(stage):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n = mesh.size("dp")
    model, _ = make_models(frozen=False)
    zero = ZeroOptimizer(model, torch.optim.AdamW(param_groups(model), lr=1e-2), mesh=mesh, stage=stage, chunk_numel=48)
    tokens, targets = batch(0, rows=ROWS_PER_RANK)
    with CommTracker() as tracker:
        zero.backward(model(tokens, targets))
        zero.step()
        zero.zero_grad()
    chunk_bytes = sum(chunk.numel * 4 for chunk in zero.trainable_chunks)
    ddp_all_reduce = 2 * (n - 1) / n * chunk_bytes  # DDP all-reduces the same (fp32, padded) gradient bytes
    return tracker.bytes(axis="dp"), ddp_all_reduce, tracker.bytes("reduce_scatter"), tracker.bytes("all_gather")


@pytest.mark.parametrize("stage, ratio", [(1, 1.0), (2, 1.0), (3, 1.5)])
def test_communication_volume_per_step(stage, ratio):
    for total, ddp, reduce_scattered, gathered in run_distributed(_volume_per_step, stage, world_size=2):
        assert total == pytest.approx(ratio * ddp)
        assert reduce_scattered == pytest.approx(ddp / 2)  # gradients: one reduce-scatter of every chunk
        assert gathered == pytest.approx((ratio - 0.5) * ddp)  # stage 3 gathers in forward and in backward


def _discarded_backward_leaves_no_trace(stage, use_no_sync):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    model, reference = make_models()
    zero = ZeroOptimizer(model, torch.optim.AdamW(param_groups(model), lr=1e-2), mesh=mesh, stage=stage, chunk_numel=48)
    reference_optimizer = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    discarded_tokens, discarded_targets = batch(50, rows=n * ROWS_PER_RANK)
    with zero.no_sync() if use_no_sync else contextlib.nullcontext():
        zero.backward(model(discarded_tokens[mine], discarded_targets[mine]))
    zero.zero_grad()  # no step: these gradients (reduced, in flight or accumulating) are dropped
    tokens, targets = batch(0, rows=n * ROWS_PER_RANK)
    zero.backward(model(tokens[mine], targets[mine]))
    zero.step()
    reference(tokens, targets).backward()
    reference_optimizer.step()
    params = zero.full_params()
    for name, expected in reference.named_parameters():
        if expected.requires_grad:
            torch.testing.assert_close(params[name], expected.detach(), **FP32, msg=name)


@pytest.mark.parametrize("use_no_sync", [False, True], ids=["synced", "no_sync"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_after_a_backward_without_a_step_discards_its_gradients(stage, use_no_sync):
    run_distributed(_discarded_backward_leaves_no_trace, stage, use_no_sync, world_size=2)


def _bad_input():
    mesh = Mesh(dp=torch.distributed.get_world_size())
    errors = {}
    model, _ = make_models()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, build in {
        "stage": lambda: ZeroOptimizer(model, mesh=mesh, stage=4),
        "axes": lambda: ZeroOptimizer(model, mesh=mesh, data_axes=("dp", "sp")),
        "state": lambda: ZeroOptimizer(model, optimizer, mesh=mesh, stage=2),
        "missing": lambda: ZeroOptimizer(model, torch.optim.AdamW([model.up.weight]), mesh=mesh, stage=1),
    }.items():
        try:
            build()
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_bad_input_gets_a_clear_error_before_any_collective():
    errors = run_distributed(_bad_input, world_size=2)[0]
    assert "ZeroConfig.stage=4" in errors["stage"]
    assert "not axes of the mesh" in errors["axes"]
    assert "already holds state" in errors["state"]
    assert "is in no optimizer param group" in errors["missing"]


# --- mixed precision ---------------------------------------------------------------------------------------------


def _fp16_overflow_is_skipped_everywhere(stage):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    rank = mesh.rank("dp")
    model, _ = make_models()
    zero = ZeroOptimizer(
        model,
        torch.optim.AdamW(param_groups(model), lr=1e-2),
        mesh=mesh,
        stage=stage,
        chunk_numel=48,
        mixed_precision=MixedPrecision(param_dtype=torch.float16, comm_dtype=torch.float32),
        loss_scaler=DynamicLossScaler(group=mesh.group("dp"), init_scale=2.0**8),
    )
    skipped, scales = [], []
    for step in range(4):
        tokens, targets = batch(step, rows=ROWS_PER_RANK)
        before = zero.full_params()
        loss = model(tokens, targets)
        if step == 2 and rank == 0:  # overflow on one rank only
            loss = loss * float("inf")
        zero.backward(loss)
        skipped.append(zero.step())
        zero.zero_grad()
        scales.append(zero.loss_scaler.scale)
        after = zero.full_params()
        if skipped[-1]:
            for name in before:
                torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)
        assert all(torch.isfinite(t).all() for t in after.values())
    return skipped, scales


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_step_is_skipped_on_every_rank(stage):
    for skipped, scales in run_distributed(_fp16_overflow_is_skipped_everywhere, stage, world_size=2):
        assert skipped == [False, False, True, False]
        assert scales == [2.0**8, 2.0**8, 2.0**7, 2.0**7]


def _bf16_against_fp32_reference(stage):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    model, reference = make_models()
    zero = ZeroOptimizer(
        model,
        torch.optim.AdamW(param_groups(model), lr=1e-2),
        mesh=mesh,
        stage=stage,
        chunk_numel=48,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    reference_optimizer = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    for step in range(5):
        tokens, targets = batch(step, rows=n * ROWS_PER_RANK)
        reference(tokens, targets).backward()
        mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        zero.backward(model(tokens[mine], targets[mine]))
        zero.step()
        zero.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    params = zero.full_params()
    for name, p in reference.named_parameters():
        if p.requires_grad:
            # bf16 compute (8 mantissa bits) and bf16 gradient reduction; five steps of lr 1e-2 keep the fp32
            # masters within a few bf16 ulps of the fp32 run
            torch.testing.assert_close(params[name], p.detach(), rtol=2e-2, atol=2e-2)
    return zero.chunks[0].buffer("master").dtype, next(model.up.parameters()).dtype


def test_bf16_compute_with_fp32_masters_tracks_the_fp32_run():
    for master_dtype, compute_dtype in run_distributed(_bf16_against_fp32_reference, 2, world_size=2):
        assert (master_dtype, compute_dtype) == (torch.float32, torch.bfloat16)


# --- memory ------------------------------------------------------------------------------------------------------


def _memory(stage, mixed):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = make_models(frozen=False)
    mp = MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
    zero = ZeroOptimizer(
        model,
        torch.optim.AdamW(param_groups(model), lr=1e-2),
        mesh=mesh,
        stage=stage,
        chunk_numel=48,
        mixed_precision=mp,
    )
    tokens, targets = batch(0, rows=ROWS_PER_RANK)
    zero.backward(model(tokens, targets))
    zero.step()
    zero.release_params()
    report = zero.memory_report()
    # independent count: unique storages reachable from the model, the optimizer and its parameters' grads
    storages = {}
    for tensor in [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]:
        if tensor.numel():
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for group in zero.optimizer.param_groups:
        for master in group["params"]:
            for tensor in [master, master.grad, *zero.optimizer.state[master].values()]:
                if isinstance(tensor, torch.Tensor):
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for chunk in zero.chunks:  # stage 3 compute shards and the gradient shards are reachable only through chunks
        for name in ("param_shard", "grad_shard"):
            if chunk.has_buffer(name):
                shard = chunk.buffer(name)
                storages[shard.untyped_storage().data_ptr()] = shard.untyped_storage().nbytes()
    psi = sum(chunk.numel for chunk in zero.chunks)  # padded parameter count
    return report, sum(storages.values()), psi, mesh.size("dp")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_agrees_with_an_independent_count_and_the_formula(stage):
    for report, independent, psi, n in run_distributed(_memory, stage, True, world_size=2):
        step_scalars = 2 * 2 * 4  # AdamW's fp32 ``step`` scalar per master (two chunks' worth of slack)
        assert report.total == pytest.approx(independent, rel=0.02)
        # free pooled buffers (stage 1 keeps persistent gradient buffers instead of buckets) are not model state
        assert (report.workspace > 0) == (stage != 1)
        # the ZeRO paper's mixed-precision formulas over the padded parameter count Ψ: bf16 compute copy and
        # gradients (2Ψ each), fp32 master + Adam moments (12Ψ); the gradient shards are kept in bf16 (the
        # reduce dtype), and stage 1's shard is the own region of its full gradient buffer
        expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
        assert report.total == pytest.approx(expected, rel=0.02, abs=step_scalars * 8)
        assert report.total == pytest.approx(estimate_memory(psi, stage=stage, dp=n).device, abs=step_scalars * 8)


def test_estimate_memory_follows_the_zero_formulas():
    psi, n = 1_000_000, 4
    assert estimate_memory(psi, stage=0, dp=n).device == 16 * psi
    assert estimate_memory(psi, stage=1, dp=n).device == 4 * psi + 12 * psi / n
    assert estimate_memory(psi, stage=2, dp=n).device == 2 * psi + 14 * psi / n
    assert estimate_memory(psi, stage=3, dp=n).device == 16 * psi / n
    offloaded = estimate_memory(psi, stage=2, dp=n, offload=True)
    assert (offloaded.device, offloaded.host) == (2 * psi + 2 * psi / n, 12 * psi / n)
    with pytest.raises(ValueError, match="stage=5"):
        estimate_memory(psi, stage=5, dp=n)


def _reduce_at_the_step(stage: int, num_steps: int = 3, microsteps: int = 2):
    """``grad_reduction="step"``: each step's microsteps accumulate full gradients, the last one written to ``.grad``
    outside autograd's hooks (as a pipeline's W step writes them); ``reduce_gradients`` reduces each chunk once."""
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    model, reference = make_models()
    zero = ZeroOptimizer(
        model,
        torch.optim.AdamW(param_groups(model), lr=1e-2),
        mesh=mesh,
        stage=stage,
        chunk_numel=48,
        grad_reduction="step",
    )
    reference_optimizer = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    names = [name for name, p in reference.named_parameters() if p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    reductions = []
    for step in range(num_steps):
        tokens, targets = batch(step, rows=n * ROWS_PER_RANK)
        reference(tokens, targets).backward()
        mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        with CommTracker() as tracker:
            micro = list(zip(tokens[mine].chunk(microsteps), targets[mine].chunk(microsteps)))
            for index, (micro_tokens, micro_targets) in enumerate(micro):
                loss = model(micro_tokens, micro_targets) / microsteps
                if index < microsteps - 1:
                    zero.backward(loss)
                    continue
                for param, grad in zip(trainable, torch.autograd.grad(loss, trainable)):  # no gradient hook fires
                    param.grad = grad if param.grad is None else param.grad + grad
            zero.reduce_gradients()
        reductions.append(tracker.calls("reduce_scatter"))
        grads = zero.full_grads()
        for name, param in reference.named_parameters():
            if param.requires_grad:
                torch.testing.assert_close(grads[name], param.grad, **FP32, msg=f"grad {name} {step}")
        zero.step()
        zero.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    params = zero.full_params()
    mismatches = [n for n in names if not torch.allclose(params[n], dict(reference.named_parameters())[n], **FP32)]
    gathers = zero.gatherer.num_gathers if zero.gatherer is not None else None
    return reductions, len(zero.trainable_chunks), len(zero.chunks), gathers, mismatches


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_reducing_at_the_step_sees_gradients_written_outside_the_hooks(stage):
    for reductions, trainable, num_chunks, gathers, mismatches in run_distributed(
        _reduce_at_the_step, stage, world_size=2
    ):
        assert not mismatches, mismatches
        if stage != 0:  # one reduce-scatter per trainable chunk per step, whatever the microsteps
            assert reductions == [trainable] * 3
        if stage == 3:  # each chunk gathered once per step and held until the reduction
            assert gathers == 3 * num_chunks
