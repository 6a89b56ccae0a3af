"""Reward-model and DPO training under DDP dp2, ZeRO-2 dp2 and ZeRO-3 dp2 (colo's native Llama) and HybridParallel
tp2 (DPO on a ``transformers`` Llama, whose plan gathers the logits) match the single-process run over 5 AdamW
steps: the loss of every step and every parameter at the end. Each rank runs its data-parallel share of the pairs
(chosen and rejected of a pair always together); the DPO reference log-probs are precomputed through the boosted
model (every rank an equal share, all-gathered) and must equal the single-process ones.

Tolerances (fp32): losses rtol 1e-5; parameters rtol 1e-5 / atol 1e-4. Not bit-identical: the data-parallel mean
of per-rank means and ZeRO's reduce-scatter sum gradients in another order than one process, and AdamW turns the
rounding of near-zero gradient entries into steps of up to lr.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, PAIRS, LR = 5, 4, 1e-2
EPS = 1e-6
"""AdamW's eps: the reward model's gradients are small (norm ~0.03), and with torch's default 1e-8 AdamW turns the
rounding of near-zero entries (rare tokens' embedding rows) into steps of ~lr (measured: 5e-4 apart after 5 steps
between the data-parallel and the single-process sums). 1e-6 keeps those rounding steps below the tolerance while
every real gradient entry (>> 1e-6) still moves by ~lr."""


def pairs():
    from colo.apps.data import ByteTokenizer
    from colo.apps.rlhf import PreferenceDataset, arithmetic_records

    return PreferenceDataset(arithmetic_records(PAIRS * STEPS, seed=5), ByteTokenizer(), seq_len=16)


def batch_of(dataset, step, rows=slice(None)):
    from colo.apps.data import collate

    items = [dataset[i] for i in range(step * PAIRS, (step + 1) * PAIRS)][rows]
    return collate(items)


def native_model(task):
    from colo.apps import Llama, get_preset
    from colo.apps.rlhf import attach_pair_forward, make_reward_model

    model = Llama(get_preset("tiny", vocab_size=320))
    model.init_weights(0)
    if task == "rm":
        make_reward_model(model, seed=1)
    attach_pair_forward(model, head="reward" if task == "rm" else "logps", pad_id=258)
    return model


def hf_model():
    import transformers

    from colo.apps.rlhf import attach_pair_forward

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return attach_pair_forward(transformers.LlamaForCausalLM(config), head="logps", pad_id=258)


def criterion_for(task):
    from colo.apps.rlhf import PreferenceCriterion, RewardCriterion

    return RewardCriterion() if task == "rm" else PreferenceCriterion("sigmoid", beta=0.5)


def single_process(task, make):
    from colo.apps.rlhf import WithReferenceLogps, precompute_reference_logps

    dataset, model, criterion = pairs(), make(), criterion_for(task)
    table = None
    if task == "dpo":
        table = precompute_reference_logps(model, dataset, batch_size=PAIRS)
        dataset = WithReferenceLogps(dataset, table)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        batch = batch_of(dataset, step)
        loss = criterion(model(**batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}, table


def _train(task, runs):
    from colo.apps import DDP, Booster, HybridParallel, Zero
    from colo.apps.rlhf import WithReferenceLogps, precompute_reference_logps
    from colo.tensor import layout_of

    results = {}
    for label, plugin_name, settings in runs:
        make = hf_model if plugin_name == "hybrid" else (lambda: native_model(task))
        expected_losses, expected, expected_table = single_process(task, make)
        plugin = {"ddp": DDP, "zero": Zero, "hybrid": HybridParallel}[plugin_name](max_grad_norm=1.0, **settings)
        model, booster, criterion = make(), Booster(plugin), criterion_for(task)
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), criterion=criterion)
        mesh = booster.engine.mesh
        dp, rank = mesh.size("dp"), mesh.rank("dp")
        dataset = pairs()
        if task == "dpo":
            table = precompute_reference_logps(
                booster.engine.forward, dataset, batch_size=2, num_replicas=dp, rank=rank
            )
            torch.testing.assert_close(table, expected_table, rtol=1e-6, atol=1e-5)
            dataset = WithReferenceLogps(dataset, table)
        share = PAIRS // dp
        losses = [
            booster.train_step(batch_of(dataset, step, slice(rank * share, (rank + 1) * share))).loss
            for step in range(STEPS)
        ]
        if plugin_name == "ddp":
            params = {n.removeprefix("module."): p.detach() for n, p in booster.unwrap().named_parameters()}
            named = {}
        else:
            params = booster.engine.optimizer.full_params()
            named = dict(booster.engine.model.named_parameters())
        mismatches = []
        for name, value in params.items():
            reference = expected[name]
            layout = layout_of(named[name]) if name in named else None
            if layout is not None:  # a tensor-parallel shard: the matching slice
                reference = layout.local_slice(reference)
            try:
                torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-4)
            except AssertionError as error:
                mismatches.append(f"{label} {name}: {error}")
        results[label] = (losses, expected_losses, len(params), mismatches)
    return results


NATIVE_RUNS = [("ddp-dp2", "ddp", {}), ("zero2-dp2", "zero", {"stage": 2}), ("zero3-dp2", "zero", {"stage": 3})]


@pytest.mark.parametrize("task", ["rm", "dpo"])
def test_native_llama_under_ddp_zero2_zero3_matches_one_process(task):
    for rank_results in run_distributed(_train, task, NATIVE_RUNS, world_size=2, timeout=120):
        for label, (losses, expected_losses, num_params, mismatches) in rank_results.items():
            torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=0, msg=label)
            assert num_params > 0 and not mismatches, mismatches[:3]


def test_hf_llama_dpo_under_tp2_matches_one_process():
    pytest.importorskip("transformers")
    runs = [("tp2", "hybrid", {"tp": 2, "zero_stage": 0})]
    for rank_results in run_distributed(_train, "dpo", runs, world_size=2, timeout=120):
        losses, expected_losses, num_params, mismatches = rank_results["tp2"]
        torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=0)
        assert num_params > 0 and not mismatches, mismatches[:3]
