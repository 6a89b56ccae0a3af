"""PPO with a critic in the Booster: a whole iteration (experience, then 2 epochs x 2 minibatches of actor and critic
updates, then the KL controller's step) on one fixed rollout batch gives the same advantages, returns, losses,
updated models and KL coefficient (rtol 1e-5, fp32) on one process, split over two data-parallel ranks (DDP,
ZeRO-3, the actor under ZeRO-3 beside a DDP critic) and under HybridParallel tp2 (vocabulary-parallel logits
gathered by the model's objective; the critic's one-output head replicated), with a separate critic or one sharing
the actor's backbone. The global whitening and the aggregation's global counts make the data split invisible."""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

SEED, ROWS, PROMPT, RESPONSE, TEMPERATURE = 3, 8, 5, 6, 0.8


def _rollout_batch() -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A hand-made rollout (prompts of two lengths, responses of several lengths) with scores and reference
    log-probs."""
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
    responses = input_ids[:, PROMPT:]
    responses[response_mask == 0] = 0
    attention_mask[:, PROMPT:] = response_mask
    rollout = Rollout(input_ids, attention_mask, response_mask, torch.zeros(ROWS, RESPONSE), PROMPT,
                      torch.arange(ROWS), TEMPERATURE)  # fmt: skip
    batch = {**rollout_model_inputs(rollout, hf=False), "response_mask": response_mask}
    scores = torch.randn(ROWS, generator=generator)
    ref = (-4.8 + 0.3 * torch.randn(ROWS, RESPONSE, generator=generator)) * response_mask
    return batch, scores, ref


def _plugin(name: str):
    from colo.apps import DDP, HybridParallel, Zero

    if name.startswith("sp2-"):  # (test_rlhf_ppo_sp.py)
        return HybridParallel(sp=2, sp_mode=name[4:])
    if name.startswith("pp2"):  # (test_rlhf_ppo_pp.py): "pp2" or "pp2-zero1" (ZeRO over the dp ranks beside pp)
        stage = int(name[-1]) if "zero" in name else 0
        return HybridParallel(pp=2, num_microbatches=2, zero_stage=stage)
    return {"ddp": DDP(), "zero3": Zero(stage=3), "tp2": HybridParallel(tp=2)}[name]


def _ppo_case(actor_plugin: str, critic_plugin: str | None, with_params: bool = False, critic_lr: float = 0.05) -> dict:
    """One PPO iteration; ``critic_plugin=None``: the value head on the actor's backbone. ``with_params``: the
    models' whole parameters after the updates too (under a pipeline gathered from the stages). ``critic_lr``: the
    separate critic's SGD step (at 0.5 its value loss grows from update to update and its values collapse to 0,
    which would leave the comparison of values after the updates nothing to compare)."""
    from colo.apps import Booster, Llama, get_preset
    from colo.apps.rlhf import make_reward_model
    from colo.apps.rlhf.critic import add_value_head, attach_ppo_forward
    from colo.apps.rlhf.ppo import AdaptiveKLController, PPOCriterion
    from colo.apps.rlhf.ppo_learner import PPOHyperparameters, PPOLearner

    def llama(seed):
        model = Llama(get_preset("tiny", initializer_range=0.1))
        model.init_weights(seed)
        return model

    shared = critic_plugin is None
    actor_model = llama(SEED)
    if shared:
        add_value_head(actor_model, seed=1)
    attach_ppo_forward(actor_model, role="actor_critic" if shared else "actor", temperature=TEMPERATURE)
    options = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, value_clip=0.2)
    # (the temperature is the criterion's under a pipeline, where the last stage takes the log-probs itself)
    actor_criterion = PPOCriterion(
        "actor_critic" if shared else "actor", entropy_coef=0.01, temperature=TEMPERATURE, **options
    )
    actor = Booster(_plugin(actor_plugin))
    lr = 0.1 if shared else 0.5  # (the shared backbone also takes the value loss' larger gradients)
    actor.boost(actor_model, torch.optim.SGD(actor_model.parameters(), lr=lr), criterion=actor_criterion)
    critic = critic_criterion = None
    if not shared:
        critic_model = attach_ppo_forward(make_reward_model(llama(SEED + 1), seed=1), role="critic")
        critic_criterion = PPOCriterion("critic", **options)
        critic = Booster(_plugin(critic_plugin))
        critic.boost(critic_model, torch.optim.SGD(critic_model.parameters(), lr=critic_lr), criterion=critic_criterion)
    group = actor.mesh.group("dp")
    controller = AdaptiveKLController(0.05, target=0.5, horizon=100)
    settings = PPOHyperparameters(gamma=0.99, lam=0.9, epochs=2, minibatches=2, max_new_tokens=RESPONSE)
    learner = PPOLearner(actor, actor_criterion, critic=critic, critic_criterion=critic_criterion, settings=settings,
                         kl_controller=controller, group=group)  # fmt: skip
    full, scores, ref = _rollout_batch()
    # dp2's minibatch k is rows 2k, 2k+1 of each rank's half; one process takes the same rows in its minibatch k
    order = torch.arange(ROWS) if group.size == 2 else torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])
    rows = ROWS // group.size
    part = order[group.rank * rows : (group.rank + 1) * rows]
    batch, stats = learner.experience({k: v[part] for k, v in full.items()}, scores[part], ref[part])
    outcome = learner.update(batch, stats)
    metrics = actor_criterion.take_metrics(group)
    with torch.no_grad():
        after = actor.forward(full)
        values = (critic.forward(full) if critic is not None else after)["values"]
    back = torch.argsort(part)  # rows in the rollout's order
    return {
        "advantages": batch["advantages"][back],
        "returns": batch["returns"][back],
        "old_logps": batch["old_logps"][back],
        "stats": stats,
        "actor_losses": outcome["actor"],
        "critic_losses": outcome["critic"],
        "logps": after["logps"].detach(),
        "values": values.detach(),
        "kl_coef": controller.value,
        "metrics": metrics,
        "actor_grad_norms": [float(norm) for norm in outcome["actor_grad_norms"]],
        "critic_grad_norms": [float(norm) for norm in outcome["critic_grad_norms"]],
        **({"actor_params": _whole_params(actor), "critic_params": _whole_params(critic)} if with_params else {}),
    }


def _whole_params(booster) -> dict[str, torch.Tensor] | None:
    """The boosted model's whole parameters (under a pipeline each stage's, all-gathered over pp; under ZeRO-3 each
    chunk's gathered over dp first)."""
    from colo.comm import all_gather_object

    if booster is None:
        return None
    stage = booster.unwrap()
    own = {name: value.detach().clone() for name, value in stage.named_parameters()}
    optimizer = booster.engine.optimizer
    if getattr(optimizer, "gatherer", None) is not None:  # ZeRO-3: the chunks all-gathered over dp, one at a time
        names = {id(param): name for name, param in stage.named_parameters()}
        for chunk in optimizer.chunks:
            optimizer.gatherer.gather(chunk)
            for slot in chunk.slots:
                own[names[id(slot.param)]] = slot.param.detach().clone()
            optimizer.gatherer.release(chunk)
    mesh = booster.mesh
    if "pp" not in mesh.shape or mesh.size("pp") == 1:
        return own
    whole: dict[str, torch.Tensor] = {}
    for part in all_gather_object(own, group=mesh.group("pp")):
        whole.update(part)
    return whole


