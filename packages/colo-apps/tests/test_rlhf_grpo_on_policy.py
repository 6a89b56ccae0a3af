"""GRPO's on-policy update: the old log-probs taken from the update's own forward (detached) instead of a separate
recompute forward give the same loss, the same gradients and the same updated weights.

One optimizer update per rollout batch (``grpo.epochs * grpo.minibatches == 1``): the weights that generated the
rollout are the weights the update's forward runs with, so `GRPOCriterion` takes ``old = logps.detach()`` when the
batch carries no ``old_logps`` (TRL and verl do the same), which saves one forward over the rollout. Both paths run
here on the same rollout batch, for colo's Llama and the Hugging Face Llama, in one microbatch and in two (the
recompute path splits its no-grad forward the way `GRPOTask._logps` does): losses, gradients and parameters after
the step must agree to rtol 1e-6 (fp32), and the log-probs the on-policy update hands back for the mismatch metric
must equal the recomputed ones (1e-6). A mutation check: old log-probs off by 0.05 change the loss.

Aggregation invariance holds on the on-policy path with prompts shared inside each group (the shared-prompt forward
of `attach_rollout_forward` runs): dp1 in one or four microbatches and dp2 in two give the same loss and gradients
(rtol 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

SEED, ROWS, PROMPT, RESPONSE, TEMPERATURE = 11, 8, 5, 6, 0.9


def _rollout(vocab: int):
    from colo.apps.generation import Rollout

    generator = torch.Generator().manual_seed(5)
    prompt_lengths = [5, 5, 5, 5, 2, 2, 2, 2]
    response_lengths = torch.tensor([6, 3, 1, 6, 4, 6, 2, 5])
    input_ids = torch.randint(4, vocab, (ROWS, PROMPT + RESPONSE), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate(prompt_lengths):
        input_ids[row, : PROMPT - length] = 0
        attention_mask[row, : PROMPT - length] = 0
    response_mask = (torch.arange(RESPONSE)[None, :] < response_lengths[:, None]).long()
    responses = input_ids[:, PROMPT:]
    responses[response_mask == 0] = 0
    attention_mask[:, PROMPT:] = response_mask
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=torch.zeros(ROWS, RESPONSE),
        prompt_length=PROMPT,
        prompt_index=torch.arange(ROWS) // 4,
        temperature=TEMPERATURE,
    ), torch.randn(ROWS, generator=generator)


def _model(kind: str):
    if kind == "native":
        from colo.apps import Llama, get_preset

        model = Llama(get_preset("tiny", initializer_range=0.1))
        model.init_weights(SEED)
        return model
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config)


class _RecordingSGD(torch.optim.SGD):
    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def _update(kind: str, path: str, num_microbatches: int, old_shift: float = 0.0) -> dict:
    from colo.apps import DDP, Booster
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf import GRPOCriterion, attach_rollout_forward, global_counts

    model = attach_rollout_forward(_model(kind), temperature=TEMPERATURE)
    reference = attach_rollout_forward(_model(kind), temperature=TEMPERATURE).requires_grad_(False)
    with torch.no_grad():  # a reference that is not the policy: the KL term is not zero
        for tensor in reference.parameters():
            tensor.add_(0.01 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(tensor.numel())))
    criterion = GRPOCriterion(loss_aggregation="token-mean", beta=0.04, eps_low=0.2, eps_high=0.28)
    optimizer = _RecordingSGD(model.parameters(), lr=0.5)
    booster = Booster(DDP(num_microbatches=num_microbatches))
    boosted, *_ = booster.boost(model, optimizer, criterion=criterion)
    rollout, advantages = _rollout(128)
    mask = rollout.response_mask
    batch = {**rollout_model_inputs(rollout, hf=kind == "hf"), "response_mask": mask, "advantages": advantages}
    size = ROWS // num_microbatches

    def chunked(forward) -> torch.Tensor:  # GRPOTask._logps: no grad, one microbatch's rows at a time
        with torch.no_grad():
            pieces = [
                forward({k: v[first : first + size] for k, v in batch.items() if k != "advantages"})["logps"]
                for first in range(0, ROWS, size)
            ]
        return torch.cat(pieces).float() * mask

    recomputed = chunked(booster.forward)
    batch["ref_logps"] = chunked(lambda micro: reference(**micro))
    if path == "recompute":
        batch["old_logps"] = recomputed + old_shift * mask
    criterion.prepare(global_counts(mask, max_new_tokens=RESPONSE), num_microbatches=num_microbatches, num_data_ranks=1)
    result = booster.train_step(batch)
    taken = criterion.take_forward_logps()
    return {
        "loss": float(result.loss),
        "grads": optimizer.grads,
        "params": [p.detach().clone() for p in booster.unwrap().parameters()],
        "recomputed": recomputed,
        "taken": taken,
        "metrics": criterion.take_metrics(),
    }


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_on_policy_old_logprobs_give_the_recompute_paths_update(kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    for microbatches in (1, 2):
        recompute = run_distributed(_update, kind, "recompute", microbatches, world_size=1, timeout=120)[0]
        on_policy = run_distributed(_update, kind, "on-policy", microbatches, world_size=1, timeout=120)[0]
        name = f"{kind}, {microbatches} microbatch(es)"
        assert recompute["taken"] is None, name  # the batch carried old_logps: nothing taken
        assert abs(recompute["loss"]) > 1e-4, name
        assert on_policy["loss"] == pytest.approx(recompute["loss"], rel=1e-6, abs=1e-8), name
        torch.testing.assert_close(on_policy["taken"], recompute["recomputed"], rtol=1e-6, atol=1e-6, msg=name)
        assert on_policy["metrics"]["ratio"] == pytest.approx(1.0, abs=1e-12), name
        assert on_policy["metrics"]["clip_fraction"] == 0.0, name
        for mine, theirs in zip(on_policy["grads"], recompute["grads"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6 * float(theirs.abs().max()), msg=name)
        for mine, theirs in zip(on_policy["params"], recompute["params"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=name)
    # mutation: old log-probs that are not the forward's change the update, so the comparison above can fail
    shifted = run_distributed(_update, kind, "recompute", 1, 0.05, world_size=1, timeout=120)[0]
    assert abs(shifted["loss"] - recompute["loss"]) > 1e-4 * max(abs(recompute["loss"]), 1e-3)


def _shared_update(num_microbatches: int) -> dict:
    """An on-policy update of colo's Llama on a batch whose groups of 4 rows share their prompt (the shared-prompt
    forward runs in each microbatch), this rank's half under dp2."""
    from colo.apps import DDP, Booster
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf import GRPOCriterion, attach_rollout_forward, global_counts

    model = attach_rollout_forward(_model("native"), temperature=TEMPERATURE)
    criterion = GRPOCriterion(loss_aggregation="seq-mean-token-mean", beta=0.04, eps_low=0.2)
    optimizer = _RecordingSGD(model.parameters(), lr=0.5)
    booster = Booster(DDP(num_microbatches=num_microbatches))
    booster.boost(model, optimizer, criterion=criterion)
    rollout, advantages = _rollout(128)
    rollout.input_ids[:, :PROMPT] = rollout.input_ids[::4, :PROMPT].repeat_interleave(4, dim=0)  # groups share
    mask = rollout.response_mask
    batch = {**rollout_model_inputs(rollout, hf=False), "response_mask": mask, "advantages": advantages}
    batch["ref_logps"] = -4.0 + 0.1 * torch.randn(ROWS, RESPONSE, generator=torch.Generator().manual_seed(3))
    group = booster.mesh.group("dp")
    rows = ROWS // group.size
    batch = {key: value[group.rank * rows : (group.rank + 1) * rows] for key, value in batch.items()}
    counts = global_counts(batch["response_mask"], max_new_tokens=RESPONSE, group=group)
    criterion.prepare(counts, num_microbatches=num_microbatches, num_data_ranks=group.size)
    result = booster.train_step(batch)
    return {"loss": float(result.loss), "grads": optimizer.grads}


