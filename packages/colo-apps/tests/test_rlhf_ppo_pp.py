"""PPO under a pipeline (``HybridParallel(pp=2)``): the actor and the separate critic, each pipelined over the same
2 stages (of 1 decoder layer in the iteration, of 2 in the trainer's ``tiny-ppo``).

The experience's old log-probs and old values come from pipelined forward-only passes, sent from the last stage to
every rank of the pipeline, so GAE and the whitening run on whole rows on every rank; each update runs the rows as
2 microbatches through the stages, the clipped policy loss and the clipped value loss reduced on the last stage
(`colo.apps.rlhf.ppo_pipeline`).

1. One PPO iteration of `PPOLearner` (experience, 2 epochs x 2 minibatches of SGD updates of the actor and the
   critic, the KL controller) on the fixed rollout of ``test_rlhf_ppo_train`` under pp2 (2 ranks) and pp2 x dp2
   (4 ranks, ZeRO-1 and ZeRO-3 over dp; not in CI for its time: ``COLO_TEST_PPO_PP_DP2=1`` runs it) equals one
   process:
   advantages, returns, old log-probs, the 4 policy and value losses, the actor's and the critic's gradient norms of
   every update, the statistics, the KL coefficient, the models' log-probs and values after the updates, and every
   parameter of both models (gathered from the stages).
   Tolerances as ``test_rlhf_ppo_train``'s (rtol 1e-5; parameters atol 1e-5, measured at most 2.4e-7 apart at pp2
   and 4.5e-7 at pp2 x dp2): the pipeline's microbatch sums add in another order than one process's backward.
   Control: with the critic's old values left at zero on the first stage's rank (not sent from the last stage),
   the pp2 case fails at rank 0's advantages.
2. The trainer: ``data.task: ppo`` under ``plugin.name: hybrid, pp: 2`` (1 SFT step, then 2 PPO steps of 2
   minibatch updates each of the actor and the separate critic, AdamW, clipping; the rollout from the stages'
   weights gathered over pp, the frozen reference pipelined as the actor, the critic started from it) logs the same
   per-step losses, gradient norms (the actor's and the critic's, before clipping) and experience statistics as the
   single-process DDP run (rtol 1e-5), and its last checkpoints hold the same actor and critic parameters (rtol 1e-5,
   atol 1e-5).
   At pp2 x dp2 with ZeRO-3 (4 ranks; each stage's parameters sharded over dp: the rollout copy gathered over dp,
   then pp; the critic boosted under ZeRO-3 over the same stages) the same run logs what DDP over the same 2 data
   ranks logs and ends on its parameters (the same tolerances; measured at most 4.1e-6 relative apart, ppo/kl, but
   step 3's policy loss of -5.7e-3, 5.7e-8 apart; parameters 3.0e-7). Control: the rollout copy's gathered weights
   scaled by 1.001 fail it at step 2's loss.
3. The value head on the actor's backbone (``ppo.critic: shared``) is refused under a pipeline, by the run config
   and by the criterion, naming ``ppo.critic`` and the fix.
"""

from __future__ import annotations

import os

import pytest
import torch

from colo.comm.testing import load_beside, run_distributed


def _learner_test():
    return load_beside(__file__, "test_rlhf_ppo_train.py", module_name="colo_apps_test_rlhf_ppo_train")


def _case(plugin: str) -> dict:
    return _learner_test()._ppo_case(plugin, plugin, True)  # the critic's SGD step: the default 0.05


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_case, "ddp", world_size=1, timeout=120)[0]


def _check_pipelined(cases: dict, reference: dict, *, atol: float = 1e-6) -> None:
    learner = _learner_test()
    learner._check(cases, reference, atol=atol)
    assert len(reference["actor_grad_norms"]) == 4 and min(reference["critic_grad_norms"]) > 1e-3
    for name, case in cases.items():
        for key in ("actor_grad_norms", "critic_grad_norms"):  # before clipping, one an update
            assert case[key] == pytest.approx(reference[key], rel=1e-5), f"{name}: {key}"
        for key in ("actor_params", "critic_params"):  # after 4 SGD updates of each model
            assert sorted(case[key]) == sorted(reference[key]) and len(reference[key]) > 8, f"{name}: {key}"
            for param, value in reference[key].items():
                torch.testing.assert_close(case[key][param], value, rtol=1e-5, atol=1e-5, msg=f"{name}: {param}")


def test_ppo_iteration_under_pp2_matches_one_process(reference):
    results = run_distributed(_case, "pp2", world_size=2, timeout=120)
    # both stages' ranks hold every row's experience and the same losses
    _check_pipelined({f"pp2, rank {rank}": result for rank, result in enumerate(results)}, reference)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("COLO_TEST_PPO_PP_DP2"),
    reason="4 ranks: ~60 s on a loaded 2-core CI machine; run with COLO_TEST_PPO_PP_DP2=1",
)
@pytest.mark.parametrize("plugin", ["pp2-zero1", "pp2-zero3"])
def test_ppo_iteration_under_pp2_dp2_matches_one_process(reference, plugin):
    results = run_distributed(_case, plugin, world_size=4, timeout=180)
    # ranks (pp, dp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1); each dp rank holds half of the rows
    learner = _learner_test()
    cases = {f"pp2 x dp2, stage {stage}": learner._joined([results[2 * stage], results[2 * stage + 1]])
             for stage in (0, 1)}  # fmt: skip
    # atol 2e-6: one whitened advantage is -4.3e-4, a difference of values of scale ~1 (the mean subtracted), measured
    # 1.05e-6 from one process's at pp2 x dp2 (the data ranks' moments are summed in another order)
    _check_pipelined(cases, reference, atol=2e-6)


