"""ZeRO-2 and ZeRO-3 under a pipeline (`HybridParallel(pp=2, zero_stage=2 | 3)`, pp2 x dp2 on 4 CPU ranks) match the
single-process model over 5 AdamW steps: the loss of every step and every parameter at the end (the fp32 masters
gathered over ``dp``). Gradients accumulate in full over the step's microbatches and each chunk is reduce-scattered
once after the last backward (``grad_reduction="step"``), so a zero-bubble schedule's W steps (no gradient hooks)
and the sum of an embedding tied across the first and the last stage are both in it; at stage 3 each chunk is
gathered once per step and held until then. Also here: a checkpoint saved at pp2 x dp2 ZeRO-3 loads in one process
with every tensor equal to the saved one.

Tolerances (fp32): losses rtol 1e-5; parameters rtol 1e-5, atol 1e-4. Not bit-identical: microbatches and data
ranks sum their gradients in another order than the single process, and a zero-bubble schedule's split backward
adds the weight gradient's pieces in another order; AdamW moves each weight by about lr * g / (|g| + eps), which
amplifies the rounding of near-zero gradient entries to ~1e-5 (a sharding mistake moves weights by ~lr = 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, ROWS, SEQ, LR, VOCAB = 5, 8, 16, 1e-2, 128
CHUNK_NUMEL = 8192
"""Several chunks per stage of the tiny Llama: gathering and reduction are per chunk, with prefetch."""
FP32 = {"rtol": 1e-5, "atol": 1e-4}


def make_model(tied: bool, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    from colo.apps import Llama, get_preset

    torch.manual_seed(seed)
    model = Llama(get_preset("tiny", tie_word_embeddings=tied, num_hidden_layers=layers))
    model.init_weights(seed)
    return model


def global_batch(step: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(500 + step))
    return {"input_ids": tokens, "labels": tokens.clone()}


def local_batch(step: int, mesh) -> dict[str, torch.Tensor]:
    """This data rank's rows of the step's global batch."""
    rows = ROWS // mesh.size("dp")
    start = mesh.rank("dp") * rows
    return {k: v[start : start + rows] for k, v in global_batch(step).items()}


def reference_run(tied: bool, steps: int = STEPS, layers: int = 2):
    """The single-process run: its losses and parameters (every name of a tied one) after ``steps`` steps."""
    model = make_model(tied, layers=layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = model(**global_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def reference_piece(reference: dict[str, torch.Tensor], name: str, param: torch.nn.Parameter) -> torch.Tensor:
    """The piece of the reference that the stage's parameter ``name`` holds: ``*.qkv_proj.{q,k,v}_weight`` are row
    blocks of the reference's fused ``*.qkv_proj.weight``; a tensor-parallel shard is its layout's slice."""
    from colo.apps import get_preset
    from colo.tensor import layout_of

    module, _, leaf = name.rpartition(".")
    whole = reference[name] if leaf not in ("q_weight", "k_weight", "v_weight") else None
    if whole is None:
        config = get_preset("tiny")
        heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
        whole = reference[f"{module}.weight"].split([n * config.head_dim for n in heads])["qkv".index(leaf[0])]
    layout = layout_of(param)
    return layout.local_slice(whole) if layout is not None else whole


def boost(tied: bool, layers: int = 2, seed: int = 0, **settings):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel

    model = make_model(tied, seed=seed, layers=layers)
    settings = {"pp": 2, "num_microbatches": 4, "chunk_numel": CHUNK_NUMEL, **settings}
    booster = Booster(HybridParallel(**settings))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return booster


def _train_against_reference(tied: bool, settings: dict):
    settings = dict(settings)
    layers = settings.pop("layers", 2)
    expected_losses, expected = reference_run(tied, layers=layers)
    booster = boost(tied, layers, **settings)
    zero = booster.engine.optimizer
    losses = [booster.train_step(local_batch(step, booster.mesh)).loss for step in range(STEPS)]
    params = zero.full_params()
    named = dict(booster.engine.model.named_parameters())
    found = []
    for name, value in params.items():
        try:
            torch.testing.assert_close(value, reference_piece(expected, name, named[name]), **FP32)
        except AssertionError as error:
            found.append(f"{name}: {error}")
    shards = [chunk.shard_numel * 2 == chunk.numel for chunk in zero.trainable_chunks]
    gathered = [] if zero.gatherer is None else [c.index for c in zero.chunks if zero.gatherer.is_gathered(c)]
    gathers = None if zero.gatherer is None else zero.gatherer.num_gathers
    return losses, expected_losses, sorted(params), found, all(shards), gathered, gathers, len(zero.chunks)


INTERLEAVED = {"schedule": "interleaved_1f1b", "num_model_chunks": 2, "layers": 4}
"""Two model chunks per pipeline rank (4 stages of one layer each)."""


@pytest.mark.parametrize(
    "stage, settings, tied, world_size",
    [
        (2, {"schedule": "1f1b"}, False, 4),
        (2, {"schedule": "zero_bubble_h1"}, True, 4),
        (2, {"schedule": "gpipe"}, True, 4),
        (3, {"schedule": "1f1b"}, True, 4),
        (3, {"schedule": "zero_bubble_h1"}, False, 4),
        (3, INTERLEAVED, True, 4),
        (3, {"schedule": "1f1b", "tp": 2}, False, 8),
    ],
    ids=[
        "zero2-1f1b",
        "zero2-zbh1-tied",
        "zero2-gpipe-tied",
        "zero3-1f1b-tied",
        "zero3-zbh1",
        "zero3-interleaved-tied",
        "tp2-zero3-1f1b",
    ],
)
def test_pp2_dp2_zero_matches_the_single_process_model(stage, settings, tied, world_size):
    """pp2 x dp2 (and pp2 x tp2 x dp2 at 8 ranks, correctness only). A tied embedding is on the first and the last
    stage: its gradient is the two stages' sum, reduce-scattered after it is summed."""
    settings = {"zero_stage": stage, **settings}
    results = run_distributed(_train_against_reference, tied, settings, world_size=world_size)
    for losses, expected_losses, names, found, sharded, gathered, gathers, num_chunks in results:
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert names and not found, found
        assert sharded  # every trainable chunk is split over the two data ranks
        if stage == 3:
            # nothing stays gathered between steps, and each chunk was gathered once per step, not per microbatch
            assert gathered == []
            assert gathers == STEPS * num_chunks
    # the stages together hold every parameter of the model (a tied lm_head is the embedding's copy)
    stage_names = {name for _, _, names, *_ in results for name in names}
    model_names = reference_run(tied, steps=0, layers=settings.get("layers", 2))[1]
    assert stage_names >= {name for name in model_names if "qkv_proj" not in name and name != "lm_head.weight"}


