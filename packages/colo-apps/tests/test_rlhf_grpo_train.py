"""GRPO in the Booster and the one trainer: aggregation invariance of an update, bad input, and a short 2-process
``data.task: grpo`` run that resumes bit for bit.

Aggregation invariance: the same rollout batch (left-padded prompts of three lengths, responses of five lengths
ended by an eos or the budget, fixed advantages, old and reference log-probs) gives the same loss and the same
gradient (rtol 1e-6, fp32) whether one process takes it in one microbatch or four, or two data-parallel ranks take
half each in one or two microbatches: the aggregation's global counts (`global_counts`, all-reduced) make the
Booster's mean over microbatches and ranks the aggregated loss itself.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from colo.apps.train.metrics import step_line
from colo.comm.testing import run_distributed

SEED, ROWS, PROMPT, RESPONSE, TEMPERATURE = 3, 8, 5, 6, 0.8


def _rollout_batch() -> dict:
    """A hand-made rollout of ``ROWS`` rows (groups of 4 contiguous) in the trainer's batch layout."""
    from colo.apps.generation import Rollout, rollout_model_inputs

    generator = torch.Generator().manual_seed(5)
    prompt_lengths = [5, 5, 5, 5, 2, 2, 2, 2]
    response_lengths = torch.tensor([6, 3, 1, 6, 4, 6, 2, 5])
    input_ids = torch.randint(4, 128, (ROWS, PROMPT + RESPONSE), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate(prompt_lengths):
        input_ids[row, : PROMPT - length] = 0
        attention_mask[row, : PROMPT - length] = 0
    response_mask = (torch.arange(RESPONSE)[None, :] < response_lengths[:, None]).long()
    ended = response_lengths < RESPONSE
    input_ids[torch.arange(ROWS)[ended], PROMPT + response_lengths[ended] - 1] = 3  # the eos
    responses = input_ids[:, PROMPT:]
    responses[response_mask == 0] = 0
    attention_mask[:, PROMPT:] = response_mask
    rollout = Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=torch.zeros(ROWS, RESPONSE),
        prompt_length=PROMPT,
        prompt_index=torch.arange(ROWS) // 4,
        temperature=TEMPERATURE,
    )
    old = (-4.0 + 0.3 * torch.randn(ROWS, RESPONSE, generator=generator)) * response_mask
    ref = (-4.0 + 0.3 * torch.randn(ROWS, RESPONSE, generator=generator)) * response_mask
    return {
        **rollout_model_inputs(rollout, hf=False),
        "response_mask": response_mask,
        "advantages": torch.randn(ROWS, generator=generator),
        "old_logps": old,
        "ref_logps": ref,
    }


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it stepped with."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def _update_case(num_microbatches: int, aggregation: str) -> dict:
    from colo.apps import DDP, Booster, Llama, get_preset
    from colo.apps.rlhf import GRPOCriterion, attach_rollout_forward, global_counts

    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(SEED)
    attach_rollout_forward(model, temperature=TEMPERATURE)
    criterion = GRPOCriterion(loss_aggregation=aggregation, beta=0.04, eps_low=0.2, eps_high=0.28)
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    booster = Booster(DDP(num_microbatches=num_microbatches))
    booster.boost(model, optimizer, criterion=criterion)
    group = booster.mesh.group("dp")
    rows = ROWS // group.size
    batch = {key: value[group.rank * rows : (group.rank + 1) * rows] for key, value in _rollout_batch().items()}
    counts = global_counts(batch["response_mask"], max_new_tokens=RESPONSE, group=group)
    criterion.prepare(counts, num_microbatches=num_microbatches, num_data_ranks=group.size)
    result = booster.train_step(batch)
    return {"loss": float(result.loss), "grads": optimizer.grads}


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_is_the_same_under_dp1_dp2_and_one_or_four_microbatches(aggregation):
    cases = {
        "dp1 x 1": run_distributed(_update_case, 1, aggregation, world_size=1, timeout=120)[0],
        "dp1 x 4": run_distributed(_update_case, 4, aggregation, world_size=1, timeout=120)[0],
        "dp2 x 1": run_distributed(_update_case, 1, aggregation, world_size=2, timeout=120)[0],
        "dp2 x 2": run_distributed(_update_case, 2, aggregation, world_size=2, timeout=120)[0],
    }
    reference = cases.pop("dp1 x 1")
    assert abs(reference["loss"]) > 1e-3
    for name, case in cases.items():
        assert case["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=1e-7), name
        for grad, expected in zip(case["grads"], reference["grads"], strict=True):
            scale = float(expected.abs().max())
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6 * scale, msg=name)


# --- bad input ---------------------------------------------------------------------------------------------------


