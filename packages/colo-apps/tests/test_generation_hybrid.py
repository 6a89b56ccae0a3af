"""`RolloutEngine`: rollouts from the weights a Booster trains equal a single-process reference and the trainer's own
recomputed log-probs, under DDP dp2, ZeRO-3 dp2, Gemini dp2, HybridParallel tp2 and LoRA (in place under DDP dp2, and
under ZeRO-3 dp2, where only the adapters are gathered again).

Each rank boosts the native tiny Llama, takes one SGD step on its share of a fixed batch (so the rollout must see
trained weights, not the initial ones), and generates its own prompts (the same on both ranks of a tp group) with
seeded temperature / top-p sampling, n=2. The reference is one process that took the same SGD step on the whole
batch and calls `generate` with the same prompts and seed: its tokens must be the same and its log-probs within
1e-5 (fp32; not zero: the data-parallel mean of per-rank gradients and the tensor-parallel matmuls sum in other
orders; SGD keeps the weight difference at lr times that rounding, where AdamW would amplify it). The trainer's
recompute is `Booster.forward` on `rollout_model_inputs`, through the plugin's own layout (ZeRO-3 gathering with
its hooks, so they must be back in place after the rollout).

Memory of the gathered layouts, by an independent count: after every chunk of the first round's sync, a census of
every live tensor storage in the process (``gc``) may exceed the census before the rollout by at most the rollout
weights plus one chunk; after each round's rollout only the returned `Rollout`'s own tensors are new (the copy is
gone again). The second round's sync runs the same code on other weights: its per-chunk census (a walk over every
Python object per chunk) is left out.
"""

from __future__ import annotations

import gc

import pytest
import torch

from colo.comm.testing import run_distributed

SEED, LR, ROWS_PER_RANK, SEQ = 1234, 0.5, 2, 12
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _model(lora: bool):
    from colo.apps import Llama, get_preset

    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(SEED)
    if lora:
        from colo.apps.lora import add_lora

        torch.manual_seed(SEED)
        add_lora(model, r=4, alpha=8)
    return model


def _batch(dp: int) -> torch.Tensor:
    return torch.randint(0, 128, (ROWS_PER_RANK * dp, SEQ), generator=torch.Generator().manual_seed(7))


def _prompts(dp_rank: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(100 + dp_rank)
    return [torch.randint(0, 128, (length,), generator=generator).tolist() for length in (5, 2, 7)]


def _live_tensor_bytes() -> int:
    """Every distinct tensor storage reachable from Python, in bytes (independent of colo's own counters)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                pointer = storage.data_ptr()
            except RuntimeError:  # fake / functional tensors an earlier compile test left in this worker: no memory
                continue
            if storage.nbytes():
                seen[pointer] = storage.nbytes()
    return sum(seen.values())


def _optimizer(plugin_name: str, model) -> torch.optim.Optimizer:
    """SGD; Gemini steps only Adam: Adam with ``eps=1``, whose first steps move a weight by about ``lr * g / (1 +
    |g|)``, smooth in the gradient like SGD's (a small ``eps`` would turn the gradients' rounding into sign flips)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if plugin_name == "gemini":
        return torch.optim.Adam(trainable, lr=LR, eps=1.0)
    return torch.optim.SGD(trainable, lr=LR)


