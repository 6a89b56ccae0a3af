"""DAPO's rollout-side settings (`colo.apps.rlhf.dapo`): the overlong punishment's ramp, truncated rows, and
dynamic sampling under data parallelism.

Dynamic sampling: two ranks drop different numbers of groups (rank 0 every group of its first two rounds, rank 1
none); both must generate the same number of rounds (a rank that stopped early would leave the other in a
collective) and end with the same number of rows (the update's microbatches). A short ``data.task: grpo`` run on two
ranks with the exact-answer reward, where most groups of a freshly SFT'd policy score all 0, then trains through the
refill, the overlong punishment and the truncation mask without a hang, logging the metrics.

Rows whose loss is identically zero (masked out, or a zero advantage at beta 0) leave the update's compute: the
update of two ranks that drop different rows, in two microbatches, equals one process's update of the whole batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from colo.comm.testing import run_distributed

G, TARGET = 4, 3


def test_soft_overlong_punishment_ramp_and_bad_buffer():
    from colo.apps.rlhf.dapo import soft_overlong_punishment

    lengths = torch.tensor([1, 6, 7, 8, 10, 12])
    got = soft_overlong_punishment(lengths, max_length=10, buffer=4, penalty=0.5)
    # 0 up to L - B = 6 tokens, then 0.5 * (6 - n) / 4 down to -0.5 at the budget, -0.5 past it
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError, match="buffer=11"):
        soft_overlong_punishment(lengths, max_length=10, buffer=11)


def test_bad_dapo_settings_name_the_field():
    from colo.apps.train import ConfigError, load_config

    with pytest.raises(ConfigError, match="grpo.overlong_buffer=40 exceeds grpo.max_new_tokens"):
        load_config(preset="tiny-grpo", overrides=["grpo.overlong_buffer=40"])
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        load_config(preset="tiny-grpo", overrides=["grpo.dynamic_sampling_max_rounds=0"])


def _fake_rollout(records: list[dict], round_index: int):
    """``G`` rows per record; each round has its own prompt and response widths (the refill must re-pad)."""
    from colo.apps.generation import Rollout

    prompt, response = 2 + round_index, 3 + 2 * round_index
    rows = len(records) * G
    input_ids = torch.zeros(rows, prompt + response, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(rows, response, dtype=torch.long)
    for row in range(rows):
        record = records[row // G]
        input_ids[row, prompt - 1] = 100 + record["id"]  # a one-token prompt, left-padded
        attention_mask[row, prompt - 1] = 1
        length = 1 + row % response
        input_ids[row, prompt : prompt + length] = 10 + row % G
        attention_mask[row, prompt : prompt + length] = 1
        response_mask[row, :length] = 1
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=-response_mask.float(),
        prompt_length=prompt,
        prompt_index=torch.arange(rows) // G,
    )


def _fake_rewards(records: list[dict], rollout) -> torch.Tensor:
    """An informative record's group scores 0, 1, 0, 1; the others all 1."""
    rows = range(len(records) * G)
    return torch.tensor([float(row % 2) if records[row // G]["informative"] else 1.0 for row in rows])


def _dynamic_case(max_extra_rounds: int) -> dict:
    import torch.distributed as dist

    from colo.apps.rlhf.dapo import fill_informative_groups
    from colo.comm import Mesh

    rank = dist.get_rank()
    group = Mesh(dp=2).group("dp")
    # rank 0: its first two rounds are uninformative; rank 1: every group is informative
    rounds = [[{"id": 10 * r + i, "informative": rank == 1 or r >= 2} for i in range(TARGET)] for r in range(6)]
    calls = {"generate": 0, "next": 0}

    def next_records():
        calls["next"] += 1
        return rounds[calls["next"]]

    def generate(records):
        calls["generate"] += 1
        return _fake_rollout(records, calls["generate"])

    sample = fill_informative_groups(
        rounds[0],
        _fake_rollout(rounds[0], 0),
        _fake_rewards(rounds[0], None),
        group_size=G,
        max_extra_rounds=max_extra_rounds,
        generate=generate,
        score=_fake_rewards,
        next_records=next_records,
        pad_token_id=0,
        group=group,
    )
    rollout = sample.rollout
    # every row's prompt token and response survive the re-padding
    prompts = [ids[-1] for ids in rollout.prompts()]
    return {
        "ids": [record["id"] for record in sample.records],
        "rows": rollout.num_rows,
        "extra_rounds": sample.extra_rounds,
        "dropped": sample.dropped_groups,
        "shortfall": sample.shortfall_groups,
        "generate_calls": calls["generate"],
        "prompts_match": prompts == [100 + record["id"] for record in sample.records for _ in range(G)],
        "rewards": sample.rewards.tolist(),
        "response_lengths": rollout.response_mask.sum(dim=1).tolist(),
        "logps_sum": float(rollout.logprobs.sum()),
        "prompt_index": rollout.prompt_index.tolist(),
    }


def test_dynamic_sampling_ranks_agree_on_rounds_and_rows():
    enough = run_distributed(_dynamic_case, 3, world_size=2, timeout=60)
    rank0, rank1 = enough
    # rank 0 needed two extra rounds; rank 1 generated them too (the agreed count) and kept its first round
    assert rank0["extra_rounds"] == rank1["extra_rounds"] == 2
    assert rank0["generate_calls"] == rank1["generate_calls"] == 2
    assert rank0["ids"] == [20, 21, 22] and rank0["dropped"] == 6 and rank0["shortfall"] == 0
    assert rank1["ids"] == [0, 1, 2] and rank1["dropped"] == 0
    for rank in enough:
        assert rank["rows"] == TARGET * G  # the same update microbatches on every rank
        assert rank["prompts_match"] and rank["rewards"] == [0.0, 1.0] * (TARGET * G // 2)
        assert rank["prompt_index"] == [row // G for row in range(TARGET * G)]
        assert rank["logps_sum"] == -sum(rank["response_lengths"])  # no response token lost or invented
    # round 2's rows are 7 response columns wide, round 0's 3: the padding is re-applied, lengths kept
    assert rank0["response_lengths"] == [1 + row % 7 for row in range(TARGET * G)]

    short = run_distributed(_dynamic_case, 1, world_size=2, timeout=60)
    rank0, rank1 = short
    assert rank0["extra_rounds"] == rank1["extra_rounds"] == 1
    # rank 0 found nothing informative in its one extra round: its batch is filled with dropped groups, in order
    assert rank0["ids"] == [0, 1, 2] and rank0["shortfall"] == TARGET and rank0["rewards"] == [1.0] * (TARGET * G)
    assert rank1["ids"] == [0, 1, 2] and rank1["shortfall"] == 0
    assert rank0["rows"] == rank1["rows"] == TARGET * G


# --- the trainer ---------------------------------------------------------------------------------------------------


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {"losses": result.losses}


def test_grpo_run_with_dapo_settings_on_two_ranks(tmp_path):
    from colo.apps.train import load_config

    output_dir = str(tmp_path / "run")
    overrides = [
        f"output_dir={output_dir}",
        "grpo.synthetic_prompts=64",
        "grpo.group_size=4",
        "grpo.sft_steps=1",
        "grpo.max_new_tokens=4",
        "grpo.eps_high=0.28",
        "grpo.beta=0",
        "grpo.dynamic_sampling=true",
        "grpo.dynamic_sampling_max_rounds=2",
        "grpo.overlong_buffer=2",
        "grpo.mask_truncated=true",
        "data.global_batch_size=4",
        "schedule.total_steps=3",
        "schedule.warmup_steps=1",
        "schedule.num_microbatches=2",
        "eval.every_steps=100",
        "eval.num_sequences=8",
        "logging.every_steps=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "sample.max_new_tokens=0",
        "checkpoint.enabled=false",
    ]
    config = load_config(preset="tiny-grpo", overrides=overrides).model_dump(mode="json")
    losses = run_distributed(_train, config, world_size=2, timeout=120)[0]["losses"]
    assert sorted(losses) == [1, 2, 3]
    with open(os.path.join(output_dir, "metrics.jsonl")) as lines:
        records = [json.loads(line) for line in lines]
    steps = [r for r in records if "grpo/dynamic_extra_rounds" in r]
    assert [r["step"] for r in steps] == [2, 3]
    for record in steps:
        assert 0 <= record["grpo/dynamic_extra_rounds"] <= 2
        assert record["grpo/dynamic_dropped_groups"] >= record["grpo/dynamic_shortfall_groups"] >= 0
        assert 0.0 <= record["grpo/truncated_fraction"] <= 1.0
        # masked rows leave the compute, but for at most 2 a rank (of its 8) put back to fill its 2 microbatches
        assert record["grpo/skipped_fraction"] >= record["grpo/truncated_fraction"] - 4 / 16
        assert record["grpo/skipped_fraction"] > 0
        assert "grpo/kl" not in record  # beta 0: no reference is taken, no KL reported
    # the fresh policy answers few sums: some groups scored all equal and were dropped
    assert sum(r["grpo/dynamic_dropped_groups"] for r in steps) > 0


# --- rows that cannot move the weights leave the update ------------------------------------------------------------


ROWS, PROMPT, RESPONSE = 8, 4, 5


def _skip_case(skip: bool, num_microbatches: int) -> dict:
    """One GRPO update at beta 0 on a batch with truncated (masked) rows and a group of equal rewards; with ``skip``
    the rows of identically zero loss are left out (the counts still taken over the whole batch)."""
    import torch.distributed as dist

    from colo.apps import DDP, Booster, Llama, get_preset
    from colo.apps.rlhf import GRPOCriterion, attach_rollout_forward, global_counts
    from colo.apps.rlhf.policy_loss import keep_whole_microbatches, rows_with_gradient

    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(4, 128, (ROWS, PROMPT + RESPONSE), generator=generator)
    lengths = torch.tensor([5, 0, 3, 0, 2, 5, 1, 4])  # rows 1 and 3: truncated, masked out of the loss
    mask = (torch.arange(RESPONSE)[None, :] < lengths[:, None]).long()
    advantages = torch.tensor([0.7, -0.2, 0.4, -0.9, 0.0, 0.0, 0.0, 0.0])  # the second group: equal rewards
    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(3)
    attach_rollout_forward(model, temperature=0.9)
    criterion = GRPOCriterion(loss_aggregation="token-mean", beta=0.0, eps_low=0.2, eps_high=0.28)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    booster = Booster(DDP(num_microbatches=num_microbatches))
    booster.boost(model, optimizer, criterion=criterion)
    group = booster.mesh.group("dp")
    rank, world = dist.get_rank(), group.size
    positions = torch.arange(PROMPT + RESPONSE).expand(ROWS, -1)
    batch = {
        "input_ids": input_ids,
        "position_ids": positions,
        "document_ids": torch.zeros_like(input_ids),
        "response_mask": mask,
        "advantages": advantages,
        "old_logps": -4.0 + 0.3 * torch.randn(ROWS, RESPONSE, generator=generator),
    }
    rows = ROWS // world
    batch = {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}
    counts = global_counts(batch["response_mask"], max_new_tokens=RESPONSE, group=group)
    kept = rows
    if skip:
        keep = keep_whole_microbatches(rows_with_gradient(batch["advantages"], batch["response_mask"], beta=0.0), 2)
        batch = {key: value[keep] for key, value in batch.items()}
        kept = int(keep.sum())
    criterion.prepare(counts, num_microbatches=num_microbatches, num_data_ranks=world)
    loss = float(booster.train_step(batch).loss)
    return {"loss": loss, "kept": kept, "params": [p.detach().clone() for p in model.parameters()]}


def test_rows_of_zero_loss_leave_the_update_without_changing_it():
    full = run_distributed(_skip_case, False, 1, world_size=1, timeout=60)[0]
    skipped = run_distributed(_skip_case, True, 2, world_size=2, timeout=60)
    # rank 0 keeps rows 0 and 2 (1 and 3 are masked); rank 1 keeps none and takes back 2 rows for its 2 microbatches
    assert [rank["kept"] for rank in skipped] == [2, 2]
    assert abs(full["loss"]) > 1e-3
    for rank in skipped:
        assert rank["loss"] == pytest.approx(full["loss"], rel=1e-6, abs=1e-7)
        for param, expected in zip(rank["params"], full["params"], strict=True):
            torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7)  # summation order only