def test_bad_runs_name_the_field():
    from colo.apps.train import ConfigError, load_config

    config = load_config(preset="tiny-grpo")
    assert config.data.task == "grpo" and config.grpo.sft_steps > 0
    cases = [
        (["grpo.group_size=1"], "grpo.group_size=1 samples per prompt with the 'grpo' advantage"),
        (["grpo.group_size=1", "grpo.advantage=rloo"], "leave-one-out"),
        (["grpo.synthetic_prompts=0"], "needs data.paths"),
        (
            ["plugin.name=hybrid", "plugin.pp=2", "plugin.sp=2", "plugin.sp_mode=ring", "schedule.num_microbatches=2"],
            "plugin.sp=2 is not supported with a pipeline",
        ),
        (["grpo.sft_steps=300"], "leaves no GRPO step"),
        (["grpo.reward_functions=[]"], "reward_functions is empty"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(preset="tiny-grpo", overrides=overrides)
    with pytest.raises(ConfigError, match="only with data.task='grpo'"):
        load_config(preset="tiny-llama", overrides=["grpo.beta=0.1"])


def test_prompts_over_the_budget_and_bad_reward_functions_fail_clearly():
    from colo.apps.rlhf import RewardFunctionError, compute_rewards, load_reward_function
    from colo.apps.rlhf.grpo_task import GRPOTask
    from colo.apps.train import load_config

    config = load_config(preset="tiny-grpo", overrides=["grpo.max_prompt_len=3"])
    with pytest.raises(ValueError, match="over the budget grpo.max_prompt_len=3"):
        GRPOTask(config)

    with pytest.raises(RewardFunctionError, match="has no attribute"):
        load_reward_function("colo.apps.rlhf.rewards:no_such_reward")
    with pytest.raises(RewardFunctionError, match="module:function"):
        load_reward_function("colo.apps.rlhf.rewards.exact_answer")

    def raises(prompts, completions, **_):
        raise KeyError("answer")

    def short(prompts, completions, **_):
        return [1.0] * (len(completions) - 1)

    def text(prompts, completions, **_):
        return ["1"] * len(completions)

    for function, message in [
        (raises, "'raises' raised KeyError"),
        (short, "returned 2 values for 3 completions"),
        (text, "rewards are floats"),
        (lambda **_: 1.0, "one float per completion"),
    ]:
        name = getattr(function, "__name__", "fn")
        with pytest.raises(RewardFunctionError, match=message):
            compute_rewards({name: function}, ["a"] * 3, ["x", "y", "z"])


# --- the trainer ---------------------------------------------------------------------------------------------------


def _short_config(output_dir: str, **changes) -> dict:
    from colo.apps.train import load_config

    overrides = [
        f"output_dir={output_dir}",
        "grpo.synthetic_prompts=48",
        "grpo.group_size=4",
        "grpo.sft_steps=2",
        "data.global_batch_size=4",
        "schedule.total_steps=6",
        "schedule.warmup_steps=1",
        "eval.every_steps=3",
        "eval.num_sequences=8",
        "logging.every_steps=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "sample.max_new_tokens=0",
        "checkpoint.every_steps=3",
        *[f"{key}={value}" for key, value in changes.items()],
    ]
    return load_config(preset="tiny-grpo", overrides=overrides).model_dump(mode="json")


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {"losses": result.losses, "start_step": result.start_step}


def _metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as lines:
        return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_grpo_run_logs_its_metrics_and_resumes_exactly(tmp_path):
    straight_dir, resumed_dir = str(tmp_path / "a"), str(tmp_path / "b")
    straight = run_distributed(_train, _short_config(straight_dir), world_size=2, timeout=180)[0]
    assert sorted(straight["losses"]) == list(range(1, 7))
    records = _metrics(straight_dir)
    grpo_steps = [r for r in records if "grpo/reward_mean" in r]
    assert [r["step"] for r in grpo_steps] == [3, 4, 5, 6]  # the steps after the 2 SFT steps
    for record in grpo_steps:
        for name in ("kl", "clip_fraction", "entropy", "response_length", "generation_tokens_per_second"):
            assert f"grpo/{name}" in record, name
        assert record["grpo/time_rollout"] > 0 and record["grpo/time_update"] > 0
        assert record["grpo/logprob_mismatch_max"] < 1e-5  # rollout log-probs == the trainer's recompute
        assert record["grpo/rollout_peak_bytes"] > 0  # the rollout's memory: in place under DDP, its KV cache
        line = step_line(record, total_steps=6)  # what the run prints: what RL users watch, under these names
        for name in ("reward_mean", "kl", "response_length", "clip_fraction"):
            assert f"| grpo/{name} " in line, line
    assert any("eval_grpo/greedy_reward" in r for r in records)
    assert os.path.exists(os.path.join(straight_dir, "checkpoints", "grpo-reference.safetensors"))

    run_distributed(_train, _short_config(resumed_dir, **{"schedule.stop_at_step": 5}), world_size=2, timeout=180)
    resumed = run_distributed(_train, _short_config(resumed_dir), world_size=2, timeout=180)[0]
    assert resumed["start_step"] == 3  # the checkpoint after step 3 (every 3 steps): the reference came with it
    for step in (4, 5, 6):
        assert resumed["losses"][step] == straight["losses"][step], step  # bit for bit, fp32


@pytest.mark.slow
def test_grpo_run_under_zero3_and_gemini_matches_ddp(tmp_path):
    # the policy's chunks are sharded: the rollout weights and the frozen reference are gathered chunk by chunk
    # (RolloutEngine.full_state_dict); fp32 parameters equal DDP's up to the reduce-scatter's summation order, so the
    # same tokens are sampled and the losses agree closely
    runs = {}
    for label, changes in (
        ("ddp", {}),
        ("zero3", {"plugin.name": "zero", "plugin.stage": 3}),
        ("gemini", {"plugin.name": "gemini"}),
    ):
        config = _short_config(str(tmp_path / label), **{"schedule.total_steps": 4, **changes})
        runs[label] = run_distributed(_train, config, world_size=2, timeout=180)[0]["losses"]
        assert sorted(runs[label]) == [1, 2, 3, 4], label
    for label in ("zero3", "gemini"):
        for step in (1, 2, 3, 4):
            assert runs[label][step] == pytest.approx(runs["ddp"][step], rel=1e-4, abs=1e-6), (label, step)
    assert os.path.exists(tmp_path / "gemini" / "checkpoints" / "grpo-reference.safetensors")
