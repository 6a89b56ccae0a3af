"""Packed rows in the GRPO update (`colo.apps.rlhf.packing`, ``grpo.pack_rows``).

On a hand-made rollout batch of prompts of 2-6 tokens (left-padded to 6) and responses of 0-9 tokens (right-padded to
9), the rollout forward with the rows packed (each row's segment a document of its own in rows of twice the batch's
width; one forward) gives the padded forward's log-probs and entropies (atol 1e-5), and the GRPO loss (clipped ratio, k3
KL, seq-mean-token-mean) and every parameter gradient through it equal the padded update's (rtol 1e-5, atol 1e-6; fp32:
attention sums over the same keys in another layout, so not bit-identical) while computing half the positions. A row
without a response needs nothing; a budget shorter than a row's segment is refused; the packed rows hold each segment at
positions from 0 under its own document id, and no log-prob leaks across two segments (a changed token in one row leaves
the other rows' log-probs as they were).
"""

from __future__ import annotations

import pytest
import torch

PROMPT, RESPONSE = 6, 9
PROMPT_LENGTHS = [6, 2, 4, 3, 6, 5, 2, 4]
RESPONSE_LENGTHS = [9, 3, 0, 7, 1, 9, 5, 2]


def _model(pack_rows: bool):
    from colo.apps import Llama, get_preset
    from colo.apps.rlhf import attach_rollout_forward

    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(7)
    return attach_rollout_forward(model, temperature=0.8, share_prompts=False, pack_rows=pack_rows)


def _batch() -> dict:
    from colo.apps.generation import Rollout, rollout_model_inputs

    generator = torch.Generator().manual_seed(3)
    rows = len(PROMPT_LENGTHS)
    input_ids = torch.randint(4, 128, (rows, PROMPT + RESPONSE), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        input_ids[row, : PROMPT - length] = 0
        attention_mask[row, : PROMPT - length] = 0
    response_mask = (torch.arange(RESPONSE)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]).long()
    input_ids[:, PROMPT:][response_mask == 0] = 0
    attention_mask[:, PROMPT:] = response_mask
    rollout = Rollout(input_ids, attention_mask, response_mask, torch.zeros(rows, RESPONSE), PROMPT,
                      torch.arange(rows), 0.8)  # fmt: skip
    mask = response_mask.float()
    return {
        **rollout_model_inputs(rollout, hf=False),
        "response_mask": response_mask,
        "advantages": torch.randn(rows, generator=generator),
        "old_logps": (-4.0 + 0.3 * torch.randn(rows, RESPONSE, generator=generator)) * mask,
        "ref_logps": (-4.2 + 0.3 * torch.randn(rows, RESPONSE, generator=generator)) * mask,
    }


_INPUTS = ("input_ids", "position_ids", "document_ids", "response_mask")


def _loss_and_grads(pack_rows: bool) -> tuple:
    from colo.apps.rlhf import GRPOCriterion, global_counts

    model, batch = _model(pack_rows), _batch()
    criterion = GRPOCriterion(loss_aggregation="seq-mean-token-mean", beta=0.1, eps_low=0.2, eps_high=0.28)
    criterion.prepare(global_counts(batch["response_mask"], max_new_tokens=RESPONSE), num_microbatches=1,
                      num_data_ranks=1)  # fmt: skip
    output = model(**{key: batch[key] for key in _INPUTS})
    loss = criterion(output, batch)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return output, loss.detach(), grads, model.pack_tokens


def test_packed_update_equals_the_padded_update():
    padded, padded_loss, padded_grads, padded_count = _loss_and_grads(pack_rows=False)
    packed, packed_loss, packed_grads, (computed_padded, computed_packed) = _loss_and_grads(pack_rows=True)
    assert padded_count == [0, 0]  # the padded forward does not count
    mask = _batch()["response_mask"].float()  # (the padded forward also scores the padding after each response)
    for key in ("logps", "entropy"):
        torch.testing.assert_close(packed[key], padded[key] * mask, rtol=1e-5, atol=1e-5, msg=key)
    assert bool((padded["logps"] != 0).any()) and bool((packed["logps"][2] == 0).all())  # row 2 has no response
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    assert abs(float(padded_loss)) > 1e-3
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert any(float(grad.abs().max()) > 1e-3 for grad in padded_grads.values())
    # 8 rows of 15 = 120 positions; the segments need 14+13+9+6+6+4+4 = 56 of them, in 2 rows of the default budget
    # of 30 (first fit, longest first: 14+13, then 9+6+6+4+4)
    assert (computed_padded, computed_packed) == (120, 60)


