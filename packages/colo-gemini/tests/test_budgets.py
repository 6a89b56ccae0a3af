"""Budgets: with a device budget below the parameters training runs, the arena's high-water mark stays within it and
the tracer agrees; tiers too small for the model, bad settings and optimizers Gemini cannot step fail in the
constructor, before any collective, with the field to change."""

from __future__ import annotations

import pytest
import torch

from colo.comm import Mesh
from colo.comm.testing import load_beside, run_distributed
from colo.gemini import GeminiConfig, GeminiMemoryError, GeminiOptimizer

h = load_beside(__file__, "_helpers.py", module_name="colo_gemini_test_helpers")


# --- budgets --------------------------------------------------------------------------------------------------


BUDGET_CAPACITY = {"static": "64KiB", "auto": "112KiB"}
"""Device budgets below the model's 141 KiB of parameters. Static needs room for the chunks in use only; auto
also keeps the non-model memory the warm-up recorded (about 40 KiB here) free of chunks."""


def _budget_run(placement):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    model, _ = h.make_models()
    fields = {"placement": placement, "device_capacity": BUDGET_CAPACITY[placement], "chunk_numel": h.CHUNK_NUMEL}
    if placement == "static":
        fields.update(param_fractions={"host": 1.0}, optim_fractions={"host": 1.0})
    gemini = GeminiOptimizer(model, torch.optim.AdamW(h.param_groups(model), lr=1e-2), mesh=mesh, **fields)
    for step in range(5):
        tokens, targets = h.batch(step, rows=n * h.ROWS_PER_RANK, device=gemini.device)
        mine = slice(rank * h.ROWS_PER_RANK, (rank + 1) * h.ROWS_PER_RANK)
        gemini.backward(model(tokens[mine], targets[mine]))
        gemini.step()
        gemini.zero_grad()
    report = gemini.memory_report()
    arena, tracer = gemini.arena, gemini.tracer
    planned = [s for s in tracer.samples if s.step > 1]  # accesses after the warm-up step
    result = {
        "capacity": arena.capacity,
        "arena_high_water": arena.high_water,
        "tracer_peak": report.tracer_device_peak,
        "report_high_water": report.tiers["device"].high_water,
        "tracer_used": tracer.used["device"],
        "arena_used": arena.used,
        "arena_live": arena.live_bytes(),
        "step_peaks": [step.device_peak for step in report.steps],
        "within_plan": all(s.device_used <= s.device_limit for s in planned),
        "num_planned": len(planned),
        "non_model_peak": report.non_model_peak,
        "evictions": sum(step.evictions for step in report.steps),
        "prefetch_hits": report.prefetch_hits,
        "overruns": sum(step.budget_overruns for step in report.steps),
        "text": str(report),
    }
    gemini.close()
    return result


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("placement", ["static", "auto"])
def test_device_budget_below_the_parameters_holds_and_the_tracer_agrees(placement, world_size):
    for result in run_distributed(_budget_run, placement, world_size=world_size):
        assert result["capacity"] < h.param_bytes()
        assert result["arena_high_water"] <= result["capacity"]
        # the tracer counts the device tier from allocation events; the arena from its blocks: they agree
        assert result["tracer_peak"] == result["arena_high_water"] == result["report_high_water"]
        assert result["tracer_used"] == result["arena_used"] == result["arena_live"]
        assert max(result["step_peaks"]) <= result["arena_high_water"]
        assert result["evictions"] > 0 and result["prefetch_hits"] > 0
        assert "prefetch hits" in result["text"]
        if placement == "auto":
            # after the warm-up, chunks plus the recorded non-model memory stay within the device budget
            assert result["num_planned"] > 0 and result["within_plan"] and result["overruns"] == 0
            assert 0 < result["non_model_peak"] < result["capacity"]


def _auto_everything_fits():
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = h.make_models()
    gemini = GeminiOptimizer(
        model, torch.optim.AdamW(h.param_groups(model), lr=1e-2), mesh=mesh,
        placement="auto", device_capacity="1MiB", chunk_numel=h.CHUNK_NUMEL,
    )  # fmt: skip
    for step in range(3):
        tokens, targets = h.batch(step, rows=h.ROWS_PER_RANK, device=gemini.device)
        gemini.backward(model(tokens, targets))
        gemini.step()
        gemini.zero_grad()
    report = gemini.memory_report()
    homes = {r.home for r in gemini.manager.residency.values()}
    tiers = {s.tier for s in gemini.hybrid.states.values()}
    gemini.close()
    return homes, tiers, [step.total_moved for step in report.steps], report.tiers["host"].used