# --- the per-microbatch policy: reduce-scatter (and regather) every microbatch ------------------------------------


@pytest.mark.parametrize(
    "stage, settings",
    [(2, {"schedule": "gpipe"}), (3, {"schedule": "1f1b"}), (3, INTERLEAVED)],
    ids=["zero2-gpipe-microbatch", "zero3-1f1b-microbatch", "zero3-interleaved-microbatch"],
)
def test_the_per_microbatch_policy_matches_the_single_process_model(stage, settings):
    """``pipeline_zero_sync="microbatch"``: every microbatch's backward reduce-scatters from the gradient hooks and
    ZeRO-3 frees each chunk after every use, so a chunk is gathered twice per microbatch (forward and backward);
    interleaved: each model chunk's call is a forward of its own (saved weights stored as chunk positions)."""
    settings = {"zero_stage": stage, "pipeline_zero_sync": "microbatch", **settings}
    for losses, expected_losses, names, found, _, gathered, gathers, num_chunks in run_distributed(
        _train_against_reference, False, settings, world_size=4
    ):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert names and not found, found
        if stage == 3:
            assert gathered == []
            assert gathers > 4 * STEPS * num_chunks  # 4 microbatches, regathered (the kept chunk less often)


MEMORY_LAYERS = 8
"""Four decoder layers per stage, some twenty chunks: the few gathered at once are a small part of the stage."""


def _peak_model_state(settings: dict):
    """This rank's model-state bytes at the peak of a step (an upper bound from colo.zero's own counts): the chunk
    buffers (`MemoryReport.total`) plus every full-chunk buffer that was ever in use at once (the pool's high-water
    mark: gathered parameters and gradient buckets), and, under the ``"step"`` policy, the stage's full gradients
    held in ``.grad`` until the reduction. ZeRO-1's persistent buffers are all in ``total``."""
    booster = boost(False, MEMORY_LAYERS, **settings)
    zero = booster.engine.optimizer
    booster.train_step(local_batch(0, booster.mesh))  # one step: the moments exist, every buffer was in use
    report = zero.memory_report()
    held_grads = 0
    if zero.config.grad_reduction == "step" and zero.config.stage >= 2:
        held_grads = sum(slot.numel * 4 for chunk in zero.trainable_chunks for slot in chunk.slots)
    return report.total + report.workspace + held_grads, report.params, sum(c.numel * 4 for c in zero.chunks)


