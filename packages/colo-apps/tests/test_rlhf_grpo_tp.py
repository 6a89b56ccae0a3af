"""GRPO under HybridParallel tensor parallelism: the policy's log-probs and entropies from vocabulary-parallel logits.

1. `vocab_parallel_token_stats` on 2 ranks (a padded vocabulary of 11 ids in 2 x 6 columns, temperature 0.7) equals
   the whole-vocabulary log-softmax of one process: log-probs, entropies and the gradients of both through the
   all-reduces (rtol 1e-5); one all-reduce (max) of one number and one (sum) of three per row, none in the backward.
2. GRPO steps (rollout, rewards, group advantages, old log-probs recomputed through the boosted model, a frozen
   tensor-parallel reference, a clipped update with the KL term, AdamW with clipping) under tp2 (zero_stage 1) and
   tp2 x dp2 (zero_stage 3, 4 ranks) equal one process doing the same on every data-parallel rank's prompts: sampled
   tokens equal, rollout log-probs within 1e-5 of the single process's and of the trainer's recompute, losses and
   gradient norms (before clipping) rtol 1e-5, every parameter rtol 1e-5 / atol 1e-4 after the last step, the step
   metrics (entropy, KL, clip fraction, ratio) rtol 1e-5 (fp32). Not bit-identical: tensor parallelism sums the
   row-parallel products and the vocabulary statistics in another order, the data-parallel mean of per-rank gradients
   too, and AdamW turns the rounding of near-zero gradient entries into small steps. The policy forward issues no
   all-gather over tp, and its tp traffic is exactly the activations' all-reduces plus 4 floats per response token; a
   policy forward that gathers the logits is caught by the same check.
3. The trainer: ``data.task: grpo`` under ``plugin.name: hybrid, tp: 2`` (2 SFT + 2 GRPO steps) logs the same
   per-step losses as the single-process DDP run, and a resumed run reads each tp rank's reference shards back.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from colo.comm.testing import run_distributed

SEED, LR, EPS, TEMPERATURE, GROUP, STEPS = 11, 1e-2, 1e-5, 0.7, 4, 3
TOKEN_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


# --- 1. the vocabulary-parallel statistics ----------------------------------------------------------------------


def _stats_case(entropy_grad: bool) -> dict:
    from colo.apps.rlhf.token_logps import token_logps, vocab_parallel_token_stats
    from colo.comm import CommTracker, Mesh

    mesh = Mesh(tp=2)
    group = mesh.group("tp")
    generator = torch.Generator().manual_seed(3)
    rows, vocab, padded = 10, 11, 12
    logits = torch.randn(2, rows // 2, padded, generator=generator) * 3
    tokens = torch.randint(0, vocab, (2, rows // 2), generator=generator)
    grad_logps, grad_entropy = torch.randn(2, 2, rows // 2, generator=generator)

    whole = logits[..., :vocab].clone().requires_grad_(True)
    logps, entropy = token_logps(whole, tokens, temperature=TEMPERATURE, entropy=True, entropy_grad=True)
    (logps * grad_logps + (entropy * grad_entropy if entropy_grad else 0)).sum().backward()

    local = logits[..., group.rank * 6 : (group.rank + 1) * 6].clone().requires_grad_(True)
    with CommTracker() as forward:
        local_logps, local_entropy = vocab_parallel_token_stats(
            local / TEMPERATURE, tokens, group=group, vocab_size=vocab, entropy_grad=entropy_grad
        )
    total = (local_logps * grad_logps).sum()
    if entropy_grad:
        total = total + (local_entropy * grad_entropy).sum()
    with CommTracker() as backward:
        total.backward()
    columns = slice(group.rank * 6, min((group.rank + 1) * 6, vocab))
    expected_grad = torch.zeros_like(local)
    expected_grad[..., : columns.stop - columns.start] = whole.grad[..., columns]
    return {
        "logps": (local_logps.detach(), logps.detach()),
        "entropy": (local_entropy, entropy.detach()),
        "grad": (local.grad, expected_grad),
        "entropy_requires_grad": local_entropy.requires_grad,
        "forward_calls": forward.calls(),
        "forward_all_reduce_bytes": forward.bytes("all_reduce", axis="tp"),
        "backward_calls": backward.calls(),
        "rows": rows,
    }


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["entropy-metric", "entropy-bonus"])
def test_vocab_parallel_log_probs_and_entropy_equal_the_whole_vocabulary(entropy_grad):
    for result in run_distributed(_stats_case, entropy_grad, world_size=2, timeout=60):
        for name in ("logps", "entropy", "grad"):
            actual, expected = result[name]
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)
        assert result["entropy_requires_grad"] == entropy_grad
        # a max of one float and a sum of three per row; all_reduce moves 2 (n - 1) / n * S = S bytes on 2 ranks
        assert result["forward_calls"] == 2
        assert result["forward_all_reduce_bytes"] == result["rows"] * 4 * (1 + 3)
        assert result["backward_calls"] == 0


# --- 2. GRPO steps under tp (x dp) against one process -----------------------------------------------------------


def _model():
    from colo.apps import Llama, get_preset
    from colo.apps.rlhf import attach_rollout_forward

    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(SEED)
    return attach_rollout_forward(model, temperature=TEMPERATURE)


def _prompts(dp_rank: int, step: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(100 * step + dp_rank)
    return [torch.randint(4, 128, (length,), generator=generator).tolist() for length in (5, 3)]


def _rewards(rollout) -> torch.Tensor:
    """A rule reward that differs within a group: the share of response tokens below 64."""
    responses = rollout.input_ids[:, rollout.prompt_length :]
    mask = rollout.response_mask.float()
    return ((responses < 64).float() * mask).sum(1) / mask.sum(1).clamp(min=1)


def _params(dp_rank: int, step: int):
    from colo.apps.generation import SamplingParams

    return SamplingParams(max_new_tokens=5, temperature=TEMPERATURE, top_p=0.95, n=GROUP, eos_token_id=3), (
        torch.Generator().manual_seed(1000 * step + dp_rank)
    )


def _batch(rollout, policy, reference) -> dict:
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf import group_advantages

    batch = {
        **rollout_model_inputs(rollout, hf=False),
        "response_mask": rollout.response_mask,
        "advantages": group_advantages(_rewards(rollout), GROUP),
    }
    keys = ("input_ids", "position_ids", "document_ids", "response_mask")
    inputs = {key: batch[key] for key in keys if key in batch}
    mask = rollout.response_mask.float()
    with torch.no_grad():
        batch["old_logps"] = policy(inputs)["logps"].float() * mask
        batch["ref_logps"] = reference(**inputs)["logps"].float() * mask
    return batch


def _criterion(**settings):
    from colo.apps.rlhf import GRPOCriterion

    return GRPOCriterion(loss_aggregation="seq-mean-token-mean", beta=0.1, eps_low=0.2, eps_high=0.28, **settings)


def _single_process(dp: int, steps: int = STEPS) -> dict:
    """One process: every data-parallel rank's prompts, the loss over all of them, one AdamW step per GRPO step."""
    from colo.apps.generation import generate
    from colo.apps.rlhf import global_counts

    model = _model()
    reference = _model().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    criterion = _criterion()
    results = []
    for step in range(steps):
        rollouts = []
        for dp_rank in range(dp):
            params, generator = _params(dp_rank, step)
            rollouts.append(generate(model, _prompts(dp_rank, step), params, generator=generator))
        batches = [_batch(rollout, lambda micro: model(**micro), reference) for rollout in rollouts]
        mask = torch.cat([b["response_mask"] for b in batches])
        criterion.prepare(global_counts(mask, max_new_tokens=5), num_microbatches=1, num_data_ranks=1)
        loss = sum(criterion(model(**b), b) for b in batches)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        results.append(
            {
                "loss": loss.item(),
                "grad_norm": float(grad_norm),
                "rollouts": [(r.input_ids, r.logprobs) for r in rollouts],
                "metrics": criterion.take_metrics(),
            }
        )
    return {"steps": results, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _tp_reference(booster, engine):
    """The frozen reference as `GRPOTask` builds it under tp: a meta model laid out by the policy's plan, loaded with
    the policy's shards (`RolloutEngine.full_state_dict`)."""
    from colo.apps import Llama, get_preset
    from colo.apps.rlhf import attach_rollout_forward

    with torch.device("meta"):
        model = Llama(get_preset("tiny", initializer_range=0.1))
    booster.engine.plan.apply(model, mesh=booster.engine.mesh, plugin=booster.plugin)
    model.load_state_dict(engine.full_state_dict())
    model.requires_grad_(False)
    return attach_rollout_forward(model, temperature=TEMPERATURE)


def _policy_forward_traffic(booster, micro: dict) -> dict:
    """What one policy forward sends over tp, and what the same forward sends when its log-probs gather the logits
    (the check must catch that)."""
    import importlib

    from colo.comm import CommTracker
    from colo.tensor import all_gather_split

    token_logps = importlib.import_module("colo.apps.rlhf.token_logps")

    with torch.no_grad(), CommTracker() as tracker:
        booster.forward(micro)
    vocab_parallel = token_logps.vocab_parallel_token_stats

    def gathering(local_logits, tokens, *, group, vocab_size=None, entropy_grad=False):
        whole = all_gather_split(local_logits, group=group, dim=-1)
        return token_logps.token_logps(whole, tokens, vocab_size=vocab_size, entropy=True, entropy_grad=entropy_grad)

    token_logps.vocab_parallel_token_stats = gathering  # (this rank's process only)
    try:
        with torch.no_grad(), CommTracker() as mutated:
            booster.forward(micro)
    finally:
        token_logps.vocab_parallel_token_stats = vocab_parallel
    return {
        "all_gathers": tracker.calls("all_gather", axis="tp"),
        "all_reduce_bytes": tracker.bytes("all_reduce", axis="tp"),
        "mutated_all_gathers": mutated.calls("all_gather", axis="tp"),
    }


def _tp_case(settings: dict) -> dict:
    from colo.apps import Booster, HybridParallel
    from colo.apps.generation import RolloutEngine
    from colo.apps.rlhf import global_counts

    expected = _single_process(settings.get("dp", 1))
    model = _model()
    booster = Booster(HybridParallel(max_grad_norm=1.0, **settings))
    criterion = _criterion()
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), criterion=criterion)
    mesh = booster.mesh
    dp_group, dp_rank = mesh.group("dp"), mesh.rank("dp")
    engine = RolloutEngine(booster, booster.engine.model)
    reference = _tp_reference(booster, engine)
    mismatches, traffic = [], None
    for step in range(STEPS):
        params, generator = _params(dp_rank, step)
        rollout = engine.generate(_prompts(dp_rank, step), params, generator=generator)
        tokens, logprobs = expected["steps"][step]["rollouts"][dp_rank]
        if not torch.equal(rollout.input_ids, tokens):
            mismatches.append(f"step {step}: sampled tokens differ from the single process")
            break
        batch = _batch(rollout, booster.forward, reference)
        for name, actual, wanted in (
            ("rollout log-probs vs the single process", rollout.logprobs, logprobs),
            ("trainer recompute vs rollout log-probs", batch["old_logps"], rollout.logprobs * rollout.response_mask),
        ):
            try:
                torch.testing.assert_close(actual, wanted, **TOKEN_TOLERANCE)
            except AssertionError as error:
                mismatches.append(f"step {step}: {name}: {error}")
        if step == 0:
            keys = ("input_ids", "position_ids", "document_ids", "response_mask")
            traffic = _policy_forward_traffic(booster, {k: batch[k] for k in keys if k in batch})
            traffic["shape"] = (*batch["input_ids"].shape, *batch["response_mask"].shape)
        counts = global_counts(batch["response_mask"], max_new_tokens=5, group=dp_group)
        criterion.prepare(counts, num_microbatches=1, num_data_ranks=dp_group.size)
        outcome = booster.train_step(batch)
        loss, grad_norm = float(outcome.loss), float(outcome.grad_norm)
        metrics = criterion.take_metrics(dp_group)
        wanted = expected["steps"][step]
        if loss != pytest.approx(wanted["loss"], rel=1e-5, abs=1e-7):
            mismatches.append(f"step {step}: loss {loss} vs {wanted['loss']}")
        # AdamW hides a uniform scale of the gradient (e.g. a tp gradient all-reduce that averaged instead of
        # summing): the norm before clipping shows it
        if grad_norm != pytest.approx(wanted["grad_norm"], rel=1e-5):
            mismatches.append(f"step {step}: grad norm {grad_norm} vs {wanted['grad_norm']}")
        for name in ("entropy", "kl", "clip_fraction", "ratio"):
            if metrics[name] != pytest.approx(wanted["metrics"][name], rel=1e-5, abs=1e-7):
                mismatches.append(f"step {step}: {name} {metrics[name]} vs {wanted['metrics'][name]}")
    named = dict(booster.engine.model.named_parameters())
    full = booster.engine.optimizer.full_params()
    for name, value in full.items():
        wanted = _single_process_value(expected["params"], name)
        layout = _layout(named.get(name))
        if layout is not None:  # a tensor-parallel shard: the matching slice of the single-process weight
            wanted = layout.local_slice(wanted)
        try:
            torch.testing.assert_close(value, wanted, rtol=1e-5, atol=1e-4)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    return {"mismatches": mismatches, "traffic": traffic, "num_params": len(full)}