def test_on_policy_shared_prompt_update_is_the_same_under_dp1_dp2_and_one_or_four_microbatches():
    cases = {
        "dp1 x 1": run_distributed(_shared_update, 1, world_size=1, timeout=120)[0],
        "dp1 x 4": run_distributed(_shared_update, 4, world_size=1, timeout=120)[0],
        "dp2 x 2": run_distributed(_shared_update, 2, world_size=2, timeout=120)[0],
    }
    reference = cases.pop("dp1 x 1")
    assert abs(reference["loss"]) > 1e-3
    for name, case in cases.items():
        assert case["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=1e-7), name
        for grad, expected in zip(case["grads"], reference["grads"], strict=True):
            scale = float(expected.abs().max())
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6 * scale, msg=name)


# --- the trainer: one update per step takes the on-policy path, several the recompute path -------------------------


def _run(output_dir: str, changes: dict) -> dict:
    import json
    import os

    from colo.apps.train import load_config, train, validate_config

    overrides = [
        f"output_dir={output_dir}", "grpo.synthetic_prompts=24", "grpo.group_size=4", "grpo.sft_steps=1",
        "data.global_batch_size=4", "schedule.total_steps=3", "schedule.warmup_steps=1", "eval.every_steps=100",
        "eval.num_sequences=4", "logging.every_steps=1", "logging.progress_bar=false", "logging.tensorboard=false",
        "sample.max_new_tokens=0", "checkpoint.enabled=false", *[f"{key}={value}" for key, value in changes.items()],
    ]  # fmt: skip
    result = train(validate_config(load_config(preset="tiny-grpo", overrides=overrides).model_dump(mode="json")))
    with open(os.path.join(output_dir, "metrics.jsonl")) as lines:
        records = [json.loads(line) for line in lines]
    return {"losses": result.losses, "records": [r for r in records if "grpo/logprob_mismatch_max" in r]}


@pytest.mark.parametrize("changes", [{}, {"grpo.epochs": 2}, {"grpo.minibatches": 2}])
def test_grpo_runs_log_the_trainers_log_probs_on_either_path(changes, tmp_path):
    # epochs * minibatches == 1: the update's forward gives the old log-probs; else a separate forward before the
    # first update. Either way the rollout's log-probs equal the trainer's (the mismatch metric) and the run trains.
    run = run_distributed(_run, str(tmp_path), changes, world_size=1, timeout=180)[0]
    assert sorted(run["losses"]) == [1, 2, 3]
    assert [r["step"] for r in run["records"]] == [2, 3]
    for record in run["records"]:
        assert 0 < record["grpo/logprob_mismatch_max"] < 1e-5
        assert record["grpo/logprob_mismatch"] < 1e-6