def test_per_microbatch_zero3_holds_less_than_zero1_at_pp2_dp2():
    """fp32 AdamW: ZeRO-1 keeps the stage's parameters and gradients in full (4 + 4 bytes per parameter) and 1/dp of
    the moments (8/2): 12 bytes per parameter; per-microbatch ZeRO-3 keeps 1/dp of all three ((4 + 4 + 8) / 2 = 8)
    plus the full chunks in use at once: with 1F1B's two microbatches in flight on the first stage about a third of
    the stage's parameters are gathered at the peak, and the pool keeps that many buffers (measured: 0.84x ZeRO-1).
    The ``"step"`` policy holds the full parameters and gradients during the step, as ZeRO-1 does."""
    zero1 = run_distributed(_peak_model_state, {"zero_stage": 1}, world_size=4)
    microbatch = run_distributed(_peak_model_state, {"zero_stage": 3, "pipeline_zero_sync": "microbatch"}, world_size=4)
    step = run_distributed(_peak_model_state, {"zero_stage": 3}, world_size=4)
    for (one, _, _), (three, shard_params, full_params), (held, _, _) in zip(zero1, microbatch, step):
        assert shard_params * 2 == full_params  # parameters: 1/dp of the stage's chunks (padding included)
        assert three < 0.9 * one, (three, one)
        assert held >= one * 0.95, (held, one)


# --- checkpoints: saved at pp2 x dp2 ZeRO-3, loaded in one process ------------------------------------------------


def _save_pipeline_zero3(tied: bool, path: str):
    booster = boost(tied, zero_stage=3)
    for step in range(2):
        booster.train_step(local_batch(step, booster.mesh))
    booster.save(path)
    return [booster.train_step(local_batch(step, booster.mesh)).loss for step in range(2, 4)]


def _load_in_one_process(tied: bool, path: str):
    from colo.apps import Booster, Zero
    from colo.tensor.checkpoint import load_checkpoint, read_index

    model = make_model(tied, seed=1)  # another initialisation: everything must come from the checkpoint
    booster = Booster(Zero(stage=1))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    booster.load(path)
    index = read_index(path)
    stored = {name: torch.empty(entry.shape, dtype=entry.dtype) for name, entry in index.tensors.items()}
    load_checkpoint(path, stored)
    unequal = []
    for name, value in model.named_parameters():  # q, k and v are saved apart and stacked into the fused weight
        if name.endswith("qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            saved = torch.cat([stored[f"{prefix}{part}_proj.weight"] for part in "qkv"])
        else:
            saved = stored[name]
        if not torch.equal(value.detach(), saved):
            unequal.append(name)
    states = booster.engine.optimizer.full_optimizer_states()
    for name, value in states.items():  # <param>/exp_avg: the moments too, bit for bit
        param, _, state = name.rpartition("/")
        if not param.endswith("qkv_proj.weight"):
            if not torch.equal(value, stored[f"optim/{param}/{state}"]):
                unequal.append(name)
    loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = [booster.train_step(global_batch(step)).loss for step in range(2, 4)]
    return loaded, losses, sorted(index.tensors), unequal


def _saved_name(name: str) -> str:
    """The checkpoint's (unfused) name of a parallel parameter: ``qkv_proj.q_weight`` is saved as ``q_proj.weight``."""
    for part in "qkv":
        name = name.replace(f"qkv_proj.{part}_weight", f"{part}_proj.weight")
    return name


def _load_into_layout(settings: dict, path: str, out: str):
    """Load ``path`` into a pipelined layout: every gathered master and moment is the checkpoint's slice (tp) of the
    saved tensor, bit for bit; then save the layout's own checkpoint to ``out``."""
    from colo.tensor import layout_of
    from colo.tensor.checkpoint import load_checkpoint, read_index

    booster = boost(False, seed=1, **settings)  # another initialisation: everything must come from the checkpoint
    booster.load(path)
    index = read_index(path)
    stored = {name: torch.empty(entry.shape, dtype=entry.dtype) for name, entry in index.tensors.items()}
    load_checkpoint(path, stored)
    zero = booster.engine.optimizer
    named = dict(booster.engine.model.named_parameters())
    unequal = []
    tensors = {**zero.full_params(), **zero.full_optimizer_states()}
    for name, value in tensors.items():
        param, _, state = name.partition("/")

        def saved_tensor(saved_name: str, state: str = state) -> torch.Tensor:
            return stored[f"optim/{saved_name}/{state}" if state else saved_name]

        if param.endswith("qkv_proj.weight"):  # without tp the fused weight is the three stacked
            prefix = param.removesuffix("qkv_proj.weight")
            saved = torch.cat([saved_tensor(f"{prefix}{part}_proj.weight") for part in "qkv"])
        else:
            saved = saved_tensor(_saved_name(param))
        layout = layout_of(named[param])
        if not torch.equal(value, layout.local_slice(saved) if layout is not None else saved):
            unequal.append(name)
    booster.save(out)
    return len(tensors), unequal


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_checkpoint_saved_at_pp2_dp2_zero3_loads_in_one_process(tied, tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_pipeline_zero3, tied, path, world_size=4)[0]
    loaded, resumed, names, unequal = run_distributed(_load_in_one_process, tied, path, world_size=1)[0]
    assert unequal == []  # every parameter and moment is the checkpoint's tensor, bit for bit
    _, expected = reference_run(tied, steps=2)  # what the parallel run saved is the single process's state
    for name, value in loaded.items():
        torch.testing.assert_close(value, expected[name], **FP32, msg=name)
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)
    assert "layers.0.self_attn.q_proj.weight" in names and "optim/layers.1.mlp.up_proj.weight/exp_avg" in names
    assert ("lm_head.weight" in names) != tied  # a tied lm_head is saved once, as the embedding


