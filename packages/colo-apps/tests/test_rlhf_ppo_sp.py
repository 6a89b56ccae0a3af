"""PPO under HybridParallel sequence parallelism (Ulysses and ring attention over ``sp``).

The actor, the critic and the frozen reference take whole rollout rows; each sp rank runs its piece of every row
(contiguous for Ulysses, zigzag for ring) and the ``(R, T)`` log-probs, entropies and values are all-gathered over sp
in one collective (`colo.apps.rlhf.sequence_logps.split_rollout_outputs`, GRPO's path). GAE, the whitening and the
losses then run on whole rows, the same on every sp rank, and the gather's backward sums the ranks' gradients, which
the data-parallel mean over ``("dp", "sp")`` turns into the one-process gradient.

1. One PPO iteration of `PPOLearner` (experience, 2 epochs x 2 minibatches of updates, the KL controller) on the
   fixed rollout of ``test_rlhf_ppo_train`` under sp2 equals one process (its checks: advantages, returns, old
   log-probs, losses, the models' log-probs and values after the 4 SGD updates, statistics, KL coefficient): the
   separate critic under Ulysses, the value head on the actor's backbone under ring (rows of 11 tokens padded to 12
   for its 4 zigzag chunks).
2. The trainer: ``data.task: ppo`` under ``plugin.name: hybrid, sp: 2`` (Ulysses and ring; 1 SFT step, then 2 PPO
   steps of 2 minibatch updates each of the actor and the separate critic, AdamW, clipping) logs the same per-step
   losses, gradient norms (the actor's and the critic's, before clipping: AdamW would hide a uniformly scaled
   gradient) and experience statistics as the single-process DDP run (rtol 1e-5), the same log-prob mismatch, and
   its last checkpoint holds the same actor and critic parameters (rtol 1e-5, atol 1e-5). Not
   bit-identical: attention runs on pieces (ring: a blockwise online softmax), and the gradient's sum over the pieces
   adds in another order than one process's backward.
"""

from __future__ import annotations

import json

import pytest
import torch

from colo.comm.testing import load_beside, run_distributed


def _learner_test():
    return load_beside(__file__, "test_rlhf_ppo_train.py", module_name="colo_apps_test_rlhf_ppo_train")


def _learner_case(sp_mode: str, shared: bool) -> dict:
    return _learner_test()._ppo_case(f"sp2-{sp_mode}", None if shared else f"sp2-{sp_mode}")


def _reference_case(shared: bool) -> dict:
    return _learner_test()._ppo_case("ddp", None if shared else "ddp")


@pytest.mark.parametrize(("sp_mode", "shared"), [("ulysses", False), ("ring", True)])
def test_ppo_iteration_under_sp2_matches_one_process(sp_mode, shared):
    reference = run_distributed(_reference_case, shared, world_size=1, timeout=120)[0]
    results = run_distributed(_learner_case, sp_mode, shared, world_size=2, timeout=120)
    # every sp rank holds every row and the same losses
    _learner_test()._check({f"sp2 {sp_mode}, rank {rank}": result for rank, result in enumerate(results)}, reference)


# --- 2. the trainer ------------------------------------------------------------------------------------------------


def varied_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies between completions from the first PPO step on: the share of digits."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _trainer_config(output_dir: str, **changes) -> dict:
    from colo.apps.train import load_config

    overrides = [
        f"output_dir={output_dir}",
        "ppo.synthetic_prompts=48",
        "ppo.group_size=4",
        "ppo.sft_steps=1",
        "ppo.epochs=1",
        "ppo.minibatches=2",
        "data.global_batch_size=2",
        "schedule.total_steps=3",
        "schedule.warmup_steps=1",
        # AdamW's eps: with 1e-8 an entry whose gradient nearly cancels turns its rounding into a step of ~lr
        "optimizer.eps=1e-4",
        "eval.every_steps=100",
        "logging.every_steps=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "sample.max_new_tokens=0",
        "checkpoint.every_steps=3",
        f"ppo.reward_functions=[{__name__}:varied_reward]",
        *[f"{key}={value}" for key, value in changes.items()],
    ]
    return load_config(preset="tiny-ppo", overrides=overrides).model_dump(mode="json")


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    return {"losses": train(validate_config(config)).losses}


