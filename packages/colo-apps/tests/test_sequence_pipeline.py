"""Sequence parallelism with pipelines: pp2 x sp2 (Ulysses, ring) and pp2 x tp2 + Megatron-SP (and, for its checkpoint,
sp2 Ulysses x dp2 without a pipeline) on colo's native tiny Llama match the single-process model over 5 AdamW steps,
evaluate to its loss, and save checkpoints that load in one process with every tensor equal and every parameter
present.

Activations cross the stage boundary as sequence shards ``(batch, seq / sp, hidden)`` (``seq / tp`` under
Megatron-SP), with this rank's tokens' global positions beside them (zigzag for ring attention); the last stage's
loss is its shard's summed cross-entropy over the microbatch's labelled targets (`sharded_causal_lm_loss`). One
step trains on packed rows: their positions and the whole sequence's document ids reach every stage and shard.

Tolerances (fp32), as in test_booster_hybrid.py: losses rtol 1e-5; parameters rtol 1e-5, atol 1e-4. Not
bit-identical: the shards' losses and gradients are summed over ranks and microbatches in another order, ring
attention merges softmax blocks, and AdamW amplifies the rounding of near-zero gradient entries to ~1e-5 (a
sharding mistake moves weights by ~lr = 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, ROWS, SEQ, LR, MICROBATCHES = 5, 4, 16, 1e-2, 2

LAYOUTS = {  # the settings, and whether the batches carry position_ids (packed rows at step PACKED_STEP)
    "pp2-sp2-ulysses": ({"pp": 2, "sp": 2, "sp_mode": "ulysses"}, False),
    "pp2-sp2-ring": ({"pp": 2, "sp": 2, "sp_mode": "ring"}, True),
    "pp2-tp2-megatron": ({"pp": 2, "tp": 2, "sp_mode": "megatron"}, True),
    # zero-bubble: the weight-gradient steps apart (Megatron-SP is refused with it, see below)
    "pp2-sp2-ulysses-zbh1": ({"pp": 2, "sp": 2, "sp_mode": "ulysses", "schedule": "zero_bubble_h1"}, True),
    # ZeRO-2 / ZeRO-3 under the pipeline (over dp x sp: sp replicates the weights), ZeRO-3 with zero-bubble's W steps
    "pp2-sp2-ulysses-zbh1-zero3": (
        {"pp": 2, "sp": 2, "sp_mode": "ulysses", "schedule": "zero_bubble_h1", "zero_stage": 3},
        True,
    ),
    "pp2-sp2-ring-zero2": ({"pp": 2, "sp": 2, "sp_mode": "ring", "zero_stage": 2}, True),
    "pp2-tp2-megatron-zero3": ({"pp": 2, "tp": 2, "sp_mode": "megatron", "zero_stage": 3}, True),
    # no pipeline: the checkpoint of a fused q/k/v weight replicated over sp (no tensor-parallel layout)
    "sp2-ulysses-dp2": ({"sp": 2, "sp_mode": "ulysses"}, False),
}


def make_model(seed: int = 0):
    from colo.apps import Llama, get_preset

    torch.manual_seed(seed)
    model = Llama(get_preset("tiny"))
    model.init_weights(seed)
    return model


PACKED_STEP = 3
DOCUMENTS = [(5, 11), (16,), (3, 6, 7), (9, 7)]  # document lengths of the packed rows of step PACKED_STEP


def global_batch(step: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """Random rows; with ``packed``, every batch carries ``position_ids`` (as a packed run's do; the pipeline fixes
    what crosses a stage boundary at its first step) and at step `PACKED_STEP` the rows are packed documents
    (positions restarting per document, ``-100`` on each document's first label), whose positions and document ids
    must reach every stage and sequence shard."""
    generator = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 128, (ROWS, SEQ), generator=generator)
    if not packed:
        return {"input_ids": tokens, "labels": tokens.clone()}
    if step != PACKED_STEP:
        return {"input_ids": tokens, "labels": tokens.clone(), "position_ids": torch.arange(SEQ).expand(ROWS, -1)}
    labels, positions = tokens.clone(), torch.zeros_like(tokens)
    for row, lengths in enumerate(DOCUMENTS):
        starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
        labels[row, starts] = -100
        positions[row] = torch.cat([torch.arange(length) for length in lengths])
    return {"input_ids": tokens, "labels": labels, "position_ids": positions}


def microbatch_loss(model, batch) -> torch.Tensor:
    """The pipeline's loss: the mean of its microbatches' mean losses."""
    halves = [{k: v.chunk(MICROBATCHES)[i] for k, v in batch.items()} for i in range(MICROBATCHES)]
    return sum(model(**half).loss for half in halves) / MICROBATCHES


def reference_run(packed: bool = False):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = microbatch_loss(model, global_batch(step, packed))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = microbatch_loss(model, global_batch(PACKED_STEP, packed)).item()
    return losses, eval_loss, {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_slice(reference: dict[str, torch.Tensor], name: str, param) -> torch.Tensor:
    """The slice of the reference that the parallel parameter ``name`` holds (q, k, v are row blocks of the fused
    ``qkv_proj.weight``; a tensor-parallel shard is a slice of its layout)."""
    from colo.apps import get_preset
    from colo.tensor import layout_of

    module_name, _, attr = name.rpartition(".")
    full = reference.get(name)
    if attr in ("q_weight", "k_weight", "v_weight"):
        config = get_preset("tiny")
        heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
        rows = [n * config.head_dim for n in heads]
        full = reference[f"{module_name}.weight"].split(rows)["qkv".index(attr[0])]
    layout = layout_of(param)
    return full if layout is None else layout.local_slice(full)


def _train_layouts(layouts, root):
    """Every layout in turn on the same 4 ranks: 5 steps, an evaluation, a checkpoint."""
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel

    references = {packed: reference_run(packed) for packed in (False, True)}
    results = {}
    for name, (settings, packed) in layouts.items():
        expected_losses, expected_eval, expected = references[packed]
        booster = Booster(HybridParallel(**{"num_microbatches": MICROBATCHES, "zero_stage": 1, **settings}))
        model = make_model()
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
        mesh = booster.engine.mesh
        rows, first = ROWS // mesh.size("dp"), mesh.rank("dp") * (ROWS // mesh.size("dp"))

        # this data rank's rows (equal labelled counts per row: the mean of the data ranks' means is the mean)
        batches = [{k: v[first : first + rows] for k, v in global_batch(step, packed).items()} for step in range(STEPS)]
        losses = [booster.train_step(batch).loss for batch in batches]
        eval_loss = booster.mean_over_data_ranks(booster.eval_step(batches[PACKED_STEP]))
        params = booster.engine.optimizer.full_params()
        named = dict(booster.engine.model.named_parameters())
        mismatches = []
        for param_name, value in params.items():
            try:
                torch.testing.assert_close(
                    value, reference_slice(expected, param_name, named[param_name]), rtol=1e-5, atol=1e-4
                )
            except AssertionError as error:
                mismatches.append(f"{param_name}: {error}")
        booster.save(f"{root}/{name}")
        shapes = None
        if settings.get("pp", 1) > 1:
            executor = booster.engine.executor  # what crossed the stage boundary: this rank's sequence shard
            boundary = executor._meta_sent.get(1) or executor._meta_recv.get(1)
            shapes = {key: tuple(t.shape) for key, t in zip(boundary.keys or ("x",), boundary.tensors)}
        results[name] = (losses, expected_losses, eval_loss, expected_eval, len(params), mismatches, shapes)
    return results


def _load_in_one_process(path):
    """A fresh model loads the checkpoint; every parameter equals what the checkpoint holds, bit for bit."""
    from colo.apps import Booster, Zero
    from colo.apps.booster.plans import checkpoint_manifest
    from colo.tensor.checkpoint import load_checkpoint, read_index

    model = make_model(seed=1)  # another initialisation: everything must come from the checkpoint
    booster = Booster(Zero(stage=0))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    booster.load(path)
    index = read_index(path)
    stored = {name: torch.empty(entry.shape, dtype=entry.dtype) for name, entry in index.tensors.items()}
    load_checkpoint(path, stored)
    unequal = []
    loaded = {}
    for name, p in model.named_parameters():
        value = p.detach().clone()
        if name.endswith("qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            expected = torch.cat([stored[f"{prefix}{part}_proj.weight"] for part in "qkv"])
        else:
            expected = stored[name]
        if not torch.equal(value, expected):
            unequal.append(name)
        loaded[name] = value
    missing = sorted(set(checkpoint_manifest(make_model())) - set(index.tensors))
    return loaded, unequal, missing


def test_sequence_parallel_pipelines_match_the_single_process_llama(tmp_path):
    results = run_distributed(_train_layouts, LAYOUTS, str(tmp_path), world_size=4)
    for rank_results in results:
        for name, result in rank_results.items():
            losses, expected_losses, eval_loss, expected_eval, num_params, mismatches, shapes = result
            settings, packed = LAYOUTS[name]
            local_seq = SEQ // settings.get("sp", settings.get("tp"))
            if shapes is not None:
                assert shapes["x"] == (ROWS // MICROBATCHES, local_seq, 64), name
            if shapes is not None and settings.get("sp", 1) > 1:  # the shard's global positions travel with it
                assert shapes["position_ids"] == (ROWS // MICROBATCHES, local_seq), name
            assert losses == pytest.approx(expected_losses, rel=1e-5), name
            assert eval_loss == pytest.approx(expected_eval, rel=1e-5), name
            assert num_params > 0 and not mismatches, (name, mismatches)
    for name, (_, packed) in LAYOUTS.items():
        expected = reference_run(packed)[2]
        loaded, unequal, missing = run_distributed(_load_in_one_process, str(tmp_path / name), world_size=1)[0]
        assert not unequal and not missing, (name, unequal, missing)
        for param_name, value in loaded.items():  # the saved masters are the trained parameters
            torch.testing.assert_close(value, expected[param_name], rtol=1e-5, atol=1e-4, msg=f"{name}: {param_name}")


def test_bad_sequence_layouts_are_refused_before_any_collective():
    # no process group exists in this process: a check that communicated would fail differently
    from colo.apps.booster import HybridParallel
    from colo.apps.booster.llama_plan import LlamaPlan
    from colo.apps.booster.plans import ModelPlan

    plan, model = LlamaPlan(), make_model()
    odd = {"input_ids": torch.zeros(2, 15, dtype=torch.long), "labels": torch.zeros(2, 15, dtype=torch.long)}
    six = {key: value[:, :6] for key, value in odd.items()}
    megatron = HybridParallel(tp=2, pp=2, sp_mode="megatron", num_microbatches=2)
    ring = HybridParallel(sp=2, pp=2, sp_mode="ring", num_microbatches=2)
    for prepare in (plan.prepare_batch, plan.prepare_pipeline_batch):
        with pytest.raises(ValueError, match="sequence length 15 does not divide by tp=2.*multiple of tp"):
            prepare(odd, mesh=None, plugin=megatron)
        # ring attention's zigzag layout cuts a sequence into 2 * sp chunks
        with pytest.raises(ValueError, match=r"sequence length 6 does not divide into 4 chunks \(sp=2, zigzag"):
            prepare(six, mesh=None, plugin=ring)
    # a plan that does not cut sequences for its stages (the base ModelPlan) refuses sp with a pipeline
    with pytest.raises(ValueError, match="ModelPlan does not cut sequences for pipeline stages"):
        ModelPlan().prepare_pipeline_batch(six, mesh=None, plugin=ring)
    with pytest.raises(ValueError, match="sp_mode='megatron' with schedule='zero_bubble_h1' is not supported"):
        HybridParallel(tp=2, pp=2, sp_mode="megatron", schedule="zero_bubble_h1", num_microbatches=2)
    with pytest.raises(ValueError, match=r"num_heads=4 does not divide by sp=8") as error:
        plan.check(model, HybridParallel(sp=8, pp=2, sp_mode="ulysses", num_microbatches=2))
    assert error.value.field == "sp"