def test_shared_critic_is_refused_under_a_pipeline():
    from colo.apps.rlhf.ppo import PPOCriterion
    from colo.apps.train import load_config

    with pytest.raises(ValueError, match=r"ppo.critic='shared'.*set ppo.critic='separate'"):
        PPOCriterion("actor_critic").pipeline_split({"input_ids": torch.zeros(2, 4, dtype=torch.long)})
    overrides = ["plugin.name=hybrid", "plugin.pp=2", "schedule.num_microbatches=2", "ppo.critic=shared"]
    with pytest.raises(ValueError, match=r"ppo.critic='shared'.*ppo.critic='separate'"):
        load_config(preset="tiny-ppo", overrides=overrides)
    load_config(preset="tiny-ppo", overrides=[*overrides[:-1], "ppo.critic=separate"])


# --- 2. the trainer ------------------------------------------------------------------------------------------------


def _sp_test():
    return load_beside(__file__, "test_rlhf_ppo_sp.py", module_name="colo_apps_test_rlhf_ppo_sp")


def varied_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies between completions from the first PPO step on: the share of digits."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _trainer_config(output_dir: str, **changes) -> dict:
    # both runs take each rank's 8 rows of a step as 2 minibatches of 2 microbatches (the SFT step's token means are
    # per microbatch)
    changes = {"schedule.num_microbatches": 2, "ppo.reward_functions": f"[{__name__}:varied_reward]", **changes}
    return _sp_test()._trainer_config(output_dir, **changes)


def test_ppo_run_under_hybrid_pp2_matches_ddp(tmp_path):
    sp = _sp_test()
    one_dir, pp_dir = tmp_path / "one", tmp_path / "pp2"
    one = run_distributed(sp._train, _trainer_config(str(one_dir)), world_size=1, timeout=180)[0]["losses"]
    hybrid = {"plugin.name": "hybrid", "plugin.pp": 2, "plugin.zero_stage": 1}
    pp2 = run_distributed(sp._train, _trainer_config(str(pp_dir), **hybrid), world_size=2, timeout=180)
    assert pp2[0]["losses"] == pp2[1]["losses"]
    _check_same_run(one_dir, one, pp_dir, pp2[0]["losses"])


def _check_same_run(one_dir, one: dict, other_dir, other: dict) -> None:
    """The run in ``other_dir`` (losses ``other``) logs ``one``'s per-step losses and metrics and ends with its actor
    and critic parameters (an SFT step, then 2 PPO steps)."""
    sp = _sp_test()
    assert sorted(one) == sorted(other) == [1, 2, 3]
    expected, actual = sp._metrics(one_dir), sp._metrics(other_dir)
    ppo = ["grad_norm", "ppo/critic_loss", "ppo/critic_grad_norm", "ppo/kl", "ppo/values", "ppo/returns",
           "ppo/entropy", "ppo/reward_mean", "ppo/clip_fraction", "ppo/value_loss"]  # fmt: skip
    for step in (1, 2, 3):  # an SFT step, then 2 PPO steps
        assert other[step] == pytest.approx(one[step], rel=1e-5, abs=1e-6), step
        for name in ["grad_norm"] if step == 1 else ppo:
            close = {"rel": 1e-5, "abs": 1e-6 if name == "ppo/kl" else 1e-7}  # (test_rlhf_ppo_sp's bounds)
            assert actual[step][name] == pytest.approx(expected[step][name], **close), (step, name)
    for step in (2, 3):
        assert actual[step]["grad_norm"] > 1e-3 and actual[step]["ppo/critic_grad_norm"] > 1e-3  # real updates
    assert any(actual[step]["ppo/reward_std"] > 0 for step in (2, 3))  # a score that varies
    for root in ("checkpoints", "checkpoints/critic"):  # the actor's and the critic's parameters after 3 / 2 steps
        wanted, got = sp._last_checkpoint(one_dir / root), sp._last_checkpoint(other_dir / root)
        assert sorted(got) == sorted(wanted) and len(got) > 10, root
        for name, value in wanted.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"{root}: {name}")


def test_ppo_run_under_hybrid_pp2_dp2_zero3_matches_ddp(tmp_path):
    """Large actors: pp2 x dp2 with ZeRO-3 (each stage's parameters sharded over dp): the rollout on the stages'
    chunks gathered over dp, then over pp; the separate critic boosted under ZeRO-3 over the same stages, started
    from the reference's whole weights. The reference run is DDP over the same 2 data-parallel ranks (each samples
    its own prompts' completions from the seed of its data rank, so one process would sample other completions)."""
    sp = _sp_test()
    batch = {"data.global_batch_size": 4}  # 2 prompts x 4 completions a data rank: 2 minibatches of 2 microbatches
    ddp_dir, zero3_dir = tmp_path / "ddp2", tmp_path / "pp2-dp2-zero3"
    ddp = run_distributed(sp._train, _trainer_config(str(ddp_dir), **batch), world_size=2, timeout=180)[0]["losses"]
    hybrid = {**batch, "plugin.name": "hybrid", "plugin.pp": 2, "plugin.zero_stage": 3}
    zero3 = run_distributed(sp._train, _trainer_config(str(zero3_dir), **hybrid), world_size=4, timeout=240)
    assert all(result["losses"] == zero3[0]["losses"] for result in zero3)
    _check_same_run(ddp_dir, ddp, zero3_dir, zero3[0]["losses"])
