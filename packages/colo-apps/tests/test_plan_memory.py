"""`colo.apps.plan`'s memory and communication model against what colo actually does, layout by layout.

For each layout a 2-rank run of the tiny / bench-25m Llama through the Booster takes two steps; the model's
predictions are compared with:

- static memory: `memory_report()` of the chunk optimizer (params, grads, masters, optimizer states, padding),
  exactly, on every rank; the pooled buffers (`workspace`) against the model's upper bound. torch DDP has no
  report: its parameters, gradients and AdamW state are counted from their storages;
- activations: the bytes of the distinct non-parameter storages the step's forward saves for backward, read with
  `torch.autograd.graph.saved_tensors_hooks` (one microbatch), within 2% (the model counts the Llama layer's saved
  tensors; small saved tensors outside the layers, such as an empty placeholder, make the difference);
- communication: `CommTracker`'s bytes of the second step per (collective, axis), exactly.

Many layouts run in one spawn of the warm 2-rank pool (each boost costs a few hundred milliseconds).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

SEQ, ROWS = 32, 4
SHAPES = {"tiny": (ROWS, SEQ), "bench-25m": (2, 8)}
"""(rows per step, tokens per row) per model: bench-25m's steps are kept short (its memory does not depend on them)."""

# (name, preset, plugin fields, Layout fields, microbatches)
LAYOUTS = [
    ("ddp-fp32", "tiny", {"plugin": "ddp", "precision": "fp32"}, 1),
    ("zero0-fp32", "tiny", {"plugin": "zero", "zero_stage": 0, "precision": "fp32"}, 1),
    ("zero1-fp32", "tiny", {"plugin": "zero", "zero_stage": 1, "precision": "fp32"}, 2),
    ("zero2-fp32", "tiny", {"plugin": "zero", "zero_stage": 2, "precision": "fp32"}, 2),
    ("zero3-fp32", "tiny", {"plugin": "zero", "zero_stage": 3, "precision": "fp32"}, 1),
    ("zero0-bf16", "tiny", {"plugin": "zero", "zero_stage": 0, "precision": "bf16"}, 2),
    ("zero1-bf16", "tiny", {"plugin": "zero", "zero_stage": 1, "precision": "bf16"}, 1),
    ("zero2-bf16", "tiny", {"plugin": "zero", "zero_stage": 2, "precision": "bf16"}, 1),
    ("zero3-bf16", "tiny", {"plugin": "zero", "zero_stage": 3, "precision": "bf16"}, 1),
    ("zero2-offload", "tiny", {"plugin": "zero", "zero_stage": 2, "precision": "fp32", "offload_optimizer": True}, 1),
    ("zero1-chunk4096", "tiny", {"plugin": "zero", "zero_stage": 1, "precision": "fp32", "chunk_numel": 4096}, 1),
    ("gemini-fp32", "tiny", {"plugin": "gemini", "precision": "fp32"}, 1),
    ("ckpt-full", "tiny", {"plugin": "zero", "zero_stage": 2, "activation_checkpointing": "full"}, 1),
    ("ckpt-offload", "tiny", {"plugin": "zero", "zero_stage": 1, "activation_checkpointing": "offload"}, 1),
    ("hybrid-zero2", "tiny", {"plugin": "hybrid", "dp": 2, "zero_stage": 2, "precision": "fp32"}, 2),
    ("tp2-zero1", "tiny", {"plugin": "hybrid", "tp": 2, "zero_stage": 1, "precision": "fp32"}, 1),
    ("tp2-bf16", "tiny", {"plugin": "hybrid", "tp": 2, "zero_stage": 0, "precision": "bf16"}, 1),
    ("tp2-megatron-sp", "tiny", {"plugin": "hybrid", "tp": 2, "sp_mode": "megatron", "precision": "fp32"}, 1),
    (
        "sp2-ulysses",
        "tiny",
        {"plugin": "hybrid", "sp": 2, "sp_mode": "ulysses", "zero_stage": 2, "precision": "fp32"},
        1,
    ),
    ("sp2-ring", "tiny", {"plugin": "hybrid", "sp": 2, "sp_mode": "ring", "zero_stage": 1, "precision": "fp32"}, 1),
    ("pp2-1f1b", "tiny", {"plugin": "hybrid", "pp": 2, "zero_stage": 1, "precision": "fp32"}, 2),
    (
        "pp2-bf16-gpipe",
        "tiny",
        {"plugin": "hybrid", "pp": 2, "zero_stage": 0, "precision": "bf16", "schedule": "gpipe"},
        4,
    ),
    ("bench25m-tp2-zero1", "bench-25m", {"plugin": "hybrid", "tp": 2, "zero_stage": 1, "precision": "fp32"}, 1),
    ("tp2-ckpt-full", "tiny", {"plugin": "hybrid", "tp": 2, "zero_stage": 1, "activation_checkpointing": "full"}, 1),
    ("bench25m-zero2", "bench-25m", {"plugin": "zero", "zero_stage": 2, "precision": "fp32"}, 1),
    ("ddp-ckpt-full", "tiny", {"plugin": "ddp", "precision": "fp32", "activation_checkpointing": "full"}, 1),
    (
        "tp2-bf16-ckpt-offload",
        "tiny",
        {"plugin": "hybrid", "tp": 2, "zero_stage": 0, "precision": "bf16", "activation_checkpointing": "offload"},
        1,
    ),
    (
        "ulysses-ckpt-full",
        "tiny",
        {"plugin": "hybrid", "sp": 2, "sp_mode": "ulysses", "activation_checkpointing": "full"},
        1,
    ),
    (
        "zero1-ckpt-offload-bf16",
        "tiny",
        {"plugin": "zero", "zero_stage": 1, "activation_checkpointing": "offload", "precision": "bf16"},
        1,
    ),
]


