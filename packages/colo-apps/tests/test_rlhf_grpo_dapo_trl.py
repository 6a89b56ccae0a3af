"""DAPO's settings in colo's GRPO equal trl 1.16's, from the completions to the loss and every gradient.

TRL runs its own ``GRPOTrainer._generate_and_score_completions`` on completions handed in through its public
``rollout_func`` (no sampling): its rewards (a task reward plus ``trl.rewards.get_soft_overlong_punishment``), its group
advantages, its ``mask_truncated_completions``, then ``_compute_loss`` with ``loss_type="dapo"`` and ``epsilon_high``
(clip-higher), on-policy (the old log-probs are the forward's, detached) and beta 0, DAPO's settings. colo takes the
same completions as a `Rollout`: the same task reward through `compute_rewards` (which passes ``completion_ids`` as TRL
does), its own `soft_overlong_punishment`, `group_advantages`, `truncated_rows` and `GRPOCriterion` with token-mean.

The completions: two prompts of four, ended by an eos at lengths 1-6 (one inside the overlong buffer, one at the
budget) or truncated at the budget without one. Tolerances: rewards and advantages 1e-6 (float32 vs float64 sums),
loss and gradients 1e-5 (TRL takes log-probs through its tiled LM head, colo through a log-softmax: the same numbers
summed in another order). Prompts have equal lengths, so both sides' positions are 0, 1, 2, ... (see
test_rlhf_grpo_trl.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

G, PROMPT_LEN, MAX_NEW, BUFFER = 4, 5, 6, 3
EPS_LOW, EPS_HIGH, TEMPERATURE = 0.2, 0.28, 0.7
EOS, PAD = 1, 0
PROMPT_IDS = [[5, 9, 12, 7, 3], [20, 4, 4, 11, 8]]
COMPLETIONS = [  # rows of one prompt contiguous
    [3, 14, 9, 22, 5, 17],  # truncated (no eos at the budget)
    [6, 9, EOS],
    [EOS],
    [4, 4, 10, 12, 3, EOS],  # ends at the budget with an eos: not truncated, full overlong penalty
    [7, 8, 19, EOS],  # inside the buffer
    [13, 6, 21, 25, 10, 4],  # truncated
    [11, EOS],
    [12, 5, 6, 8, EOS],  # inside the buffer
]


def task_reward(completions, completion_ids, **_) -> list[float]:
    """A verifiable-looking reward that varies within each group: 1 when the first token is even."""
    return [float(ids[0] % 2 == 0) for ids in completion_ids]


def make_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config)


def _tokenizer():
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 48)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def _rollout_func(prompts, trainer):
    owners = [int(prompt[1:]) for prompt in prompts]  # "p0" / "p1", repeated once per completion
    return {
        "prompt_ids": [list(PROMPT_IDS[i]) for i in owners],
        "completion_ids": [list(ids) for ids in COMPLETIONS],
        "logprobs": None,
    }


def trl_side(tmp_path):
    import datasets
    import trl
    from trl.rewards import get_soft_overlong_punishment

    config = trl.GRPOConfig(
        output_dir=str(tmp_path),
        loss_type="dapo",
        beta=0.0,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        mask_truncated_completions=True,
        temperature=TEMPERATURE,
        num_generations=G,
        max_completion_length=MAX_NEW,
        per_device_train_batch_size=len(COMPLETIONS),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
    )
    trainer = trl.GRPOTrainer(
        model=make_model(),
        reward_funcs=[task_reward, get_soft_overlong_punishment(MAX_NEW, BUFFER)],
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": "p0"}] * 8),
        processing_class=_tokenizer(),
        rollout_func=_rollout_func,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = [{"prompt": f"p{row // G}"} for row in range(len(COMPLETIONS))]
    out = trainer._generate_and_score_completions(inputs)
    assert out.get("old_per_token_logps") is None  # on-policy, as colo's single update per rollout
    loss = trainer._compute_loss(trainer.model, out)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    return out, loss.detach(), grads


def colo_rollout():
    from colo.apps.generation import Rollout

    rows, width = len(COMPLETIONS), max(len(ids) for ids in COMPLETIONS)
    input_ids = torch.full((rows, PROMPT_LEN + width), PAD)
    response_mask = torch.zeros(rows, width, dtype=torch.long)
    for row, ids in enumerate(COMPLETIONS):
        input_ids[row, :PROMPT_LEN] = torch.tensor(PROMPT_IDS[row // G])
        input_ids[row, PROMPT_LEN : PROMPT_LEN + len(ids)] = torch.tensor(ids)
        response_mask[row, : len(ids)] = 1
    return Rollout(
        input_ids=input_ids,
        attention_mask=torch.cat([torch.ones(rows, PROMPT_LEN, dtype=torch.long), response_mask], dim=1),
        response_mask=response_mask,
        logprobs=torch.zeros(rows, width),
        prompt_length=PROMPT_LEN,
        prompt_index=torch.arange(rows) // G,
        temperature=TEMPERATURE,
    )


def colo_side():
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf import GRPOCriterion, attach_rollout_forward, compute_rewards, global_counts, group_advantages
    from colo.apps.rlhf.dapo import soft_overlong_punishment, truncated_rows

    rollout = colo_rollout()
    completions = ["text"] * rollout.num_rows  # the task reward reads the ids
    rewards = compute_rewards(
        {"task_reward": task_reward}, ["p"] * rollout.num_rows, completions, completion_ids=rollout.responses()
    )
    lengths = rollout.response_mask.sum(dim=1)
    rewards = (rewards.double() + soft_overlong_punishment(lengths, max_length=MAX_NEW, buffer=BUFFER)).float()
    advantages = group_advantages(rewards, G, estimator="grpo")
    truncated = truncated_rows(rollout, EOS)
    mask = rollout.response_mask * (~truncated).long().unsqueeze(1)
    model = make_model()
    attach_rollout_forward(model, temperature=TEMPERATURE)
    criterion = GRPOCriterion(loss_aggregation="token-mean", beta=0.0, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    criterion.prepare(global_counts(mask, max_new_tokens=MAX_NEW), num_microbatches=1, num_data_ranks=1)
    batch = {**rollout_model_inputs(rollout, hf=True), "response_mask": mask, "advantages": advantages}
    loss = criterion(model(**batch), batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return rewards, advantages, mask, loss.detach(), grads


def test_dapo_rewards_masks_loss_and_gradients_equal_trl(tmp_path):
    out, expected_loss, expected_grads = trl_side(tmp_path)
    rewards, advantages, mask, loss, grads = colo_side()

    # the overlong punishment: 0 up to L - B = 3 tokens, then -(n - 3) / 3, -1 at the budget
    from trl.rewards import get_soft_overlong_punishment

    expected_shaping = get_soft_overlong_punishment(MAX_NEW, BUFFER)(COMPLETIONS)
    assert sorted(set(expected_shaping)) == [-1.0, -2 / 3, -1 / 3, 0.0]  # every branch of the ramp is covered
    task = torch.tensor(task_reward(None, COMPLETIONS), dtype=torch.float64)
    torch.testing.assert_close(rewards.double() - task, torch.tensor(expected_shaping, dtype=torch.float64))
    torch.testing.assert_close(advantages, out["advantages"].float(), rtol=1e-6, atol=1e-6)

    # truncated rows leave the loss: TRL's completion mask after mask_truncated_completions
    assert mask.sum(dim=1).tolist() == [0, 3, 1, 6, 4, 0, 2, 5]
    width = out["completion_mask"].shape[1]
    torch.testing.assert_close(mask[:, :width], out["completion_mask"].long())

    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    assert expected_loss.abs() > 1e-3
    assert set(grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