def _layout(parameter):
    from colo.tensor import layout_of

    return None if parameter is None else layout_of(parameter)


def _single_process_value(expected: dict, name: str) -> torch.Tensor:
    """The single-process tensor of a boosted parameter: the same name, or the tensor-parallel q / k / v weights'
    rows of the fused ``qkv_proj.weight``."""
    if name in expected:
        return expected[name]
    from colo.apps import get_preset

    config = get_preset("tiny")
    base, _, part = name.rpartition(".")
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    fused = expected[f"{base}.weight"]
    return {"q_weight": fused[:q], "k_weight": fused[q : q + kv], "v_weight": fused[q + kv :]}[part]


def _check_tp_case(results, *, tp: int) -> None:
    from colo.apps import get_preset

    config = get_preset("tiny")
    for result in results:
        assert result["num_params"] > 0 and not result["mismatches"], result["mismatches"][:4]
        traffic = result["traffic"]
        rows, width, _, response = traffic["shape"]
        # the embedding's and every layer's o_proj / down_proj all-reduce of (rows, width, hidden), then the vocabulary
        # statistics: a max of one float and a sum of three per response token; all_reduce: 2 (tp - 1) / tp * S bytes
        activations = rows * width * config.hidden_size * (1 + 2 * config.num_hidden_layers)
        expected_bytes = 2 * (tp - 1) / tp * 4 * (activations + rows * response * 4)
        assert traffic["all_gathers"] == 0 and traffic["all_reduce_bytes"] == expected_bytes, traffic
        assert traffic["mutated_all_gathers"] > 0  # a forward that gathers the logits fails the check above