# --- what is refused ---------------------------------------------------------------------------------------------


def test_the_per_microbatch_policy_is_refused_where_it_cannot_work():
    from colo.apps.booster import HybridParallel
    from colo.apps.booster.parallel_dims import UnsupportedLayout

    pipeline = {"pp": 2, "num_microbatches": 2}
    with pytest.raises(UnsupportedLayout, match="split weight-gradient steps fire no gradient hooks") as error:
        HybridParallel(**pipeline, zero_stage=3, schedule="zero_bubble_h1", pipeline_zero_sync="microbatch")
    assert error.value.field == "pipeline_zero_sync"
    with pytest.raises(ValueError, match="'microbatch' is for pp > 1 with zero_stage 2 or 3"):
        HybridParallel(**pipeline, zero_stage=1, pipeline_zero_sync="microbatch")
    with pytest.raises(ValueError, match="pipeline_zero_sync='stage' is unknown"):
        HybridParallel(**pipeline, pipeline_zero_sync="stage")


def _boost_tied_per_microbatch():
    from colo.apps.booster.parallel_dims import UnsupportedLayout

    try:
        boost(True, zero_stage=3, num_microbatches=2, pipeline_zero_sync="microbatch")
    except UnsupportedLayout as error:
        return error.field, str(error)
    return None, None


def test_the_per_microbatch_policy_refuses_embeddings_tied_across_stages():
    for field, message in run_distributed(_boost_tied_per_microbatch, world_size=2):
        assert field == "pipeline_zero_sync"
        assert "tied across pipeline stages (['lm_head.weight'])" in message and "pipeline_zero_sync='step'" in message


# --- colo plan models these layouts ------------------------------------------------------------------------------

PLAN_CASES = [
    ("pp2-dp2-zero3", "tiny", {"plugin": "hybrid", "pp": 2, "dp": 2, "zero_stage": 3, "precision": "fp32"}, 2),
    ("pp2-dp2-zero2-bf16", "tiny", {"plugin": "hybrid", "pp": 2, "dp": 2, "zero_stage": 2, "precision": "bf16"}, 2),
]