def _check(cases: dict, reference: dict, *, atol: float = 1e-6) -> None:
    for name, case in cases.items():
        for key in ("advantages", "returns", "old_logps"):
            torch.testing.assert_close(case[key], reference[key], rtol=1e-5, atol=atol, msg=f"{name}: {key}")
        for key in ("actor_losses", "critic_losses"):  # rtol 1e-5 of the largest (a loss may be near 0)
            scale = max([abs(value) for value in reference[key]], default=0.0)
            assert case[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-5 * scale), f"{name}: {key}"
        for key in ("logps", "values"):  # after 4 updates: rtol 1e-5 of the tensor's scale (values cross 0)
            scale = float(reference[key].abs().max())
            torch.testing.assert_close(case[key], reference[key], rtol=1e-5, atol=1e-5 * scale, msg=f"{name}: {key}")
        for key, value in reference["stats"].items():
            assert case["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{name}: stats {key}"
        assert case["kl_coef"] == pytest.approx(reference["kl_coef"], rel=1e-12), name


def _joined(results: list[dict]) -> dict:
    """Rank 0's result with the per-row tensors of every rank concatenated."""
    joined = dict(results[0])
    for key in ("advantages", "returns", "old_logps"):
        joined[key] = torch.cat([result[key] for result in results])
    return joined


def test_separate_critic_iteration_is_the_same_on_one_process_dp2_and_tp2():
    reference = run_distributed(_ppo_case, "ddp", "ddp", world_size=1, timeout=120)[0]
    assert reference["kl_coef"] != 0.05  # the controller moved
    assert len(reference["actor_losses"]) == 4 and len(reference["critic_losses"]) == 4
    assert reference["metrics"]["clip_fraction"] > 0  # later minibatches moved off the rollout policy
    assert abs(reference["stats"]["advantages"]) > 0 and reference["stats"]["score"] != 0
    assert float(reference["values"].abs().max()) > 1e-3  # the critic's values after the updates are live
    cases = {
        "ddp dp2": _joined(run_distributed(_ppo_case, "ddp", "ddp", world_size=2, timeout=120)),
        "zero3 dp2": _joined(run_distributed(_ppo_case, "zero3", "zero3", world_size=2, timeout=120)),
        "zero3 actor + ddp critic dp2": _joined(run_distributed(_ppo_case, "zero3", "ddp", world_size=2, timeout=120)),
    }
    for rank, result in enumerate(run_distributed(_ppo_case, "tp2", "tp2", world_size=2, timeout=120)):
        cases[f"HybridParallel tp2, rank {rank}"] = result  # every tp rank holds every row
    _check(cases, reference)


def test_shared_backbone_iteration_is_the_same_on_one_process_dp2_and_tp2():
    reference = run_distributed(_ppo_case, "ddp", None, world_size=1, timeout=120)[0]
    assert reference["critic_losses"] == [] and len(reference["actor_losses"]) == 4
    cases = {
        "ddp dp2": _joined(run_distributed(_ppo_case, "ddp", None, world_size=2, timeout=120)),
        "zero3 dp2": _joined(run_distributed(_ppo_case, "zero3", None, world_size=2, timeout=120)),
        "HybridParallel tp2": run_distributed(_ppo_case, "tp2", None, world_size=2, timeout=120)[0],
    }
    _check(cases, reference)
