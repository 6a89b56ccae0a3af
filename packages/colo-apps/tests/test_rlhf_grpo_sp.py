"""GRPO under HybridParallel sequence parallelism (Ulysses and ring attention over ``sp``).

Each sp rank runs the policy on its piece of every rollout row (contiguous for Ulysses, zigzag for ring), computes the
log-probs and entropies of the response tokens its piece scores, and the ``(R, T)`` values are all-gathered over sp
(`colo.apps.rlhf.sequence_logps`); the criterion runs unchanged on every sp rank, and the gather's backward sums the
ranks' gradients (a reduce-scatter), which the data-parallel mean over ``("dp", "sp")`` turns into the one-process
gradient. Generation runs on whole rows on every sp rank (sp shards no weight), the tokens broadcast over sp.

1. GRPO steps (rollout, rewards, group advantages, old log-probs recomputed through the boosted model, a frozen
   sequence-parallel reference, a clipped update with the KL term, AdamW with clipping) under sp2 (Ulysses, and ring
   with rows of 10 tokens padded to 12 for its 4 zigzag chunks), sp2 x dp2 (4 ranks, ZeRO-2) and tp2 x sp2 (4 ranks:
   each piece's log-probs from the rank's vocabulary columns) equal one process doing the same on every data-parallel
   rank's prompts (the single process of ``test_rlhf_grpo_tp``): sampled tokens equal, rollout log-probs and the
   trainer's recompute within 1e-5 of the single process's, losses and gradient norms (before clipping: AdamW alone
   would hide a uniformly scaled gradient) rtol 1e-5, the step metrics rtol 1e-5, every parameter rtol 1e-5 / atol
   1e-4 after the last AdamW step (fp32). Not bit-identical: attention runs on pieces (ring: blockwise online
   softmax), and the data-parallel mean of per-rank gradients sums in another order. The policy forward's only
   all-gather over sp is the ``2 x R x length`` per-token values (a forward that gathered logits would move ``R x
   length x vocab``).
2. The trainer: ``data.task: grpo`` under ``plugin.name: hybrid, sp: 2`` (ring; 2 SFT + 2 GRPO steps) logs the same
   per-step losses, gradient norms and GRPO metrics as the single-process DDP run, with a log-prob mismatch below 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import load_beside, run_distributed

STEPS = 3


def _tp_test():
    """The GRPO helpers of the tensor-parallel test (its model, prompts, rewards, single process and checks)."""
    return load_beside(__file__, "test_rlhf_grpo_tp.py", module_name="colo_apps_test_rlhf_grpo_tp")


def _sp_case(settings: dict) -> dict:
    from colo.apps import Booster, HybridParallel
    from colo.apps.generation import RolloutEngine
    from colo.apps.rlhf import global_counts
    from colo.comm import CommTracker

    helpers = _tp_test()
    expected = helpers._single_process(settings.get("dp", 1))
    model = helpers._model()
    booster = Booster(HybridParallel(max_grad_norm=1.0, **settings))
    criterion = helpers._criterion()
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=helpers.LR, eps=helpers.EPS), criterion=criterion)
    mesh = booster.mesh
    dp_group, dp_rank = mesh.group("dp"), mesh.rank("dp")
    engine = RolloutEngine(booster, booster.engine.model)
    reference = helpers._tp_reference(booster, engine)  # the plan (here its sp attention) on a meta copy
    mismatches, traffic = [], None
    for step in range(STEPS):
        params, generator = helpers._params(dp_rank, step)
        rollout = engine.generate(helpers._prompts(dp_rank, step), params, generator=generator)
        tokens, logprobs = expected["steps"][step]["rollouts"][dp_rank]
        if not torch.equal(rollout.input_ids, tokens):
            mismatches.append(f"step {step}: sampled tokens differ from the single process")
            break
        batch = helpers._batch(rollout, booster.forward, reference)
        for name, actual, wanted in (
            ("rollout log-probs vs the single process", rollout.logprobs, logprobs),
            ("trainer recompute vs rollout log-probs", batch["old_logps"], rollout.logprobs * rollout.response_mask),
        ):
            try:
                torch.testing.assert_close(actual, wanted, **helpers.TOKEN_TOLERANCE)
            except AssertionError as error:
                mismatches.append(f"step {step}: {name}: {error}")
        if step == 0:
            keys = ("input_ids", "position_ids", "document_ids", "response_mask")
            with torch.no_grad(), CommTracker() as tracker:
                booster.forward({k: batch[k] for k in keys if k in batch})
            traffic = {
                "all_gathers": tracker.calls("all_gather", axis="sp"),
                "all_gather_bytes": tracker.bytes("all_gather", axis="sp"),
                "shape": tuple(batch["input_ids"].shape),
            }
        counts = global_counts(batch["response_mask"], max_new_tokens=5, group=dp_group)
        criterion.prepare(counts, num_microbatches=1, num_data_ranks=dp_group.size)
        outcome = booster.train_step(batch)
        loss, grad_norm = float(outcome.loss), float(outcome.grad_norm)
        metrics = criterion.take_metrics(dp_group)
        wanted = expected["steps"][step]
        if loss != pytest.approx(wanted["loss"], rel=1e-5, abs=1e-7):
            mismatches.append(f"step {step}: loss {loss} vs {wanted['loss']}")
        # AdamW hides a uniform scale of the gradient (a backward that keeps each rank's part instead of the sum would
        # halve it): the norm before clipping shows it
        if grad_norm != pytest.approx(wanted["grad_norm"], rel=1e-5):
            mismatches.append(f"step {step}: grad norm {grad_norm} vs {wanted['grad_norm']}")
        for name in ("entropy", "kl", "clip_fraction", "ratio"):
            if metrics[name] != pytest.approx(wanted["metrics"][name], rel=1e-5, abs=1e-7):
                mismatches.append(f"step {step}: {name} {metrics[name]} vs {wanted['metrics'][name]}")
    named = dict(booster.engine.model.named_parameters())
    full = booster.engine.optimizer.full_params()
    for name, value in full.items():
        wanted = helpers._single_process_value(expected["params"], name)
        layout = helpers._layout(named.get(name))
        if layout is not None:  # a tensor-parallel shard (tp x sp): the matching slice of the single-process weight
            wanted = layout.local_slice(wanted)
        try:
            torch.testing.assert_close(value, wanted, rtol=1e-5, atol=1e-4)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    return {"mismatches": mismatches, "traffic": traffic, "num_params": len(full)}


def _check_sp_case(results, *, chunks: int) -> None:
    for result in results:
        assert result["num_params"] > 0 and not result["mismatches"], result["mismatches"][:4]
        traffic = result["traffic"]
        rows, width = traffic["shape"]
        padded = -(-width // chunks) * chunks
        # one all-gather over sp of (log-prob, entropy) per position of the padded rows: (n - 1) / n of 2 R L floats
        assert traffic["all_gathers"] == 1 and traffic["all_gather_bytes"] == 2 * rows * padded * 4 // 2, traffic


@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
def test_grpo_steps_under_sp2_match_one_process(sp_mode):
    results = run_distributed(_sp_case, {"sp": 2, "sp_mode": sp_mode}, world_size=2, timeout=120)
    _check_sp_case(results, chunks=4 if sp_mode == "ring" else 2)


@pytest.mark.slow
@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
def test_grpo_steps_under_sp2_x_dp2_match_one_process(sp_mode):
    settings = {"sp": 2, "sp_mode": sp_mode, "dp": 2, "zero_stage": 2}
    results = run_distributed(_sp_case, settings, world_size=4, timeout=180)
    _check_sp_case(results, chunks=4 if sp_mode == "ring" else 2)


# --- 2. the trainer ------------------------------------------------------------------------------------------------


def varied_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies within a group from the first GRPO step on: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _trainer_config(output_dir: str, **changes) -> dict:
    from colo.apps.train import load_config

    overrides = [
        f"output_dir={output_dir}",
        "grpo.synthetic_prompts=48",
        "grpo.group_size=4",
        "grpo.sft_steps=2",
        "data.global_batch_size=2",
        "schedule.total_steps=4",
        "schedule.warmup_steps=1",
        "eval.every_steps=100",
        "eval.num_sequences=8",
        "logging.every_steps=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "sample.max_new_tokens=0",
        "checkpoint.every_steps=100",
        f"grpo.reward_functions=[{__name__}:varied_reward]",
        *[f"{key}={value}" for key, value in changes.items()],
    ]
    return load_config(preset="tiny-grpo", overrides=overrides).model_dump(mode="json")


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    return {"losses": train(validate_config(config)).losses}


def _metrics(output_dir) -> dict[int, dict]:
    import json

    with open(output_dir / "metrics.jsonl") as lines:
        return {record["step"]: record for record in map(json.loads, lines) if "loss" in record}


def test_grpo_run_under_hybrid_sp2_ring_matches_ddp(tmp_path):
    ddp_dir, sp_dir = tmp_path / "ddp", tmp_path / "sp2"
    ddp = run_distributed(_train, _trainer_config(str(ddp_dir)), world_size=1, timeout=180)[0]["losses"]
    hybrid = {"plugin.name": "hybrid", "plugin.sp": 2, "plugin.sp_mode": "ring", "plugin.zero_stage": 1}
    sp2 = run_distributed(_train, _trainer_config(str(sp_dir), **hybrid), world_size=2, timeout=180)
    assert sp2[0]["losses"] == sp2[1]["losses"]
    assert sorted(ddp) == sorted(sp2[0]["losses"]) == [1, 2, 3, 4]
    expected, actual = _metrics(ddp_dir), _metrics(sp_dir)
    for step in (1, 2, 3, 4):  # SFT steps (rows of 11 tokens padded to 12 for the 4 zigzag chunks), then 2 GRPO steps
        assert sp2[0]["losses"][step] == pytest.approx(ddp[step], rel=1e-5, abs=1e-7), step
        names = ["grad_norm"] + (["grpo/entropy", "grpo/kl", "grpo/reward_mean"] if step > 2 else [])
        for name in names:
            assert actual[step][name] == pytest.approx(expected[step][name], rel=1e-5, abs=1e-7), (step, name)
    for step in (3, 4):
        assert actual[step]["grad_norm"] > 0.1 and actual[step]["grpo/reward_std"] > 0  # GRPO steps with a signal
        assert actual[step]["grpo/logprob_mismatch_max"] < 1e-5  # rollout log-probs == the sp trainer's recompute
    assert (sp_dir / "checkpoints" / "grpo-reference.safetensors").exists()  # written once, by sp rank 0


@pytest.mark.slow
@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
def test_grpo_steps_under_tp2_x_sp2_match_one_process(sp_mode):
    # the log-probs of each rank's piece from its vocabulary columns (tp), gathered over sp
    results = run_distributed(_sp_case, {"tp": 2, "sp": 2, "sp_mode": sp_mode}, world_size=4, timeout=180)
    _check_sp_case(results, chunks=4 if sp_mode == "ring" else 2)
