"""Sequence parallelism for Hugging Face's ``LlamaForCausalLM``: tp2 + Megatron-SP, sp2 Ulysses and sp2 ring attention
(zigzag shards, through transformers 5's ``AttentionInterface``), each x dp2 on 4 ranks, match the single-process
``transformers`` model over 5 AdamW steps (one of them on packed rows), and their checkpoints load in one process
with every tensor equal and every parameter present. Bad input is refused before any collective.

Ulysses and ring ranks feed the model their tokens' global ``position_ids``; a zigzag shard's positions jump
(``0..3, 12..15`` of 16), which transformers would read as packed documents if it built a mask: it builds none for
colo's attention, so the test would fail (the rotary tables or the causal mask of the shard would be wrong) if
either the positions or the mask were local.

Tolerances (fp32), as in test_hf_plans.py: losses rtol 1e-5; parameters rtol 1e-5, atol 1e-4. Not bit-identical:
the shards' losses and gradients are summed over ranks in another order, ring attention merges softmax blocks, and
AdamW amplifies the rounding of near-zero gradient entries to ~1e-5 (a sharding mistake moves weights by ~lr).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, ROWS, SEQ, LR, VOCAB = 5, 4, 16, 1e-2, 128

LAYOUTS = {
    "tp2-megatron-dp2": {"tp": 2, "sp_mode": "megatron"},
    "sp2-ulysses-dp2": {"sp": 2, "sp_mode": "ulysses"},
    "sp2-ring-dp2": {"sp": 2, "sp_mode": "ring"},
}


def make_model(seed: int = 0, attn_implementation: str = "sdpa"):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
    )
    return transformers.LlamaForCausalLM(config)


PACKED_STEP = 3
DOCUMENTS = [(5, 11), (16,), (9, 7), (16,)]  # document lengths of the packed rows (equal labelled targets per dp rank)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Random rows; at step `PACKED_STEP` packed rows: ``position_ids`` restarting per document (transformers masks
    attention between them from the positions; colo's sequence-parallel attention gets their document ids)."""
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(900 + step))
    if step != PACKED_STEP:
        return {"input_ids": tokens, "labels": tokens.clone()}
    labels, positions = tokens.clone(), torch.zeros_like(tokens)
    for row, lengths in enumerate(DOCUMENTS):
        labels[row, torch.tensor([0, *lengths]).cumsum(0)[:-1]] = -100
        positions[row] = torch.cat([torch.arange(length) for length in lengths])
    return {"input_ids": tokens, "labels": labels, "position_ids": positions}


def reference_run():
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**global_batch(step), use_cache=False).loss  # no cache: packed rows masked from positions
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _train_layouts(layouts, root):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel
    from colo.tensor import layout_of

    expected_losses, expected = reference_run()
    results = {}
    for name, settings in layouts.items():
        booster = Booster(HybridParallel(zero_stage=1, **settings))
        model = make_model()
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
        mesh = booster.engine.mesh
        rows, first = ROWS // mesh.size("dp"), mesh.rank("dp") * (ROWS // mesh.size("dp"))
        batches = [{k: v[first : first + rows] for k, v in global_batch(step).items()} for step in range(STEPS)]
        losses = [booster.train_step(batch).loss for batch in batches]
        params = booster.engine.optimizer.full_params()
        named = dict(booster.engine.model.named_parameters())
        mismatches = []
        for param_name, value in params.items():
            layout = layout_of(named[param_name])
            reference = expected[param_name] if layout is None else layout.local_slice(expected[param_name])
            try:
                torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-4)
            except AssertionError as error:
                mismatches.append(f"{param_name}: {error}")
        booster.save(f"{root}/{name}")
        results[name] = (losses, expected_losses, len(params), mismatches)
    return results


def _load_in_one_process(path):
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
    loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
    unequal = [name for name, value in loaded.items() if not torch.equal(value, stored[name])]
    missing = sorted(set(checkpoint_manifest(make_model())) - set(index.tensors))
    return loaded, unequal, missing


def test_hf_llama_sequence_parallelism_matches_the_single_process_model(tmp_path):
    results = run_distributed(_train_layouts, LAYOUTS, str(tmp_path), world_size=4)
    _, expected = reference_run()
    for rank_results in results:
        for name, (losses, expected_losses, num_params, mismatches) in rank_results.items():
            assert losses == pytest.approx(expected_losses, rel=1e-5), name
            assert num_params > 0 and not mismatches, (name, mismatches)
    for name in LAYOUTS:
        loaded, unequal, missing = run_distributed(_load_in_one_process, str(tmp_path / name), world_size=1)[0]
        assert not unequal and not missing, (name, unequal, missing)
        for param_name, value in loaded.items():  # the saved masters are the trained parameters
            torch.testing.assert_close(value, expected[param_name], rtol=1e-5, atol=1e-4, msg=f"{name}: {param_name}")


def test_bad_hf_sequence_layouts_are_refused_before_any_collective():
    # no process group exists in this process: a check that communicated would fail differently
    from colo.apps.booster import HybridParallel, plan_for

    model = make_model()
    plan = plan_for(model)
    odd = {"input_ids": torch.zeros(2, 15, dtype=torch.long), "labels": torch.zeros(2, 15, dtype=torch.long)}
    six = {key: value[:, :6] for key, value in odd.items()}
    with pytest.raises(ValueError, match="sequence length 15 does not divide by tp=2.*multiple of tp"):
        plan.prepare_batch(odd, mesh=None, plugin=HybridParallel(tp=2, sp_mode="megatron"))
    with pytest.raises(ValueError, match=r"sequence length 6 does not divide into 4 chunks \(sp=2, zigzag"):
        plan.prepare_batch(six, mesh=None, plugin=HybridParallel(sp=2, sp_mode="ring"))
    with pytest.raises(ValueError, match=r"num_heads=2 does not divide by sp=4") as error:
        plan.check(model, HybridParallel(tp=2, sp=4, sp_mode="ulysses"))  # 4 heads / tp 2 = 2 per rank
    assert error.value.field == "sp"
    flex = make_model(attn_implementation="flex_attention")
    for sp_mode in ("ulysses", "ring"):
        with pytest.raises(ValueError, match="has attn_implementation='flex_attention'.*attn_implementation='sdpa'"):
            plan.check(flex, HybridParallel(sp=2, sp_mode=sp_mode))
    with pytest.raises(ValueError, match="sp_mode='ring' with pp=2 is not supported for the LlamaForCausalLM"):
        plan.check(model, HybridParallel(sp=2, pp=2, sp_mode="ring", num_microbatches=2))