def _metrics(output_dir) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    with open(output_dir / "metrics.jsonl") as lines:
        for record in map(json.loads, lines):
            by_step.setdefault(record["step"], {}).update(record)
    return by_step


def _last_checkpoint(root) -> dict[str, torch.Tensor]:
    """Every tensor of the last checkpoint under ``root``, whole."""
    from colo.tensor.checkpoint import latest_checkpoint, load_checkpoint, read_index

    path = latest_checkpoint(str(root))
    index = read_index(path)
    tensors = {name: torch.zeros(entry.shape, dtype=entry.dtype) for name, entry in index.tensors.items()}
    load_checkpoint(path, tensors)
    return {name: value for name, value in tensors.items() if not name.startswith("optim/")}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The single-process run both layouts are compared with: ``(output_dir, losses)``."""
    ddp_dir = tmp_path_factory.mktemp("ppo-ddp")
    return ddp_dir, run_distributed(_train, _trainer_config(str(ddp_dir)), world_size=1, timeout=180)[0]["losses"]


@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
def test_ppo_run_under_hybrid_sp2_matches_ddp(tmp_path, ddp_run, sp_mode):
    (ddp_dir, ddp), sp_dir = ddp_run, tmp_path / "sp2"
    hybrid = {"plugin.name": "hybrid", "plugin.sp": 2, "plugin.sp_mode": sp_mode, "plugin.zero_stage": 1}
    sp2 = run_distributed(_train, _trainer_config(str(sp_dir), **hybrid), world_size=2, timeout=180)
    assert sp2[0]["losses"] == sp2[1]["losses"]
    assert sorted(ddp) == sorted(sp2[0]["losses"]) == [1, 2, 3]
    expected, actual = _metrics(ddp_dir), _metrics(sp_dir)
    ppo = ["grad_norm", "ppo/critic_loss", "ppo/critic_grad_norm", "ppo/kl", "ppo/values", "ppo/returns",
           "ppo/entropy", "ppo/reward_mean"]  # fmt: skip
    for step in (1, 2, 3):  # an SFT step, then 2 PPO steps
        # (the first minibatch's loss of whitened advantages at ratio 1 is ~0: step 3's is 1e-7 of rounding)
        assert sp2[0]["losses"][step] == pytest.approx(ddp[step], rel=1e-5, abs=1e-6), step
        for name in ["grad_norm"] if step == 1 else ppo:
            # the KL sums differences of log-probs (~ -3, each 1e-7 apart) that nearly cancel: an absolute bound
            close = {"rel": 1e-5, "abs": 1e-6 if name == "ppo/kl" else 1e-7}
            assert actual[step][name] == pytest.approx(expected[step][name], **close), (step, name)
    for step in (2, 3):
        assert actual[step]["grad_norm"] > 1e-3 and actual[step]["ppo/critic_grad_norm"] > 1e-3  # real updates
        # the trainer's recompute of the old log-probs (the rollout's weights) against the rollout's own: one policy,
        # the softmax over the tokenizer's ids (smaller than the model's padded vocabulary) on both sides, so only
        # rounding apart (observed ~1e-6; 0.21 when the rollout took them over the padded vocabulary)
        assert expected[step]["ppo/logprob_mismatch_max"] < 1e-5, step
        assert actual[step]["ppo/logprob_mismatch_max"] < 1e-5, step
    assert any(actual[step]["ppo/reward_std"] > 0 for step in (2, 3))  # a score that varies
    for root in ("checkpoints", "checkpoints/critic"):  # the actor's and the critic's parameters after 4 AdamW steps
        wanted, got = _last_checkpoint(ddp_dir / root), _last_checkpoint(sp_dir / root)
        assert sorted(got) == sorted(wanted) and len(got) > 10, root
        for name, value in wanted.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"{root}: {name}")
