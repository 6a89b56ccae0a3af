"""Gemini matches a single-process AdamW run step by step, on 1 and 2 ranks, under several tier budgets.

Each rank trains its share of the batch through `GeminiOptimizer`; the reference trains one model on the whole
batch with `torch.optim.AdamW`. Every step compares the loss, the gathered gradients and the fp32 masters.

Tolerances (fp32): the reference reduces the gradient over the whole batch at once; on 2 ranks (or with
accumulation) partial gradients are summed in another order, so gradients differ in the last bits. Adam then
divides each element by its own magnitude: an element whose gradient is ~1e-7 (there are some) turns a 1e-9
rounding difference into a 1e-4 step difference, an amplification of the reduction order, not an error. So the
gradients are compared (rtol/atol 1e-5), and the reference then steps with the gradients Gemini reduced, and the
masters must agree to the rounding of torch's fused Adam kernel against the reference's per-tensor loop
(rtol/atol 1e-5). Where nothing is reduced differently (one rank, bf16 against a bf16 reference) the runs are
compared bit for bit. Placement itself adds nothing: moving a buffer between tiers copies it bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm import Mesh
from colo.comm.testing import load_beside, run_distributed
from colo.gemini import GeminiOptimizer
from colo.zero import MixedPrecision

h = load_beside(__file__, "_helpers.py", module_name="colo_gemini_test_helpers")


def _train_against_reference(budget, *, mixed=False, num_steps=5, num_microsteps=1, max_norm=None, compact=False):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    model, reference = h.make_models()
    extra = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)} if mixed else {}
    lr = 1e-3 if mixed else 1e-2  # see the bf16 tolerance below
    gemini = GeminiOptimizer(
        model, torch.optim.AdamW(h.param_groups(model, lr=lr)), mesh=mesh, config=h.config(budget, **extra)
    )
    reference_optimizer = torch.optim.AdamW(h.param_groups(reference, lr=lr))
    reference_params = dict(reference.named_parameters())
    names = [name for name, p in reference_params.items() if p.requires_grad]
    losses, reference_losses, mixed_errors = [], [], []
    moved_by_compaction = []
    if compact:  # slide the arena together mid-forward and mid-backward, with chunks in use and saved for backward
        middle = model.blocks[h.NUM_BLOCKS // 2]
        middle.register_forward_hook(lambda *_: moved_by_compaction.append(gemini.manager.compact()))
        middle.up.weight.register_post_accumulate_grad_hook(
            lambda _: moved_by_compaction.append(gemini.manager.compact())
        )
    for step in range(num_steps):
        tokens, targets = h.batch(step, rows=n * h.ROWS_PER_RANK)
        reference_loss = reference(tokens, targets)
        reference_loss.backward()
        reference_losses.append(reference_loss.item())
        mine = slice(rank * h.ROWS_PER_RANK, (rank + 1) * h.ROWS_PER_RANK)
        local_loss = 0.0
        for micro_tokens, micro_targets in zip(tokens[mine].chunk(num_microsteps), targets[mine].chunk(num_microsteps)):
            loss = model(micro_tokens.to(gemini.device), micro_targets.to(gemini.device)) / num_microsteps
            gemini.backward(loss)
            local_loss += loss.item()
        losses.append(local_loss)
        if not mixed:
            grads = gemini.full_grads()
            for name in names:
                torch.testing.assert_close(
                    grads[name], reference_params[name].grad, **h.FP32, msg=f"grad {name} {step}"
                )
                reference_params[name].grad.copy_(grads[name])  # see the module docstring
        if max_norm is not None:
            norm = gemini.clip_grad_norm_(max_norm)
            reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            torch.testing.assert_close(torch.tensor(norm, dtype=torch.float32), reference_norm, **h.FP32)
        gemini.step()
        gemini.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        params = gemini.full_params()
        if mixed:
            # bf16 compute (8 mantissa bits) against the fp32 run. Adam normalises each element's update, so an
            # element whose gradient is within bf16 rounding of zero can take its step (about lr) the other way:
            # at most 2 lr per step, 2e-2 over five steps at lr <= 2e-3, hence atol 2e-2 elementwise; the whole
            # model stays within 1% in relative L2 norm. `test_bf16_on_one_rank_equals_a_bf16_single_process_run_bit_
            # for_bit` checks the bf16 arithmetic itself.
            for name in names:
                expected = reference_params[name].detach()
                torch.testing.assert_close(params[name], expected, rtol=2e-2, atol=2e-2, msg=f"{name} {step}")
            difference = torch.cat([(params[n] - reference_params[n].detach()).reshape(-1) for n in names])
            scale = torch.cat([reference_params[n].detach().reshape(-1) for n in names])
            error = float(difference.norm() / scale.norm())
            assert error <= 1e-2, f"step {step}: relative error {error:.4f} of the masters against the fp32 run"
            mixed_errors.append(error)
        else:
            for name in names:
                expected = reference_params[name].detach()
                torch.testing.assert_close(params[name], expected, **h.FP32, msg=f"{name} {step}")
    # the compute copies the model runs with after the last step equal the reference's parameters too
    tokens, targets = h.batch(99, rows=h.ROWS_PER_RANK)
    with torch.no_grad():
        evaluated = model(tokens.to(gemini.device), targets.to(gemini.device)).cpu()
        gemini.release_params()
        tolerance = {"rtol": 2e-2, "atol": 2e-2} if mixed else h.FP32
        torch.testing.assert_close(evaluated, reference(tokens, targets), **tolerance)
    report = gemini.memory_report()
    arena = gemini.arena
    result = {
        "losses": losses,
        "reference_losses": reference_losses,
        "num_chunks": len(gemini.chunks),
        "homes": set(gemini.placement.param_home.values()),
        "optim_tiers": {state.tier for state in gemini.hybrid.states.values()},
        "moved": [step.total_moved for step in report.steps],
        "moved_by_compaction": moved_by_compaction,
        "high_water": arena.high_water,
        "capacity": arena.capacity,
        "compute_dtype": gemini.manager.dtype_of(gemini.chunks[0]),
        "mixed_errors": mixed_errors,
    }
    gemini.close()
    return result


def _check_losses(results, *, rel):
    per_rank = [r["losses"] for r in results]
    mean = [sum(values) / len(values) for values in zip(*per_rank)]
    assert mean == pytest.approx(results[0]["reference_losses"], rel=rel)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("budget", list(h.BUDGETS))
def test_fp32_matches_single_process_adamw(budget, world_size):
    results = run_distributed(_train_against_reference, budget, world_size=world_size)
    _check_losses(results, rel=1e-5)
    for result in results:
        assert result["num_chunks"] > 4  # several chunks, so movement, eviction and prefetch are exercised
        assert result["high_water"] <= result["capacity"]
        if budget == "disk":
            assert result["homes"] == {"host", "disk"} and "disk" in result["optim_tiers"]

        if budget != "all_device":
            assert all(moved > 0 for moved in result["moved"])  # chunks really travel between tiers every step
        else:
            assert result["moved"] == [0] * 5


@pytest.mark.parametrize("budget, world_size", [("host_offload", 2), ("auto_small_device", 1), ("disk", 2)])
def test_bf16_compute_with_fp32_masters_tracks_the_fp32_run(budget, world_size):
    results = run_distributed(_train_against_reference, budget, mixed=True, world_size=world_size)
    # bf16 logits and activations: losses within 1% of the fp32 reference's
    _check_losses(results, rel=1e-2)
    assert results[0]["compute_dtype"] == torch.bfloat16
    print("relative errors of the masters per step:", [f"{e:.4f}" for e in results[0]["mixed_errors"]])


def _bf16_against_bf16_reference(budget):
    mesh = Mesh(dp=1)
    model, reference = h.make_models()
    config = h.config(budget, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    gemini = GeminiOptimizer(model, torch.optim.AdamW(h.param_groups(model), lr=1e-2), mesh=mesh, config=config)
    # the reference: a bf16 copy of the model computes, fp32 masters are stepped by torch's AdamW
    masters = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in reference.named_parameters()}
    reference.to(torch.bfloat16)
    decay = [masters[n] for n, p in reference.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [masters[n] for n, p in reference.named_parameters() if p.requires_grad and p.dim() < 2]
    reference_optimizer = torch.optim.AdamW(  # torch's fused kernel, the one Gemini steps every tier with
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2}],
        lr=1e-2,
        fused=True,
    )
    for step in range(5):
        tokens, targets = h.batch(step, rows=h.ROWS_PER_RANK)
        loss = model(tokens.to(gemini.device), targets.to(gemini.device))
        gemini.backward(loss)
        gemini.step()
        gemini.zero_grad()
        reference_loss = reference(tokens, targets)
        reference_loss.backward()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if p.requires_grad:
                    masters[name].grad = p.grad.float()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            reference.zero_grad()
            for name, p in reference.named_parameters():
                p.copy_(masters[name])
        # the same bf16 arithmetic in forward and backward and the same elementwise Adam kernel: bit for bit
        assert loss.item() == reference_loss.item()
        params = gemini.full_params()
        for name in params:
            assert torch.equal(params[name], masters[name].detach()), f"{name} differs after step {step}"
    gemini.close()


@pytest.mark.parametrize("budget", ["host_offload", "auto_disk"])
def test_bf16_on_one_rank_equals_a_bf16_single_process_run_bit_for_bit(budget):
    run_distributed(_bf16_against_bf16_reference, budget, world_size=1)


@pytest.mark.parametrize("world_size", [1, 2])
def test_compacting_the_arena_mid_step_changes_nothing(world_size):
    # live buffers (in-use parameters, gradient buckets, cached copies) move while autograd holds saved views
    for result in run_distributed(_train_against_reference, "tight_device", compact=True, world_size=world_size):
        assert len(result["moved_by_compaction"]) == 11  # 5 steps x (forward, backward) + the evaluation forward
        assert sum(result["moved_by_compaction"]) > 0


def test_accumulation_and_clipping_on_offloaded_gradients_equal_the_reference():
    # gradient shards on the device and on the host: the clipping norm spans both tiers and both ranks
    run_distributed(_train_against_reference, "host_offload", num_microsteps=2, max_norm=0.05, world_size=2)


# --- fp16 -------------------------------------------------------------------------------------------------------


def _fp16_overflow_on_one_rank():
    mesh = Mesh(dp=torch.distributed.get_world_size())
    rank = mesh.rank("dp")
    model, _ = h.make_models()
    config = h.config("host_offload", mixed_precision=MixedPrecision(param_dtype=torch.float16))
    gemini = GeminiOptimizer(model, torch.optim.AdamW(h.param_groups(model)), mesh=mesh, config=config)
    skipped, scales, unchanged = [], [], []
    for step in range(3):
        tokens, targets = h.batch(step, rows=h.ROWS_PER_RANK, device=gemini.device)
        before = gemini.full_params()
        loss = model(tokens, targets)
        if step == 1 and rank == 0:
            loss = loss * float("inf")
        gemini.backward(loss)
        skipped.append(gemini.step())
        gemini.zero_grad()
        scales.append(gemini.loss_scaler.scale)
        after = gemini.full_params()
        unchanged.append(all(torch.equal(after[n], before[n]) for n in before))
    gemini.close()
    return skipped, scales, unchanged


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    for skipped, scales, unchanged in run_distributed(_fp16_overflow_on_one_rank, world_size=2):
        assert skipped == [False, True, False] and unchanged == [False, True, False]
        assert scales == [2.0**16, 2.0**15, 2.0**15]