def _layout(fields: dict, microbatches: int, preset: str = "tiny"):
    from colo.apps.plan import Layout

    rows = SHAPES[preset][0]
    rows_per_data_rank = rows // fields.get(
        "dp", 2 // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("sp", 1))
    )
    fields = dict(fields)
    dp = fields.pop("dp", 2 // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("sp", 1)))
    return Layout(dp=dp, micro_batch_size=rows_per_data_rank // microbatches, num_microbatches=microbatches, **fields)


def _saved_bytes(model_state, step, batch):
    """Run ``fn`` with a saved-tensor hook; returns the bytes of distinct saved storages that are not model state
    (parameters, and buffers such as the rotary tables)."""
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        params = {t.untyped_storage().data_ptr() for t in model_state}  # where they are now (stage 3 gathers)
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(batch)
    return sum(seen.values())


def _measure(cases):
    from colo.apps import Booster, Llama, get_preset
    from colo.comm import CommTracker

    results = []
    import time

    for name, preset, fields, microbatches in cases:
        began = time.perf_counter()
        layout = _layout(fields, microbatches, preset)
        num_rows, seq = SHAPES[preset]
        torch.manual_seed(0)
        config = get_preset(preset)
        model = Llama(config)
        booster = Booster(layout.plugin_object())
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        engine = booster.engine
        mesh = engine.mesh
        rows = num_rows // mesh.size("dp")
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (num_rows, seq), generator=generator)
        start = mesh.rank("dp") * rows
        batch = {"input_ids": ids[start : start + rows], "labels": ids[start : start + rows].clone()}
        booster.train_step(batch)
        measured_activations = None
        if layout.pp == 1 and microbatches == 1:
            model_state = [*engine.model.parameters(), *engine.model.buffers()]
            measured_activations = _saved_bytes(model_state, booster.train_step, batch)
        with CommTracker() as tracker:
            booster.train_step(batch)
        comm: dict = {}
        for record in tracker.records:
            if record.group_size > 1:
                comm[(record.op, record.axis)] = comm.get((record.op, record.axis), 0.0) + record.bytes
        optimizer = engine.optimizer
        report = None
        if hasattr(optimizer, "memory_report"):
            report = optimizer.memory_report()
            if layout.plugin == "gemini":
                report = {tier: (t.params, t.optimizer) for tier, t in report.tiers.items()}
            else:
                report = {
                    k: getattr(report, k)
                    for k in ("params", "grads", "masters", "optimizer_states", "padding", "host", "workspace")
                }
        else:  # torch DDP: count the storages of parameters, gradients and optimizer state
            storages = {}
            for p in engine.model.parameters():
                for t in (p, p.grad):
                    if t is not None:
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
            report = {"total": sum(storages.values())}
        coord = {axis: mesh.rank(axis) for axis in mesh.axis_names}
        results.append((name, report, measured_activations, comm, coord, time.perf_counter() - began))
    return results


@pytest.fixture(scope="module")
def measured():
    results = run_distributed(_measure, LAYOUTS, world_size=2, timeout=240)
    print({r[0]: round(r[5], 2) for r in results[0]})
    return results


def _data_rank(layout, coord):
    return coord.get("dp", 0) * layout.sp + coord.get("sp", 0)


@pytest.mark.parametrize("case", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_static_memory_equals_memory_report(case, measured):
    from colo.apps import get_preset
    from colo.apps.plan import static_memory

    name, preset, fields, microbatches = case
    layout = _layout(fields, microbatches, preset)
    config = get_preset(preset)
    for rank_results in measured:
        report, coord = next((r[1], r[4]) for r in rank_results if r[0] == name)
        predicted = static_memory(config, layout, pp_rank=coord.get("pp", 0), data_rank=_data_rank(layout, coord))
        if layout.plugin == "ddp":
            assert predicted.total == report["total"]
        elif layout.plugin == "gemini":  # every chunk on the device: the compute shards, and masters + grads + moments
            assert report["device"] == (
                predicted.params,
                predicted.masters + predicted.grads + predicted.optimizer_states - 4 * predicted.num_chunks,
            )
        else:
            for key in ("params", "grads", "masters", "optimizer_states", "padding", "host"):
                assert getattr(predicted, key) == report[key], key
            assert report["workspace"] <= predicted.workspace


# stage 3 and Gemini install saved-tensor hooks of their own (a gathered weight is not kept), which hide the saves
# from an outer hook; pipelines save per microbatch in their own executor
ACTIVATION_CASES = [
    c for c in LAYOUTS if c[3] == 1 and "pp" not in c[2] and c[2].get("zero_stage") != 3 and c[2]["plugin"] != "gemini"
]


@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=[c[0] for c in ACTIVATION_CASES])
def test_activation_bytes_match_saved_tensors(case, measured):
    from colo.apps import get_preset
    from colo.apps.plan import activation_memory

    name, preset, fields, microbatches = case
    layout = _layout(fields, microbatches, preset)
    predicted = activation_memory(get_preset(preset), layout, SHAPES[preset][1])
    for rank_results in measured:
        value = next(r[2] for r in rank_results if r[0] == name)
        expected = predicted.per_microbatch
        # 2%: the model counts the layers' saved tensors; the loss's empty placeholder and the like are left out
        assert value == pytest.approx(expected, rel=0.02), (name, value, expected, value - expected)


@pytest.mark.parametrize("case", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_communication_bytes_equal_comm_tracker(case, measured):
    from colo.apps import get_preset
    from colo.apps.plan import step_communication

    name, preset, fields, microbatches = case
    layout = _layout(fields, microbatches, preset)
    config = get_preset(preset)
    for rank_results in measured:
        comm, coord = next((r[3], r[4]) for r in rank_results if r[0] == name)
        predicted = step_communication(config, layout, SHAPES[preset][1], pp_rank=coord.get("pp", 0))
        measured_nonzero = {k: v for k, v in comm.items() if v}
        assert {k: v for k, v in predicted.items() if v} == measured_nonzero
