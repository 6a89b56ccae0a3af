"""`colo plan`'s model of the DeepSeek-style MoE block under `HybridParallel(ep=...)`, against what colo does.

One 4-rank spawn runs, for each layout, two Booster steps of the DeepSeek-style model (a dense first layer, then MoE
layers of 16 narrow experts top-4 within one of two groups, a shared expert, sigmoid routing with the bias; with
multi-head latent attention, its heads split over tp, or with Llama's attention, which ep x Ulysses / ring sp2 run)
and compares the second step with the planner (`test_plan_memory`'s measurement, reused):

- parameters, gradients, masters, optimizer states and padding: `ExpertParallelZero.memory_report()` exactly on every
  rank (dense chunks over dp x ep, expert chunks over dp, both with sp under Ulysses / ring; a stage's own layers;
  experts split over tp or not);
- activations: the peak bytes autograd holds (`test_plan_memory._HeldActivations`) within 2%, the MoE blocks' rows
  from the step's own routing (a pipeline's last stage holds one microbatch at a time: its peak is the largest);
- communication: `CommTracker`'s bytes per (collective, axis) exactly, the all-to-alls from the step's own routing
  (under sp: Ulysses' all-to-alls or ring attention's k/v blocks, the blocks' all-to-alls of each rank's sequence
  pieces, the balance loss's counts all-reduced over sp);
  the routing itself within `dispatch_bounds` (group-limited to one group = one ep rank: a token's rows all go to
  one rank).
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
        "ep2-tp2-mla-etp-zero2-bf16",
        "tiny-deepseek",
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
    (
        "ep2-sp2-ulysses-zero2-bf16",
        "tiny-deepseek-gqa",
        # chunks of 60000 elements: the expert weights share padded chunks, whose padding lies in the last shards, so
        # each rank's place in the dense (dp x ep x sp) and the expert (dp x sp) groups decides its share
        {
            "plugin": "hybrid",
            "ep": 2,
            "sp": 2,
            "sp_mode": "ulysses",
            "dp": 1,
            "zero_stage": 2,
            "precision": "bf16",
            "chunk_numel": 60000,
        },
        1,
    ),
    (
        "ep2-sp2-ring-zero2-bf16",
        "tiny-deepseek-gqa",
        # ring attention's zigzag pieces: the k/v blocks passed round the sp ring, the MoE blocks as under Ulysses
        {
            "plugin": "hybrid",
            "ep": 2,
            "sp": 2,
            "sp_mode": "ring",
            "dp": 1,
            "zero_stage": 2,
            "precision": "bf16",
            "chunk_numel": 60000,
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


def _activation_peak(config, layout, seq, pp_rank, routing) -> int:
    """The planner's activation peak given the step's routing: per microbatch its own blocks' rows; microbatches in
    flight together add up, one at a time (a pipeline's last stage, or no pipeline) the largest counts."""
    from colo.apps.plan import activation_memory

    one = activation_memory(config, layout, seq, pp_rank=pp_rank)
    per_microbatch = len(routing) // layout.num_microbatches
    peaks = [
        activation_memory(config, layout, seq, pp_rank=pp_rank, routing=routing[i : i + per_microbatch])
        for i in range(0, len(routing), per_microbatch)
    ]
    if one.in_flight == 1:
        return max(p.peak for p in peaks)
    return sum(p.per_microbatch for p in peaks[: one.in_flight])


@pytest.mark.parametrize("case", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_activation_bytes_match_saved_tensors(case, measured):
    name, preset, fields, microbatches = case
    layout = plan_memory._layout(fields, microbatches, preset)
    config = plan_memory._config(preset)
    for rank_results in measured:
        value, routings, coord = next((r[2], r[6], r[4]) for r in rank_results if r[0] == name)
        expected = _activation_peak(config, layout, plan_memory.SHAPES[preset][1], coord.get("pp", 0), routings[1])
        # 2%, as test_plan_memory: small saved tensors outside the layers (the loss's placeholder) are left out
        assert value == pytest.approx(expected, rel=0.02), (name, coord, value, expected)


@pytest.mark.parametrize("case", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_the_step_routing_lies_within_the_dispatch_bounds(case, measured):
    """Every block's rows sent and received lie within `dispatch_bounds`; the DeepSeek-style router limits each token
    to one of two groups, the groups being the ep ranks, so a token reaches one rank: its k rows go there together
    (rows sent and received come in multiples of k)."""
    from colo.apps.plan import dispatch_bounds

    name, preset, fields, microbatches = case
    layout = plan_memory._layout(fields, microbatches, preset)
    config = plan_memory._config(preset)
    bounds = dispatch_bounds(config, layout, layout.micro_batch_size * plan_memory.SHAPES[preset][1])
    assert bounds.max_ranks_per_token == 1  # topk_group=1 of n_group=ep=2
    top_k = config.num_experts_per_tok
    for rank_results in measured:
        routing = next(r[6][1] for r in rank_results if r[0] == name)
        assert routing
        for _, sent, received in routing:
            assert sent <= bounds.max_sent and received <= bounds.max_received
            assert sent % top_k == 0 and received % top_k == 0, (sent, received)
