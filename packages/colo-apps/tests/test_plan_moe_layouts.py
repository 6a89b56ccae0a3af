"""`colo plan`'s model of the DeepSeek-style MoE block under `HybridParallel(ep=...)`, against what colo does.

One 4-rank spawn runs, for each layout, two Booster steps of the DeepSeek-style model (a dense first layer, then MoE
layers of 16 narrow experts top-4 within one of two groups, a shared expert, sigmoid routing with the bias; with
multi-head latent attention, or with Llama's attention where tp splits it) and compares the second step with the
planner (`test_plan_memory`'s measurement, reused):

- parameters, gradients, masters, optimizer states and padding: `ExpertParallelZero.memory_report()` exactly on every
  rank (dense chunks over dp x ep, expert chunks over dp; a stage's own layers; experts split over tp or not);
- communication: `CommTracker`'s bytes per (collective, axis) exactly, the all-to-alls from the step's own routing.
"""

from __future__ import annotations

import pytest

from colo.comm.testing import load_beside, run_distributed

plan_memory = load_beside(__file__, "test_plan_memory.py", module_name="colo_apps_test_plan_memory_for_moe")

LAYOUTS = [
    # (name, preset, Layout fields, microbatches)
    (
        "ep2-pp2-zero2",
        "tiny-deepseek",
        {"plugin": "hybrid", "ep": 2, "pp": 2, "dp": 1, "zero_stage": 2, "precision": "fp32"},
        2,
    ),
    (
        "ep2-dp2-zero3-bf16",
        "tiny-deepseek",
        {"plugin": "hybrid", "ep": 2, "dp": 2, "zero_stage": 3, "precision": "bf16"},
        1,
    ),
    (
        "ep2-tp2-zero1",
        "tiny-deepseek-gqa",
        {"plugin": "hybrid", "ep": 2, "tp": 2, "dp": 1, "zero_stage": 1, "precision": "fp32"},
        1,
    ),
    (
        "ep2-tp2-etp-zero2-bf16",
        "tiny-deepseek-gqa",
        {
            "plugin": "hybrid",
            "ep": 2,
            "tp": 2,
            "dp": 1,
            "zero_stage": 2,
            "precision": "bf16",
            "expert_tensor_parallel": True,
        },
        1,
    ),
]


@pytest.fixture(scope="module")
def measured():
    return run_distributed(plan_memory._measure, LAYOUTS, world_size=4, timeout=400)


@pytest.mark.parametrize("case", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_static_memory_equals_memory_report(case, measured):
    from colo.apps.plan import static_memory

    name, preset, fields, microbatches = case
    layout = plan_memory._layout(fields, microbatches, preset)
    config = plan_memory._config(preset)
    for rank_results in measured:
        report, coord = next((r[1], r[4]) for r in rank_results if r[0] == name)
        data_rank = plan_memory._data_rank(layout, coord)
        predicted = static_memory(config, layout, pp_rank=coord.get("pp", 0), data_rank=data_rank)
        for key in ("params", "grads", "masters", "optimizer_states", "padding", "host"):
            assert getattr(predicted, key) == report[key], (name, coord, key)
        assert report["workspace"] <= predicted.workspace


@pytest.mark.parametrize("case", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_communication_bytes_equal_comm_tracker(case, measured):
    from colo.apps.plan import step_communication

    name, preset, fields, microbatches = case
    layout = plan_memory._layout(fields, microbatches, preset)
    config = plan_memory._config(preset)
    for rank_results in measured:
        comm, coord, routings = next((r[3], r[4], r[6]) for r in rank_results if r[0] == name)
        seq = plan_memory.SHAPES[preset][1]
        # the all-to-all (and split experts' all-reduce) bytes follow the step's own routing, every microbatch's
        predicted = step_communication(config, layout, seq, pp_rank=coord.get("pp", 0), routing=routings[1])
        assert {k: v for k, v in predicted.items() if v} == {k: v for k, v in comm.items() if v}, (name, coord)