def test_grpo_steps_under_tp2_match_one_process():
    _check_tp_case(run_distributed(_tp_case, {"tp": 2, "zero_stage": 1}, world_size=2, timeout=120), tp=2)


@pytest.mark.slow
def test_grpo_steps_under_tp2_x_dp2_zero3_match_one_process():
    results = run_distributed(_tp_case, {"tp": 2, "dp": 2, "zero_stage": 3}, world_size=4, timeout=180)
    _check_tp_case(results, tp=2)


# --- 2b. GRPO steps under a pipeline (x dp) against one process --------------------------------------------------


def _meta_model():
    from colo.apps import Llama, get_preset

    with torch.device("meta"):
        return Llama(get_preset("tiny", initializer_range=0.1))


def _pp_case(settings: dict) -> dict:
    """pp2 (x dp2): generation on the whole weights gathered over pp (`RolloutEngine(build_model=...)`), the frozen
    reference pipelined as the policy (`Booster.frozen_copy`), the old log-probs by a pipelined forward
    (`Booster.forward`), the update's log-probs and loss on the last stage per microbatch (2 microbatches: each row's
    advantage and masks travel with it). ``settings``: the plugin's, and ``steps`` (default `STEPS`)."""
    from colo.apps import Booster, HybridParallel
    from colo.apps.generation import RolloutEngine
    from colo.apps.rlhf import global_counts
    from colo.apps.rlhf.pair_pipeline import from_last_stage

    settings = dict(settings)
    num_steps = settings.pop("steps", STEPS)
    expected = _single_process(settings.get("dp", 1), num_steps)
    model = _model()
    booster = Booster(HybridParallel(max_grad_norm=1.0, num_microbatches=2, **settings))
    criterion = _criterion(temperature=TEMPERATURE)
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), criterion=criterion)
    mesh = booster.mesh
    dp_group, dp_rank = mesh.group("dp"), mesh.rank("dp")
    engine = RolloutEngine(booster, booster.engine.model, build_model=_meta_model)
    reference = booster.frozen_copy(_meta_model(), engine.full_state_dict())
    mismatches = []
    for step in range(num_steps):
        params, generator = _params(dp_rank, step)
        rollout = engine.generate(_prompts(dp_rank, step), params, generator=generator)
        tokens, logprobs = expected["steps"][step]["rollouts"][dp_rank]
        if not torch.equal(rollout.input_ids, tokens):
            mismatches.append(f"step {step}: sampled tokens differ from the single process")
            break
        report, whole = engine.last_report, 4 * sum(t.numel() for t in _meta_model().state_dict().values())
        stage = 4 * sum(p.numel() for p in booster.engine.optimizer.full_params().values())  # this rank's stage
        received = whole - stage + (stage if settings.get("zero_stage") == 3 else 0)  # + its chunks over dp
        # the copy is the whole fp32 model; at the peak the received stages sit beside the model they are loaded into
        if (report.rollout_weight_bytes, report.peak_sync_bytes) != (
            whole,
            2 * whole,
        ) or report.synced_bytes < received:
            mismatches.append(f"step {step}: {report} against a whole model of {whole} B, this stage {stage} B")
        # what this stage sends over pp: its weights once, plus pickle's framing (a view into a flat buffer would
        # carry the whole buffer, once per parameter: 8-9x at pp2 before the views were made compact)
        sent = len(pickle.dumps(engine._stage_state(booster.unwrap())[0])) if step == 0 else stage
        if not stage <= sent < 1.1 * stage:
            mismatches.append(f"step {step}: the stage's weights pickle to {sent} B for {stage} B")
        batch = _batch(rollout, booster.forward, reference)
        for name, actual, wanted in (
            ("rollout log-probs vs the single process", rollout.logprobs, logprobs),
            ("trainer recompute vs rollout log-probs", batch["old_logps"], rollout.logprobs * rollout.response_mask),
        ):
            try:
                torch.testing.assert_close(actual, wanted, **TOKEN_TOLERANCE)
            except AssertionError as error:
                mismatches.append(f"step {step}: {name}: {error}")
        counts = global_counts(batch["response_mask"], max_new_tokens=5, group=dp_group)
        criterion.prepare(counts, num_microbatches=2, num_data_ranks=dp_group.size)
        outcome = booster.train_step(batch)
        metrics = from_last_stage(criterion.take_metrics(dp_group), mesh)
        wanted = expected["steps"][step]
        for name, value, target in (
            ("loss", float(outcome.loss), wanted["loss"]),
            ("grad_norm", float(outcome.grad_norm), wanted["grad_norm"]),
            *((name, metrics[name], wanted["metrics"][name]) for name in ("entropy", "kl", "clip_fraction", "ratio")),
        ):
            if value != pytest.approx(target, rel=1e-5, abs=1e-7):
                mismatches.append(f"step {step}: {name} {value} vs {target}")
    full = booster.engine.optimizer.full_params()  # this rank's stage
    for name, value in full.items():
        try:
            torch.testing.assert_close(value, expected["params"][name], rtol=1e-5, atol=1e-4)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    return {"mismatches": mismatches, "num_params": len(full)}