def test_colo_plan_models_pipelined_zero_exactly():
    """`colo.apps.plan` against a pp2 x dp2 run (test_plan_memory's measurement, two steps): static memory equal to
    `memory_report()` on every rank (pooled buffers within the planner's bound: at stage 3 every chunk of the stage
    held for the step), communication equal to `CommTracker`'s per (collective, axis): one reduce-scatter per chunk
    per step and, at stage 3, one all-gather per chunk per step; activations within 2% as there."""
    from colo.apps.plan import activation_memory, static_memory, step_communication
    from colo.comm.testing import load_beside

    plan_test = load_beside(__file__, "test_plan_memory.py", module_name="colo_apps_test_plan_memory_for_pp_zero")
    measured = run_distributed(plan_test._measure, PLAN_CASES, world_size=4, timeout=240)
    for name, preset, fields, microbatches in PLAN_CASES:
        layout = plan_test._layout(fields, microbatches, preset)
        config, seq_len = plan_test._config(preset), plan_test.SHAPES[preset][1]
        for rank_results in measured:
            report, activations, comm, coord = next(r[1:5] for r in rank_results if r[0] == name)
            pp_rank = coord["pp"]
            predicted = static_memory(config, layout, pp_rank=pp_rank, data_rank=plan_test._data_rank(layout, coord))
            for key in ("params", "grads", "masters", "optimizer_states", "padding", "host"):
                assert getattr(predicted, key) == report[key], (name, key)
            assert report["workspace"] <= predicted.workspace
            volumes = step_communication(config, layout, seq_len, pp_rank=pp_rank)
            assert {k: v for k, v in volumes.items() if v} == {k: v for k, v in comm.items() if v}, name
            expected = activation_memory(config, layout, seq_len, pp_rank=pp_rank).peak
            assert activations == pytest.approx(expected, rel=0.02), name


def test_a_checkpoint_reshards_from_pp2_dp2_zero3_to_pp2_tp2_zero2_and_back(tmp_path):
    """pp2 x dp2 ZeRO-3 -> pp2 x tp2 ZeRO-2 -> pp2 x dp2 ZeRO-3: each load holds the saved tensors exactly (a tp shard
    the slice of the saved tensor), masters and moments alike."""
    first, second, third = (str(tmp_path / name) for name in ("zero3", "tp2-zero2", "zero3-again"))
    run_distributed(_save_pipeline_zero3, False, first, world_size=4)
    for count, unequal in run_distributed(_load_into_layout, {"tp": 2, "zero_stage": 2}, first, second, world_size=4):
        assert count > 0 and unequal == []
    for count, unequal in run_distributed(_load_into_layout, {"zero_stage": 3}, second, third, world_size=4):
        assert count > 0 and unequal == []


def _live_tensors_after_each_step(steps: int) -> list[int]:
    import gc

    booster = boost(False, zero_stage=3, schedule="zero_bubble_h1")
    counts = []
    for step in range(steps):
        booster.train_step(local_batch(step, booster.engine.mesh))
        gc.collect()
        counts.append(sum(1 for obj in gc.get_objects() if torch.is_tensor(obj)))
    return counts


def test_zero3_under_zb_h1_keeps_no_activations_across_steps():
    """ZB-H1 keeps each microbatch's graph (``retain_graph``) from its B step to its W step; under ZeRO-3 the
    saved-tensor hooks held the saved tensors themselves, a reference cycle through the graph that Python cannot
    collect, so the last stage leaked every step's activations (its RSS grew ~55 MB a step in
    benchmarks/pipeline_zero.py). Live tensors now stay level from step to step on every rank."""
    for counts in run_distributed(_live_tensors_after_each_step, 4, world_size=4):
        assert counts[1] == counts[2] == counts[3], counts


def _first_step_grad_norms() -> list[float]:
    """The first step's gradient norm (before clipping) of pp2 ZeRO-1 (1 data rank, 2 microbatches) in fp32 and in
    fp16 with the loss scaler at its initial 2**16."""
    norms = []
    for precision in ("fp32", "fp16"):
        booster = boost(False, pp=2, num_microbatches=2, zero_stage=1, precision=precision, max_grad_norm=1e9)
        assert (booster.engine.optimizer.loss_scaler is not None) == (precision == "fp16")
        result = booster.train_step(global_batch(0))
        assert not result.skipped
        norms.append(result.grad_norm)
    return norms


def test_a_fp16_pipeline_scales_its_backward_by_the_loss_scale():
    """fp16 under a pipeline: the schedule's backward starts from the loss scaler's scale
    (`PipelineExecutor.loss_scale`), which ZeRO divides out after its overflow check, so the gradients equal fp32's
    (rtol 1e-2 for fp16 compute; measured 1.46038 for 1.46037, 5.8e-6). Before the executor took the scale, the
    pipeline's backward was unscaled and the norm read 2.23e-5: the true gradients divided by 2**16."""
    for fp32, fp16 in run_distributed(_first_step_grad_norms, world_size=2):
        assert fp16 == pytest.approx(fp32, rel=1e-2)