def test_pack_rollout_rows_layout_and_isolation():
    from colo.apps.rlhf.packing import pack_rollout_rows

    batch = _batch()
    packed = pack_rollout_rows(batch["input_ids"], batch["position_ids"], batch["response_mask"])
    needed = [p - 1 + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS) if r]  # prompt + response - 1 tokens
    assert sum(needed) == int((packed.document_ids >= 0).sum()) - int(_tail(packed))
    for row in range(packed.input_ids.shape[0]):  # positions restart at each new document
        documents, positions = packed.document_ids[row], packed.position_ids[row]
        starts = torch.cat([torch.tensor([True]), documents[1:] != documents[:-1]])
        assert bool((positions[starts] == 0).all())
    assert packed.targets.numel() == sum(RESPONSE_LENGTHS)
    with pytest.raises(ValueError, match="more than the budget of 10"):
        pack_rollout_rows(batch["input_ids"], batch["position_ids"], batch["response_mask"], budget=10)
    # no leak across segments: another token in row 0's response changes no other row's log-probs
    model = _model(pack_rows=True)
    inputs = {key: batch[key] for key in _INPUTS}
    with torch.no_grad():
        before = model(**inputs)["logps"]
        changed = dict(inputs, input_ids=inputs["input_ids"].clone())
        changed["input_ids"][0, PROMPT + 2] += 1
        after = model(**changed)["logps"]
    assert not torch.equal(after[0], before[0]) and torch.equal(after[1:], before[1:])


def _tail(packed) -> int:
    """Positions after each packed row's last segment (its tail padding)."""
    tail = 0
    for row in range(packed.input_ids.shape[0]):
        documents = packed.document_ids[row]
        last = int(documents[-1])
        segment_ids = documents[: int((documents < last).sum())]
        tail += int((documents == last).sum()) if len(segment_ids) and _is_padding(packed, row, last) else 0
    return tail


def _is_padding(packed, row: int, document: int) -> bool:
    columns = (packed.document_ids[row] == document).nonzero().flatten()
    return bool((packed.input_ids[row, columns] == 0).all()) and not bool((packed.rows == row).logical_and(
        torch.isin(packed.columns, columns)).any())  # fmt: skip


# --- the trainer ---------------------------------------------------------------------------------------------------


def _train(output_dir: str, pack_rows: bool) -> dict:
    from colo.apps.train import load_config, train

    config = load_config(preset="tiny-grpo", overrides=[
        f"output_dir={output_dir}", f"grpo.pack_rows={str(pack_rows).lower()}", "grpo.synthetic_prompts=48",
        "grpo.group_size=4", "grpo.sft_steps=1", "grpo.max_new_tokens=8", "data.global_batch_size=4",
        "schedule.total_steps=3", "schedule.warmup_steps=1", "eval.every_steps=100", "eval.num_sequences=8",
        "logging.every_steps=1", "logging.progress_bar=false", "logging.tensorboard=false", "sample.max_new_tokens=0",
        "checkpoint.every_steps=100", f"grpo.reward_functions=[{__name__}:varied_reward]",
    ])  # fmt: skip
    return {"losses": train(config).losses}


def varied_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies within a group: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def test_grpo_run_with_packed_rows_matches_the_padded_run(tmp_path):
    import json

    from colo.comm.testing import run_distributed

    runs = {}
    for pack in (False, True):
        losses = run_distributed(_train, str(tmp_path / str(pack)), pack, world_size=1, timeout=180)[0]["losses"]
        with open(tmp_path / str(pack) / "metrics.jsonl") as lines:
            runs[pack] = losses, {r["step"]: r for r in map(json.loads, lines) if "loss" in r}
    (padded, padded_metrics), (packed, packed_metrics) = runs[False], runs[True]
    assert sorted(packed) == [1, 2, 3]
    for step in (2, 3):  # GRPO steps (the policy's update and the reference's forward packed)
        assert packed[step] == pytest.approx(padded[step], rel=1e-5, abs=1e-6), step
        for name in ("grad_norm", "grpo/kl", "grpo/entropy", "grpo/reward_mean"):
            wanted = padded_metrics[step][name]
            assert packed_metrics[step][name] == pytest.approx(wanted, rel=1e-5, abs=1e-7), (step, name)
        assert "grpo/pack_padding_saved" not in padded_metrics[step]
        # (reported; here nothing is saved: every completion runs to the budget and the prompts differ by a token or
        # two, so two 13-token segments fill each packed row of 30 as two padded rows of 15 did)
        assert 0.0 <= packed_metrics[step]["grpo/pack_padding_saved"] < 1.0
        assert packed_metrics[step]["grad_norm"] > 1e-3