def test_grpo_steps_under_pp2_match_one_process():
    for result in run_distributed(_pp_case, {"pp": 2, "zero_stage": 1}, world_size=2, timeout=120):
        assert result["num_params"] > 0 and not result["mismatches"], result["mismatches"][:4]


@pytest.mark.slow
def test_grpo_steps_under_pp2_x_dp2_match_one_process():
    for result in run_distributed(_pp_case, {"pp": 2, "dp": 2, "zero_stage": 2}, world_size=4, timeout=180):
        assert result["num_params"] > 0 and not result["mismatches"], result["mismatches"][:4]


def test_grpo_steps_under_pp2_x_dp2_zero3_match_one_process():
    """Large actors: each stage's parameters sharded over dp (ZeRO-3). The rollout copy gathers every stage's chunks
    over dp, then the stages over pp; the frozen reference is pipelined; the update runs the stages' ZeRO-3 gathers
    and reduce-scatters. 2 GRPO steps (AdamW) equal one process as the zero_stage 1/2 cases do."""
    settings = {"pp": 2, "dp": 2, "zero_stage": 3, "steps": 2}
    for result in run_distributed(_pp_case, settings, world_size=4, timeout=180):
        assert result["num_params"] > 0 and not result["mismatches"], result["mismatches"][:4]


