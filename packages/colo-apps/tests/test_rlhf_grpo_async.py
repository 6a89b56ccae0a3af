"""Asynchronous (one-step off-policy) GRPO, ``grpo.max_staleness=1``: the decoupled-PPO correction and a run.

The correction (`colo.apps.rlhf.off_policy`): with the behaviour log-probs equal to the proximal ones every importance
weight is exactly 1 and `GRPOCriterion` gives the on-policy loss and gradient bit for bit; otherwise its loss and
gradient equal a hand computation of ``sum_t M_t [min(exp(prox - behav), C) * -min(r A, clip(r) A) + beta k3] / N``
in float64 (rtol 1e-12), with one token above the cap and one clipped ratio.

The run: ``data.task: grpo`` on two ranks with ``grpo.max_staleness=1`` (and dynamic sampling, whose refill rounds
generate on the main thread while the background thread generates the next step) reports staleness 0 on its first GRPO
step (nothing in flight) and 1 after, importance weights around 1, and a checkpoint taken with a rollout in flight
resumes bit for bit (fp32): the in-flight rollout is saved beside the checkpoint and trained on after the resume.

The workers: a thread and a child process (``grpo.rollout_worker``) sample the same rollout bit for bit from the same
weights and seed, also after a refresh of the rollout copy with other weights (the process reads them from shared
memory); a rollout in flight saved by a checkpoint loads back equal, and a missing one is an error naming the field.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from colo.comm.testing import run_distributed

CAP, BETA, EPS_LOW, EPS_HIGH = 1.5, 0.04, 0.2, 0.28


def _criterion():
    from colo.apps.rlhf import GRPOCriterion, global_counts

    criterion = GRPOCriterion(
        loss_aggregation="token-mean", beta=BETA, eps_low=EPS_LOW, eps_high=EPS_HIGH, importance_sampling_cap=CAP
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    criterion.prepare(global_counts(mask, max_new_tokens=3), num_microbatches=1, num_data_ranks=1)
    return criterion, mask


def _inputs():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    return {
        "logps": logps,
        "ref_logps": logps + torch.tensor([[0.1, -0.2, 0.05], [0.3, -0.1, 0.0]], dtype=torch.float64),
        "advantages": torch.tensor([1.0, -0.5], dtype=torch.float64),
    }


def _loss(batch: dict, logps: torch.Tensor):
    criterion, mask = _criterion()
    logps = logps.clone().requires_grad_(True)
    output = {"logps": logps, "entropy": torch.zeros_like(logps)}
    loss = criterion(output, {"response_mask": mask, **batch})
    loss.backward()
    return loss.detach(), logps.grad


def test_equal_behaviour_and_proximal_log_probs_give_the_on_policy_loss():
    inputs = _inputs()
    logps = inputs["logps"]
    base = {"advantages": inputs["advantages"], "ref_logps": inputs["ref_logps"]}
    on_policy = _loss(base, logps)  # the update's own forward gives the old (proximal) log-probs
    corrected = _loss({**base, "behaviour_logps": logps.clone()}, logps)
    assert torch.equal(corrected[0], on_policy[0]) and torch.equal(corrected[1], on_policy[1])
    proximal = logps + 0.1  # a separate proximal forward (several updates per rollout): the same identity
    recompute = _loss({**base, "old_logps": proximal}, logps)
    assert torch.equal(_loss({**base, "old_logps": proximal, "behaviour_logps": proximal}, logps)[0], recompute[0])
    # mutation: stale behaviour log-probs change the loss
    stale = _loss({**base, "behaviour_logps": logps - 0.2}, logps)
    assert abs(float(stale[0] - on_policy[0])) > 1e-3


def test_the_correction_matches_a_hand_computation():
    inputs = _inputs()
    logps, ref, advantages = inputs["logps"], inputs["ref_logps"], inputs["advantages"]
    proximal = logps + torch.tensor([[0.0, 0.5, -0.1], [0.02, -0.3, 0.0]], dtype=torch.float64)  # r = 0.61 clips
    behaviour = proximal - torch.tensor([[0.1, 0.9, -0.2], [0.0, 0.05, 0.0]], dtype=torch.float64)  # e^0.9 > CAP
    loss, grad = _loss(
        {"advantages": advantages, "ref_logps": ref, "old_logps": proximal, "behaviour_logps": behaviour}, logps
    )
    mask = [[1, 1, 1], [1, 1, 0]]
    total, expected_grad, tokens = 0.0, torch.zeros(2, 3, dtype=torch.float64), 5.0
    capped = 0
    for i in range(2):
        a = float(advantages[i])
        for t in range(3):
            if not mask[i][t]:
                continue
            lp, p, b, rf = (float(x[i, t]) for x in (logps, proximal, behaviour, ref))
            r = math.exp(lp - p)
            w = min(math.exp(p - b), CAP)
            capped += math.exp(p - b) > CAP
            clipped_r = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            unclipped_is_min = r * a <= clipped_r * a
            surrogate = -min(r * a, clipped_r * a)
            kl = math.exp(rf - lp) - (rf - lp) - 1
            total += (w * surrogate + BETA * kl) / tokens
            d_surrogate = -a * r if unclipped_is_min else 0.0
            expected_grad[i, t] = (w * d_surrogate + BETA * (1 - math.exp(rf - lp))) / tokens
    assert capped == 1  # the truncation is exercised
    assert float(loss) == pytest.approx(total, rel=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_asynchronous_settings_are_checked_with_the_field_named():
    from colo.apps.train import ConfigError, load_config

    cases = [
        (["grpo.max_staleness=2"], "staleness at most 1"),
        (["grpo.max_staleness=1", "plugin.name=hybrid", "plugin.tp=2"], "grpo.max_staleness=1 .*plugin.tp=2"),
        (["grpo.max_staleness=1", "grpo.importance_sampling_cap=1"], "importance_sampling_cap"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(preset="tiny-grpo", overrides=overrides)
    assert load_config(preset="tiny-grpo").grpo.max_staleness == 0  # synchronous unless asked


# --- the trainer ---------------------------------------------------------------------------------------------------


def _config(output_dir: str, **changes) -> dict:
    from colo.apps.train import load_config

    overrides = [
        f"output_dir={output_dir}",
        "grpo.synthetic_prompts=48",
        "grpo.group_size=4",
        "grpo.sft_steps=1",
        "grpo.max_staleness=1",
        "grpo.dynamic_sampling=true",
        "grpo.dynamic_sampling_max_rounds=1",
        "data.global_batch_size=4",
        "schedule.total_steps=4",
        "schedule.warmup_steps=1",
        "eval.every_steps=100",
        "logging.every_steps=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "sample.max_new_tokens=0",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=3",
        *[f"{key}={value}" for key, value in changes.items()],
    ]
    return load_config(preset="tiny-grpo", overrides=overrides).model_dump(mode="json")


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {"losses": result.losses, "start_step": result.start_step}


@pytest.mark.slow
def test_asynchronous_grpo_reports_staleness_and_resumes_exactly(tmp_path):
    from colo.apps.train.state import checkpoint_path

    straight_dir, resumed_dir = str(tmp_path / "a"), str(tmp_path / "b")
    straight_config = _config(straight_dir)
    straight = run_distributed(_train, straight_config, world_size=2, timeout=300)[0]
    assert sorted(straight["losses"]) == list(range(1, 5))
    with open(os.path.join(straight_dir, "metrics.jsonl")) as lines:
        records = {r["step"]: r for r in map(json.loads, lines) if "grpo/staleness" in r}
    assert sorted(records) == [2, 3, 4]
    assert records[2]["grpo/staleness_max"] == 0.0  # the first GRPO step: nothing in flight, sampled now
    for step in (3, 4):  # sampled before the previous update; weights one update old, close to 1
        record = records[step]
        assert record["grpo/staleness_max"] == 1.0 and record["grpo/staleness"] > 0, step
        assert 0.5 < record["grpo/importance_weight_min"] <= record["grpo/importance_weight_mean"], step
        assert record["grpo/importance_weight_mean"] <= record["grpo/importance_weight_max"] < 2.0, step
        assert record["grpo/importance_weight_max"] != 1.0, step  # the weights did move: a real correction
        assert record["grpo/time_rollout_background"] > 0, step
    checkpoints = os.path.join(straight_dir, "checkpoints")
    # the checkpoint after step 2 holds step 3's rollout in flight; the last step launches none
    expected = [f"step-2-rank-{rank}.safetensors" for rank in (0, 1)]
    assert sorted(os.listdir(os.path.join(checkpoints, "grpo-pending"))) == expected

    # the run again from its checkpoint after step 2 (the later ones removed), step 3's rollout in flight there
    shutil.copytree(straight_dir, resumed_dir)
    for step in (4,):
        shutil.rmtree(checkpoint_path(os.path.join(resumed_dir, "checkpoints"), step))
    config = _config(resumed_dir)
    resumed = run_distributed(_train, config, world_size=2, timeout=300)[0]
    assert resumed["start_step"] == 2
    for step in (3, 4):
        assert resumed["losses"][step] == straight["losses"][step], step  # bit for bit, fp32


def _tiny_llama():
    from colo.apps import Llama, get_preset

    model = Llama(get_preset("tiny", num_hidden_layers=2, initializer_range=0.1))
    model.init_weights(7)
    return model.requires_grad_(False).eval()


def test_thread_and_process_workers_sample_the_same_rollout_and_it_survives_a_checkpoint(tmp_path):
    # the process worker: its own interpreter, the weights in shared memory, refreshed in place between launches
    from colo.apps.generation import SamplingParams
    from colo.apps.rlhf.async_rollouts import BackgroundRollouts

    policy = _tiny_llama()
    params = SamplingParams(max_new_tokens=5, temperature=1.0, n=3, eos_token_id=2, pad_token_id=0, vocab_limit=100)
    prompts = [[1, 17, 29, 33], [1, 45]]
    rollouts = {}
    for worker in ("thread", "process"):
        background = BackgroundRollouts(lambda state: _tiny_llama(), device=torch.device("cpu"), worker=worker)
        try:
            for step, scale in ((4, 1.0), (5, 1.5)):  # the second launch refreshes the copy with other weights
                state = {name: tensor * scale for name, tensor in policy.state_dict().items()}
                background.launch(state, prompts, params, 1234 + step, step=step, indices=[3, 8])
                pending = background.take()
                assert pending.step == step and pending.indices == [3, 8] and pending.generate_seconds > 0
                rollouts[worker, step] = pending.rollout
        finally:
            background.close()
    for step in (4, 5):
        thread, process = rollouts["thread", step], rollouts["process", step]
        for name in ("input_ids", "attention_mask", "response_mask", "logprobs", "prompt_index"):
            assert torch.equal(getattr(thread, name), getattr(process, name)), (step, name)
    assert not torch.equal(rollouts["thread", 4].logprobs, rollouts["thread", 5].logprobs)  # the refresh took

    # a checkpoint waits for the rollout in flight and saves it; a new worker loads it as the next one to take
    background = BackgroundRollouts(lambda state: _tiny_llama(), device=torch.device("cpu"))
    background.launch(policy.state_dict(), prompts, params, 99, step=6, indices=[1, 2])
    assert background.save(str(tmp_path), rank=0, keep=2) == 6
    saved = background.take()
    background.close()
    restored = BackgroundRollouts(lambda state: _tiny_llama(), device=torch.device("cpu"))
    restored.load(str(tmp_path), 6, rank=0)
    loaded = restored.take()
    assert loaded.step == 6 and loaded.indices == [1, 2] and restored.take() is None
    for name in ("input_ids", "attention_mask", "response_mask", "logprobs", "prompt_index"):
        assert torch.equal(getattr(loaded.rollout, name), getattr(saved.rollout, name)), name
    assert loaded.rollout.prompt_length == saved.rollout.prompt_length
    with pytest.raises(FileNotFoundError, match="grpo.max_staleness"):
        restored.load(str(tmp_path), 7, rank=0)
