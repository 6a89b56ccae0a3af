"""colo's GRPO loss and gradients equal trl 1.16's ``GRPOTrainer._compute_loss`` on given completions.

The same tiny Hugging Face Llama, prompts, completions (some ended by eos, the rest padded), advantages, old and
reference per-token log-probs go to TRL's loss (``_compute_loss(model, inputs)``, the generation step skipped) and to
colo's (`attach_rollout_forward` + `GRPOCriterion` with the global counts of the batch), for each aggregation mode
TRL has (``token-mean``: ``dapo``, ``seq-mean-token-mean``: ``grpo``, ``seq-mean-token-sum-norm``: ``dr_grpo``),
with beta > 0 (k3 KL to the reference), clip-higher and a sampling temperature != 1; without and (``dapo``) with the
KL term weighted by the importance ratio (TRL's ``use_bias_correction_kl``, its default).

Tolerance 1e-5 (fp32): TRL takes log-probs through its fused, tiled LM head, colo through a log-softmax over the
logits: the same numbers reduced in another order. Prompts have equal lengths: TRL's training forward gets no
position_ids (positions count from the left padding), colo's count from each row's first real token, as generation
fed them; with no padding both are 0, 1, 2, ...
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

G, PROMPTS, PROMPT_LEN, MAX_NEW = 4, 2, 5, 6
BETA, EPS_LOW, EPS_HIGH, TEMPERATURE = 0.04, 0.2, 0.28, 0.7
EOS, PAD = 1, 0


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


def fixture():
    """Rows of one prompt contiguous; completions end at an eos at different steps or run to MAX_NEW."""
    generator = torch.Generator().manual_seed(1)
    rows = G * PROMPTS
    prompt_ids = torch.randint(3, 48, (PROMPTS, PROMPT_LEN), generator=generator).repeat_interleave(G, dim=0)
    completion_ids = torch.randint(3, 48, (rows, MAX_NEW), generator=generator)
    lengths = torch.tensor([6, 3, 1, 6, 4, 6, 2, 5])
    mask = torch.arange(MAX_NEW)[None, :] < lengths[:, None]
    ended = lengths < MAX_NEW
    completion_ids[torch.arange(rows)[ended], lengths[ended] - 1] = EOS
    completion_ids[~mask] = PAD
    advantages = torch.randn(rows, generator=generator)
    old = -3.0 + 0.3 * torch.randn(rows, MAX_NEW, generator=generator)
    ref = -3.0 + 0.3 * torch.randn(rows, MAX_NEW, generator=generator)
    return prompt_ids, completion_ids, mask.long(), advantages, old * mask, ref * mask


def trl_loss_and_grads(loss_type: str, correction: bool, tmp_path):
    import datasets
    import transformers
    import trl

    prompt_ids, completion_ids, mask, advantages, old, ref = fixture()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(), eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / loss_type),
        loss_type=loss_type,
        beta=BETA,
        use_bias_correction_kl=correction,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        temperature=TEMPERATURE,
        num_generations=G,
        max_completion_length=MAX_NEW,
        per_device_train_batch_size=G * PROMPTS,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
    )
    model_dir = tmp_path / "model"  # with beta > 0 TRL loads its reference from the model's path
    make_model().save_pretrained(model_dir)
    trainer = trl.GRPOTrainer(
        model=str(model_dir),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * 8),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


def colo_loss_and_grads(aggregation: str, correction: bool):
    from colo.apps.rlhf.grpo import GRPOCriterion, attach_rollout_forward
    from colo.apps.rlhf.policy_loss import global_counts

    prompt_ids, completion_ids, mask, advantages, old, ref = fixture()
    model = make_model()
    attach_rollout_forward(model, temperature=TEMPERATURE)
    criterion = GRPOCriterion(
        loss_aggregation=aggregation,
        beta=BETA,
        kl_estimator="k3",
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        kl_ratio_correction=correction,
    )
    criterion.prepare(global_counts(mask, max_new_tokens=MAX_NEW), num_microbatches=1, num_data_ranks=1)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    batch = {
        "input_ids": input_ids,
        "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids),
        "attention_mask": torch.ones_like(input_ids),
        "response_mask": mask,
        "advantages": advantages,
        "old_logps": old,
        "ref_logps": ref,
    }
    loss = criterion(model(**batch), batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _word_tokenizer():
    import tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    return tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))


@pytest.mark.parametrize(
    "aggregation, loss_type, correction",
    [
        ("token-mean", "dapo", False),
        ("seq-mean-token-mean", "grpo", False),
        ("seq-mean-token-sum-norm", "dr_grpo", False),
        ("token-mean", "dapo", True),
    ],
)
def test_loss_and_gradients_equal_trl(aggregation, loss_type, correction, tmp_path):
    from colo.apps.rlhf.policy_loss import TRL_LOSS_TYPES

    assert TRL_LOSS_TYPES[aggregation] == loss_type
    expected_loss, expected_grads = trl_loss_and_grads(loss_type, correction, tmp_path)
    loss, grads = colo_loss_and_grads(aggregation, correction)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert expected_loss.abs() > 1e-3  # a loss that a wrong sign or a dropped term would change