# --- 3. the trainer ------------------------------------------------------------------------------------------------


def varied_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies within a group from the first GRPO step on (the exact answer rarely does after 2 SFT
    steps): the share of digits in the completion."""
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
        "checkpoint.every_steps=3",
        f"grpo.reward_functions=[{__name__}:varied_reward]",
        *[f"{key}={value}" for key, value in changes.items()],
    ]
    return load_config(preset="tiny-grpo", overrides=overrides).model_dump(mode="json")


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {"losses": result.losses, "start_step": result.start_step}


def _metrics(output_dir) -> dict[int, dict]:
    import json

    with open(output_dir / "metrics.jsonl") as lines:
        return {record["step"]: record for record in map(json.loads, lines) if "loss" in record}


@pytest.mark.slow
def test_grpo_run_under_hybrid_tp2_matches_ddp_and_resumes(tmp_path):
    import shutil

    ddp_dir, tp_dir = tmp_path / "ddp", tmp_path / "tp2"
    ddp = run_distributed(_train, _trainer_config(str(ddp_dir)), world_size=1, timeout=180)[0]["losses"]
    hybrid = {"plugin.name": "hybrid", "plugin.tp": 2, "plugin.zero_stage": 1}
    tp2 = run_distributed(_train, _trainer_config(str(tp_dir), **hybrid), world_size=2, timeout=180)
    assert tp2[0]["losses"] == tp2[1]["losses"]
    assert sorted(ddp) == sorted(tp2[0]["losses"]) == [1, 2, 3, 4]
    expected, actual = _metrics(ddp_dir), _metrics(tp_dir)
    for step in (1, 2, 3, 4):  # SFT steps 1-2, GRPO steps 3-4 (on-policy at step 3: a loss near 0, a real gradient)
        assert tp2[0]["losses"][step] == pytest.approx(ddp[step], rel=1e-5, abs=1e-7), step
        names = ["grad_norm"] + (["grpo/entropy", "grpo/kl", "grpo/reward_mean"] if step > 2 else [])
        for name in names:
            assert actual[step][name] == pytest.approx(expected[step][name], rel=1e-5, abs=1e-7), (step, name)
    for step in (3, 4):
        assert actual[step]["grad_norm"] > 0.1 and actual[step]["grpo/reward_std"] > 0  # GRPO steps with a signal
        assert actual[step]["grpo/logprob_mismatch_max"] < 1e-5  # rollout log-probs == the trainer's recompute
    for rank in (0, 1):  # each tp rank its own shards of the frozen reference
        assert (tp_dir / "checkpoints" / f"grpo-reference-tp{rank}-of-2.safetensors").exists()
    shutil.rmtree(tp_dir / "checkpoints" / "step-00000004")  # resume from the checkpoint after step 3
    resumed = run_distributed(_train, _trainer_config(str(tp_dir), **hybrid), world_size=2, timeout=180)[0]
    assert resumed["start_step"] == 3
    assert resumed["losses"][4] == tp2[0]["losses"][4]  # the reference shards read back: bit for bit (fp32)


def test_grpo_under_hybrid_refuses_what_it_cannot_run():
    from colo.apps.train import ConfigError, load_config

    for overrides, message in (
        (
            ["plugin.name=hybrid", "plugin.pp=2", "plugin.tp=2", "schedule.num_microbatches=2"],
            r"plugin.pp=2 supports pp x dp: plugin.tp=2 .*set plugin.tp=1",
        ),
        (["plugin.name=hybrid", "plugin.tp=2", "plugin.sp_mode=megatron"], r"set plugin.sp_mode=null"),
        (["plugin.name=hybrid", "plugin.tp=4", "plugin.tp_mode=2d"], r"set plugin.tp_mode='1d'"),
        (["plugin.name=hybrid", "plugin.tp=2", "lora.enabled=true"], r"set lora.enabled=false"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(preset="tiny-grpo", overrides=overrides)
    config = load_config(preset="tiny-grpo", overrides=["plugin.name=hybrid", "plugin.tp=2", "plugin.zero_stage=3"])
    assert config.plugin.name == "hybrid" and config.plugin.tp == 2
    assert load_config(preset="tiny-ppo", overrides=["plugin.name=hybrid", "plugin.tp=2"]).plugin.tp == 2  # PPO too
    pipelined = ["plugin.name=hybrid", "plugin.pp=2", "schedule.num_microbatches=2"]
    assert load_config(preset="tiny-grpo", overrides=pipelined).plugin.pp == 2
    assert load_config(preset="tiny-ppo", overrides=pipelined).plugin.pp == 2  # PPO too (test_rlhf_ppo_pp.py)
    # pp x ZeRO-3: the rollout copy gathers each stage over dp, then over pp (the pp2 x dp2 zero_stage 3 case above;
    # PPO's in test_rlhf_ppo_pp.py)
    for preset in ("tiny-grpo", "tiny-ppo"):
        assert load_config(preset=preset, overrides=[*pipelined, "plugin.zero_stage=3"]).plugin.zero_stage == 3


def test_grpo_run_under_pp2_matches_one_process(tmp_path):
    """``colo train`` GRPO at pp2 (2 SFT + 2 GRPO steps, 2 microbatches through 2 stages of 2 layers; the rollout on
    the stages' weights gathered over pp, the reference pipelined) logs the one process's losses, gradient norms,
    entropy, KL and rewards (rtol 1e-5), and the rollout-vs-trainer log-prob mismatch stays below 1e-5."""
    one_dir, pp_dir = tmp_path / "one", tmp_path / "pp2"
    single = {"schedule.num_microbatches": 2}  # the batch split as the pipeline splits it (the SFT token means)
    one = run_distributed(_train, _trainer_config(str(one_dir), **single), world_size=1, timeout=180)[0]["losses"]
    hybrid = {"plugin.name": "hybrid", "plugin.pp": 2, "plugin.zero_stage": 1, **single}
    pp2 = run_distributed(_train, _trainer_config(str(pp_dir), **hybrid), world_size=2, timeout=180)
    assert pp2[0]["losses"] == pp2[1]["losses"]
    assert sorted(one) == sorted(pp2[0]["losses"]) == [1, 2, 3, 4]
    expected, actual = _metrics(one_dir), _metrics(pp_dir)
    for step in (1, 2, 3, 4):  # SFT steps 1-2, GRPO steps 3-4
        assert pp2[0]["losses"][step] == pytest.approx(one[step], rel=1e-5, abs=1e-7), step
        names = ["grad_norm"] + (["grpo/entropy", "grpo/kl", "grpo/reward_mean"] if step > 2 else [])
        for name in names:
            assert actual[step][name] == pytest.approx(expected[step][name], rel=1e-5, abs=1e-7), (step, name)
    for step in (3, 4):
        assert actual[step]["grad_norm"] > 0.1 and actual[step]["grpo/reward_std"] > 0  # GRPO steps with a signal
        assert actual[step]["grpo/logprob_mismatch_max"] < 1e-5  # rollout log-probs == the last stage's
