"""The math-answer reward (`colo.apps.rlhf.math_answer`): extraction, normalization, comparison, and the reward
function as the trainer calls it (loaded by path, fed the prompt records' ``answer`` column)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{3} first, then \boxed{x^{2} + 1}", r"x^{2} + 1"),  # the last box, nested braces kept
        (r"\fbox{7}", "7"),
        (r"\boxed 42 is it", "42"),
        (r"\boxed{unclosed then \boxed{5}", "5"),
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("#### 1,000\nmore text 3", "1,000"),
        ("12+7 makes 19, I think. Or 20.", "20"),
        ("a total of -3.5 degrees", "-3.5"),
        ("no answer here", None),
    ],
)
def test_extract_answer(text, expected):
    from colo.apps.rlhf.math_answer import extract_answer

    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "predicted, expected, match",
    [
        ("19", "19", True),
        ("19.0", "19", True),
        ("0.5", r"\frac{1}{2}", True),
        (r"\dfrac{1}{2}", "1/2", True),
        (r"-\frac{3}{4}", "-0.75", True),
        ("1,000", "1000", True),
        ("$72$.", "72", True),
        ("x = 5", "5", True),
        (r"\text{(B)}", "(B)", True),
        (r"\left( 1, 2 \right)", "(1,2)", True),
        ("18", "19", False),
        ("0.33", "1/3", False),  # exact rationals: no rounding
        ("x^2+1", "x^2 + 1", True),
        ("x^2+1", "1+x^2", False),  # no symbolic algebra: math-verify's domain
    ],
)
def test_answers_match(predicted, expected, match):
    from colo.apps.rlhf.math_answer import answers_match

    assert answers_match(predicted, expected) is match


def test_math_answer_is_a_reward_function_of_the_arithmetic_prompts():
    from colo.apps.rlhf import arithmetic_prompts, compute_rewards, exact_answer, load_reward_function

    records = arithmetic_prompts(4, seed=1)
    answers = [record["answer"] for record in records]
    completions = [
        answers[0],  # bare, as the tiny-grpo policy answers
        f"{records[1]['prompt']} the sum is {answers[1]}.",
        rf"\boxed{{{int(answers[2]) + 1}}} or maybe {answers[2]}",  # the box wins: wrong
        "I don't know",
    ]
    function = load_reward_function("colo.apps.rlhf.math_answer:math_answer")
    prompts = [record["prompt"] for record in records]
    rewards = compute_rewards({"math": function}, prompts, completions, {"answer": answers})
    torch.testing.assert_close(rewards, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    # on bare answers it agrees with the exact-match reward of the preset
    assert function(prompts, answers, answer=answers) == exact_answer(prompts, answers, answers)
    # a whole GSM8K solution as the record's answer is reduced to its final answer first
    gsm8k = ["She sold 48 + 24 = 72 clips.\n#### 72"]
    assert function(["q"], [r"Thus \boxed{72}."], answer=gsm8k) == [1.0]
    assert function(["q"], ["It is 71."], answer=gsm8k) == [0.0]


def test_the_trainer_feeds_math_answer_the_prompt_and_answer_columns():
    from colo.apps.generation import Rollout
    from colo.apps.rlhf.grpo_task import GRPOTask
    from colo.apps.train import load_config

    config = load_config(
        preset="tiny-grpo",
        overrides=["grpo.reward_functions=[colo.apps.rlhf.math_answer:math_answer]", "grpo.synthetic_prompts=8"],
    )
    task = GRPOTask(config)
    train = GRPOTask.dataset_rows(config, task.tokenizer)[0]
    records = [train[0], train[1]]
    texts = [records[0]["answer"], "99999", f"= {records[1]['answer']}", "nothing"]
    ids = [task.tokenizer.encode(text) + [task.tokenizer.eos_id] for text in texts]
    width = max(len(row) for row in ids)
    response = torch.full((4, width), task.tokenizer.pad_id)
    mask = torch.zeros(4, width, dtype=torch.long)
    for row, tokens in enumerate(ids):
        response[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
    prompt = torch.ones(4, 1, dtype=torch.long)
    rollout = Rollout(
        input_ids=torch.cat([prompt, response], dim=1),
        attention_mask=torch.cat([prompt, mask], dim=1),
        response_mask=mask,
        logprobs=torch.zeros(4, width),
        prompt_length=1,
        prompt_index=torch.tensor([0, 0, 1, 1]),
    )
    rewards, completions = task._score(records, rollout)
    assert completions == texts  # decoded, eos off
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