def _rollout_bytes(rollout) -> int:
    """Bytes of the tensors a `Rollout` returns (alive at the census after the rollout)."""
    tensors = (rollout.input_ids, rollout.attention_mask, rollout.response_mask, rollout.logprobs, rollout.prompt_index)
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _rollout_case(plugin_name: str, settings: dict, lora: bool, census: bool = True):
    """Two train-then-rollout rounds on the boosted model and on a single-process reference. ``census``: count the
    live tensor bytes before and after each rollout and at every chunk the sync gathers (each count walks every
    Python object of the warm rank, about half a second late in a test session), for the layouts that gather."""
    from colo.apps import DDP, Booster, Gemini, HybridParallel, Zero
    from colo.apps.generation import RolloutEngine, SamplingParams, generate, rollout_model_inputs, sequence_logprobs

    plugin = {"ddp": DDP, "zero": Zero, "gemini": Gemini, "hybrid": HybridParallel}[plugin_name](**settings)
    model = _model(lora)
    booster = Booster(plugin)
    boosted, *_ = booster.boost(model, _optimizer(plugin_name, model))
    mesh = booster.mesh
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    batch = _batch(dp)
    share = batch[dp_rank * ROWS_PER_RANK : (dp_rank + 1) * ROWS_PER_RANK]

    reference = _model(lora)
    optimizer = _optimizer(plugin_name, reference)

    chunk_counts: list[int] = []
    first_round = [True]
    on_sync_step = None
    if census:
        on_sync_step = lambda: chunk_counts.append(_live_tensor_bytes()) if first_round[0] else None  # noqa: E731
    engine = RolloutEngine(booster, boosted, on_sync_step=on_sync_step)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.95, n=2, seed=11, eos_token_id=3)
    prompts = _prompts(dp_rank)
    results = []
    for _ in range(2):  # two train-then-rollout rounds: the second sync must see the second step's weights
        booster.train_step({"input_ids": share, "labels": share})
        reference(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        chunk_counts.clear()
        before = _live_tensor_bytes() if census else 0
        rollout = engine.generate(prompts, params)
        after = _live_tensor_bytes() if census else 0
        expected = generate(reference.eval(), prompts, params)
        with torch.no_grad():
            logits = booster.forward({**rollout_model_inputs(rollout), "return_logits": True}).logits
        recomputed = sequence_logprobs(logits, rollout)
        report = engine.last_report
        chunk_bytes = 0
        optimizer_of = booster.engine.optimizer
        if getattr(optimizer_of, "gatherer", None) is not None:
            chunk_bytes = max(c.numel * c.buffer("param_shard").element_size() for c in optimizer_of.chunks)
        results.append(
            {
                "tokens_equal": torch.equal(rollout.input_ids, expected.input_ids),
                "rollout": rollout.logprobs,
                "expected": expected.logprobs,
                "recomputed": recomputed,
                "report": report,
                "census_excess": max(chunk_counts, default=before) - before,
                "leftover": after - before - _rollout_bytes(rollout) if census else None,  # besides its result
                "chunk_bytes": chunk_bytes,
                "generated": rollout.num_generated_tokens,
            }
        )
        first_round[0] = False
    return results


def _check(results, *, layout: str):
    for rounds in results:
        for index, result in enumerate(rounds):
            report = result["report"]
            assert result["tokens_equal"], f"round {index}: tokens differ from the single-process reference"
            torch.testing.assert_close(result["rollout"], result["expected"], **TOLERANCE)
            torch.testing.assert_close(result["recomputed"], result["rollout"], **TOLERANCE)
            assert report.layout == layout and report.num_tokens == result["generated"] > 0
            assert report.tokens_per_second > 0 and report.kv_cache_bytes > 0
            bound = report.rollout_weight_bytes + result["chunk_bytes"]
            assert report.peak_sync_bytes <= bound
            assert result["census_excess"] <= bound, (result["census_excess"], bound)
    return [[r["report"] for r in rounds] for rounds in results]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rollouts_under_ddp_equal_the_reference_in_place(lora):
    if lora:
        pytest.importorskip("peft")
    results = run_distributed(_rollout_case, "ddp", {}, lora, False, world_size=2, timeout=180)  # in place: no census
    reports = _check(results, layout="in-place")
    assert all(r.synced_bytes == 0 and r.rollout_weight_bytes == 0 for rank in reports for r in rank)


def test_rollouts_under_zero3_gather_chunk_by_chunk_and_equal_the_reference():
    results = run_distributed(
        _rollout_case, "zero", {"stage": 3, "chunk_numel": 32768}, False, world_size=2, timeout=180
    )
    reports = _check(results, layout="gathered")
    for rank, rounds in zip(reports, results, strict=True):
        assert rounds[0]["census_excess"] > 0 and len({r.synced_bytes for r in rank}) == 1
        assert all(r["leftover"] <= 0 for r in rounds), "the rollout copy must be freed"
        assert rank[0].rollout_weight_bytes >= 4 * 100_000  # the whole tiny Llama in fp32


def test_rollouts_under_gemini_gather_chunk_by_chunk_and_equal_the_reference():
    results = run_distributed(_rollout_case, "gemini", {"chunk_numel": 32768}, False, world_size=2, timeout=180)
    reports = _check(results, layout="gathered")
    for rank, rounds in zip(reports, results, strict=True):
        assert rounds[0]["census_excess"] > 0 and len({r.synced_bytes for r in rank}) == 1
        assert all(r["leftover"] <= 0 for r in rounds), "the rollout copy must be freed"


def test_lora_rollouts_under_zero3_gather_only_the_adapters_after_the_first():
    pytest.importorskip("peft")
    # the census is the ZeRO-3 / Gemini tests' (each costs a walk over every Python object): not repeated here
    settings = {"stage": 3, "chunk_numel": 8192}
    results = run_distributed(_rollout_case, "zero", settings, True, False, world_size=2, timeout=180)
    reports = _check(results, layout="gathered")
    for rank in reports:
        first, second = rank
        assert 0 < second.synced_bytes < first.synced_bytes / 5  # adapters only: the base copy was kept
        assert second.rollout_weight_bytes == first.rollout_weight_bytes


def test_rollouts_under_tp2_generate_tensor_parallel_on_the_shards():
    results = run_distributed(_rollout_case, "hybrid", {"tp": 2}, False, False, world_size=2, timeout=180)
    _check(results, layout="in-place")
    assert torch.equal(results[0][0]["rollout"], results[1][0]["rollout"])  # both tp ranks: the same sequences