def test_auto_makes_everything_resident_when_the_warm_up_shows_it_fits():
    homes, tiers, moved, host_used = run_distributed(_auto_everything_fits, world_size=1)[0]
    assert homes == {"device"} and tiers == {"device"} and host_used == 0
    assert moved[0] > 0 and moved[1:] == [0, 0]  # the warm-up fetches; afterwards nothing moves


# --- errors before training -------------------------------------------------------------------------------------


def _too_small(case):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = h.make_models()
    optimizer = torch.optim.AdamW(h.param_groups(model), lr=1e-2)
    fields = {
        "total": {"placement": "auto", "device_capacity": "4KiB", "host_capacity": "8KiB"},
        "static_host": {"param_fractions": {"host": 1.0}, "optim_fractions": {"host": 1.0}, "host_capacity": "10KiB"},
        "working_set": {"placement": "auto", "device_capacity": 600, "host_capacity": "1MiB"},
    }[case]
    try:
        GeminiOptimizer(model, optimizer, mesh=mesh, chunk_numel=h.CHUNK_NUMEL, **fields)
    except ValueError as error:
        return str(error), model.embed.weight.numel()
    return None, model.embed.weight.numel()


@pytest.mark.parametrize("case", ["total", "static_host", "working_set"])
def test_tiers_too_small_fail_in_the_constructor_with_the_bytes_missing(case):
    for message, embed_numel in run_distributed(_too_small, case, world_size=2):
        assert message is not None, "the constructor accepted tiers that cannot hold the model"
        assert "missing" in message
        assert embed_numel == h.VOCAB * h.DIM  # the model was left as it was: nothing was moved into tiers
        expected = {
            "total": "does not fit in the tiers",
            "static_host": "host_capacity",
            "working_set": "device_capacity",
        }
        assert expected[case] in message


def _warm_up_too_tight():
    mesh = Mesh(dp=1)
    model, _ = h.make_models()
    gemini = GeminiOptimizer(
        model, torch.optim.AdamW(h.param_groups(model), lr=1e-2), mesh=mesh,
        placement="auto", device_capacity="64KiB", chunk_numel=h.CHUNK_NUMEL,
    )  # fmt: skip
    tokens, targets = h.batch(0, rows=16, device=gemini.device)  # activations that crowd out the chunks
    gemini.backward(model(tokens, targets))
    try:
        gemini.step()
    except GeminiMemoryError as error:
        return str(error)
    finally:
        gemini.close()
    return None


def test_auto_reports_when_the_warm_up_leaves_no_room_for_chunks():
    message = run_distributed(_warm_up_too_tight, world_size=1)[0]
    assert message is not None and "non-model memory" in message and "device_capacity" in message


def test_config_errors_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="placement='greedy'"):
        GeminiConfig(placement="greedy")
    with pytest.raises(ValueError, match="sums to 0.9"):
        GeminiConfig(param_fractions={"device": 0.5, "host": 0.4})
    with pytest.raises(ValueError, match="not tiers"):
        GeminiConfig(optim_fractions={"gpu": 1.0})
    with pytest.raises(ValueError, match="disk_dir is None"):
        GeminiConfig(optim_fractions={"disk": 1.0})
    with pytest.raises(ValueError, match="static placement setting"):
        GeminiConfig(placement="auto", param_fractions={"host": 1.0})
    with pytest.raises(ValueError, match="device_capacity='lots'"):
        GeminiConfig(device_capacity="lots")
    assert GeminiConfig(host_capacity="2KiB", device_capacity="1.5MB").host_capacity == 2048
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            GeminiConfig(pin_memory=True)


def _bad_optimizer():
    mesh = Mesh(dp=1)
    model, _ = h.make_models()
    errors = []
    for build in (
        lambda: torch.optim.SGD(model.parameters(), lr=0.1),
        lambda: torch.optim.AdamW(h.param_groups(model), amsgrad=True),
        lambda: torch.optim.AdamW([model.blocks[0].up.weight]),
    ):
        try:
            GeminiOptimizer(model, build(), mesh=mesh, chunk_numel=h.CHUNK_NUMEL)
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    return errors


def test_optimizers_it_cannot_step_are_rejected():
    errors = run_distributed(_bad_optimizer, world_size=1)[0]
    assert len(errors) == 3
    assert "not SGD" in errors[0] and "amsgrad" in errors[1] and "in no optimizer param group" in errors[2]
