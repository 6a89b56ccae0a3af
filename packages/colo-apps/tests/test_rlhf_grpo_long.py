"""The ``tiny-grpo-long`` preset: GRPO on worked-solution answers (several times tiny-grpo's) under HybridParallel
sp2.

1. The worked answers (`colo.apps.rlhf.synthetic.worked_sum`, GSM8K's form) are right, end in ``#### <sum>``, and the
   math-answer checker scores a completion by the number after ``####``: the worked answer itself 1, the same steps
   with another final number 0.
2. The preset validates as written (hybrid sp2 Ulysses, 36 new tokens, the math-answer reward), and a 2-rank run of
   it (1 SFT step, then 1 GRPO step, on fewer prompts) trains, generates responses longer than tiny-grpo's whole
   budget, and logs the GRPO metrics with the rollout's log-probs equal to the sp trainer's recompute; the GRPO step
   runs at the preset's own RL learning rate (``grpo.lr``). (The learning runs and their figures are in the colo-apps
   README.)
"""

from __future__ import annotations

import json

import pytest

from colo.comm.testing import run_distributed


def test_worked_answers_end_in_the_sum_and_score_by_it():
    from colo.apps.rlhf.math_answer import math_answer
    from colo.apps.rlhf.synthetic import arithmetic_prompts, worked_sum

    assert worked_sum(12, 9) == "2+9=11, 10+0=10, 10+11=21 #### 21"
    assert worked_sum(3, 4) == "3+4=7, 0+0=0, 0+7=7 #### 7"
    records = arithmetic_prompts(400, max_operand=20, worked=True)
    plain = arithmetic_prompts(400, max_operand=20)
    for record, sum_record in zip(records, plain):
        assert record["prompt"] == sum_record["prompt"]
        a, b = map(int, record["prompt"].rstrip("=").split("+"))
        solution, final = record["answer"].split(" #### ")
        steps = [step.split("=") for step in solution.split(", ")]
        assert all(sum(map(int, left.split("+"))) == int(right) for left, right in steps)
        assert int(steps[-1][1]) == int(final) == a + b and sum_record["answer"] == str(a + b)
    longest = max(len(record["answer"]) for record in records)
    assert longest == len("9+9=18, 10+10=20, 20+18=38 #### 38") and longest + 1 <= 36  # with eos: max_new_tokens
    prompts = [r["prompt"] for r in records[:3]]
    answers = [r["answer"] for r in records[:3]]
    wrong = [answer + "1" for answer in answers]  # another number after ####
    assert math_answer(prompts, answers, answer=answers) == [1.0, 1.0, 1.0]
    assert math_answer(prompts, wrong, answer=answers) == [0.0, 0.0, 0.0]


def _run(output_dir: str) -> dict:
    from colo.apps.train import load_config, train

    config = load_config(preset="tiny-grpo-long", overrides=[
        f"output_dir={output_dir}", "grpo.synthetic_prompts=48", "grpo.group_size=4", "grpo.sft_steps=1",
        "data.global_batch_size=2", "schedule.total_steps=2", "schedule.warmup_steps=1", "eval.every_steps=100",
        "eval.num_sequences=8", "logging.every_steps=1", "logging.progress_bar=false", "logging.tensorboard=false",
        "sample.max_new_tokens=0", "checkpoint.every_steps=100",
    ])  # fmt: skip
    return {"losses": train(config).losses}


def test_tiny_grpo_long_preset_runs_under_sp2(tmp_path):
    from colo.apps.train import load_config

    config = load_config(preset="tiny-grpo-long")
    assert (config.plugin.name, config.plugin.sp, config.plugin.sp_mode) == ("hybrid", 2, "ulysses")
    assert config.grpo.synthetic_answer == "worked" and config.grpo.max_new_tokens == 9 * 4  # tiny-grpo: 4
    assert config.grpo.reward_functions == ["colo.apps.rlhf.math_answer:math_answer"]
    results = run_distributed(_run, str(tmp_path), world_size=2, timeout=180)
    assert results[0]["losses"] == results[1]["losses"] and sorted(results[0]["losses"]) == [1, 2]
    with open(tmp_path / "metrics.jsonl") as lines:
        records = {r["step"]: r for r in map(json.loads, lines) if "loss" in r}
    assert records[1]["grpo/sft_loss"] > 0
    assert records[2]["grpo/response_length"] > 4  # longer than tiny-grpo's whole budget
    assert records[2]["grpo/logprob_mismatch_max"] < 1e-5  # rollout log-probs == the sp trainer's recompute
    assert records[2]["lr"] == pytest.approx(config.grpo.lr, rel=1e-12)  # the RL steps' own LR (grpo.lr)
