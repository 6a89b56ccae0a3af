"""PPO with the policy under HybridParallel tensor parallelism x data parallelism equals one process.

Three PPO steps on 4 ranks: the actor under ``HybridParallel(tp=2, dp=2)`` (ZeRO-1, clipping), its log-probs and
entropies from each rank's vocabulary columns (`colo.apps.rlhf.token_logps`, over the 120 ids generation samples from
of a 128-id vocabulary); the separate critic under its own ``HybridParallel(tp=2, dp=2)`` (the same mesh, so its
data-parallel rows are the actor's; its scalar head replicated), started from the frozen reference's tensor-parallel
shards (`colo.apps.rlhf.critic.critic_from_policy`); the frozen reference laid out as the policy
(`Booster.frozen_copy`). Each step: a rollout of this data-parallel rank's prompts from the trained weights in place
(`RolloutEngine`), rule scores, the experience (old log-probs and values recomputed by the boosted forwards, the
reference's log-probs, KL-shaped rewards, GAE, whitening over both data-parallel ranks), 2 minibatch updates of the
actor and of the critic (AdamW), the adaptive KL controller's step. The single process runs the same code under DDP
on one rank with every data-parallel rank's prompts (each drawn with that rank's generator), its rows ordered so that
its minibatch k holds every rank's minibatch k.

Claims: the sampled tokens are equal; per step the actor's and the critic's losses agree (rtol 1e-5; a loss near 0
against 1e-5 of the step's largest), so do the experience statistics (rtol 1e-5, atol 1e-5: means of per-token
values and advantages of order 1 that cross 0; the last step's value mean is 5e-6 apart) and the KL coefficient;
after the last step every parameter of actor and critic agrees with the single process's (each tensor-parallel shard
with the matching slice; rtol 1e-5, atol 1e-4); the actor's forward sends no all-gather over tp, only the
activations' all-reduces and 4 floats per response token. Not bit-identical (fp32): tensor parallelism sums the
row-parallel products and the vocabulary statistics in another order (the critic's first values are already 1e-6
apart), the data-parallel gradient mean adds the ranks' shares in another order than one process's single backward,
and AdamW (lr 1e-2) turns rounding in near-zero gradient entries into steps (see `EPS`), so the differences grow
from about 1e-7 at the first update to a few 1e-6 at the sixth.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

SEED, LR, EPS, TEMPERATURE = 11, 1e-2, 1e-4, 0.7
"""AdamW's eps: with 1e-5 one entry of the tp2 critic's embedding (an id whose gradient nearly cancels) ended 1.3e-4
from the single process after 6 updates, AdamW turning the rounding of a near-zero gradient into a step of ~lr; with
1e-4 every parameter is within 4e-6, while gradient entries above 1e-4 (most of them) still move by ~lr."""
STEPS, DP, GROUP, NEW_TOKENS, MINIBATCHES, VOCAB_LIMIT = 3, 2, 2, 4, 2, 120
PARAMETER_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}


def _config():
    from colo.apps import get_preset

    return get_preset("tiny", initializer_range=0.1)


def _prompts(dp_rank: int, step: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(100 * step + dp_rank)
    return [torch.randint(4, VOCAB_LIMIT, (length,), generator=generator).tolist() for length in (5, 3)]


def _sampling(dp_rank: int, step: int):
    from colo.apps.generation import SamplingParams

    params = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, top_p=0.95, n=GROUP, vocab_limit=VOCAB_LIMIT
    )
    return params, torch.Generator().manual_seed(1000 * step + dp_rank)


def _scores(rollout) -> torch.Tensor:
    """A rule score that varies between rows: the share of response tokens below 64."""
    responses = rollout.input_ids[:, rollout.prompt_length :]
    return (responses < 64).float().mean(dim=1)


def _interleaved(parts: list[dict]) -> dict:
    """One process's batch of every data-parallel rank's rows, ordered so that its minibatch k (`split_batch`) holds
    each rank's minibatch k."""
    from colo.apps.booster.microbatch import split_batch

    pieces = [split_batch(part, MINIBATCHES) for part in parts]
    return {key: torch.cat([piece[k][key] for k in range(MINIBATCHES) for piece in pieces]) for key in parts[0]}


def _actor_traffic(actor, batch: dict) -> dict:
    """What one actor forward over 2 rows sends over tp."""
    from colo.comm import CommTracker

    keys = ("input_ids", "position_ids", "document_ids", "response_mask")
    micro = {key: batch[key][:2] for key in keys}
    with torch.no_grad(), CommTracker() as tracker:
        actor.forward(micro)
    return {
        "all_gathers": tracker.calls("all_gather", axis="tp"),
        "all_reduce_bytes": tracker.bytes("all_reduce", axis="tp"),
        "shape": (*micro["input_ids"].shape, micro["response_mask"].shape[1]),
    }


def _plugins(layout: str) -> tuple:
    """The actor's and the critic's plugins of ``layout`` (`LAYOUTS`)."""
    from colo.apps import DDP, HybridParallel, Zero

    if layout == "one":
        return DDP(max_grad_norm=1.0), DDP(max_grad_norm=1.0)
    actor = HybridParallel(tp=2, dp=DP, zero_stage=1, max_grad_norm=1.0, seed=SEED)
    if layout == "tp2xdp2":
        return actor, HybridParallel(tp=2, dp=DP, zero_stage=1, max_grad_norm=1.0, seed=SEED)
    return actor, Zero(stage=2, max_grad_norm=1.0)


LAYOUTS = ("tp2xdp2", "tp2xdp2 actor, zero2 critic")
"""The 4-rank layouts: the critic under HybridParallel as the actor (the trainer's default: the actor's plugin
section), or under ZeRO-2 over every rank (``ppo.critic_plugin``: the tp peers of a data-parallel rank hold the same
rows, so its mean over the 4 ranks is the mean over the 2 data-parallel ranks)."""


def _ppo_run(layout: str, expected: dict | None = None) -> dict:
    """Three PPO steps: one process under DDP (``layout="one"``), or a 4-rank layout of `LAYOUTS` (the parameters at
    the end compared here with the single process's, ``expected``)."""
    from colo.apps import Booster, Llama
    from colo.apps.generation import RolloutEngine, rollout_model_inputs
    from colo.apps.rlhf import PPOCriterion, PPOHyperparameters, PPOLearner, attach_ppo_forward
    from colo.apps.rlhf.critic import critic_from_policy
    from colo.apps.rlhf.ppo import AdaptiveKLController

    config = _config()
    hybrid = layout != "one"
    actor_plugin, critic_plugin = _plugins(layout)

    def build() -> Llama:  # as the trainer builds the run's model: on the meta device for HybridParallel
        if hybrid:
            with torch.device("meta"):
                return Llama(config)
        model = Llama(config)
        model.init_weights(SEED)
        return model

    def boost(plugin, model, criterion) -> Booster:
        booster = Booster(plugin)
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), criterion=criterion)
        return booster

    losses = dict(loss_aggregation="seq-mean-token-mean", eps_low=0.2, eps_high=0.28, dual_clip=3.0, value_clip=0.2)
    actor_criterion = PPOCriterion("actor", entropy_coef=0.01, **losses)
    critic_criterion = PPOCriterion("critic", **losses)
    sampled = dict(temperature=TEMPERATURE, vocab_limit=VOCAB_LIMIT)
    actor = boost(actor_plugin, attach_ppo_forward(build(), role="actor", **sampled), actor_criterion)
    engine = RolloutEngine(actor, actor.engine.model)
    reference = attach_ppo_forward(actor.frozen_copy(build(), engine.full_state_dict()), role="actor", **sampled)
    device = None if critic_plugin.materializes_meta_models else "cpu"  # (a whole critic beside a tp actor)
    critic = boost(
        critic_plugin, critic_from_policy(build(), reference, seed=SEED + 2, device=device), critic_criterion
    )
    group = actor.mesh.group("dp")
    controller = AdaptiveKLController(0.1, target=0.5, horizon=100)
    settings = PPOHyperparameters(gamma=1.0, lam=0.95, epochs=1, minibatches=MINIBATCHES, max_new_tokens=NEW_TOKENS)
    learner = PPOLearner(actor, actor_criterion, critic=critic, critic_criterion=critic_criterion, settings=settings,
                         kl_controller=controller, group=group)  # fmt: skip
    steps, traffic = [], None
    for step in range(STEPS):
        rollouts, parts = [], []
        for dp_rank in [group.rank] if hybrid else range(DP):
            params, generator = _sampling(dp_rank, step)
            rollout = engine.generate(_prompts(dp_rank, step), params, generator=generator)
            rollouts.append(rollout.input_ids)
            part = {**rollout_model_inputs(rollout, hf=False), "response_mask": rollout.response_mask}
            parts.append({**part, "scores": _scores(rollout)})
        batch = _interleaved(parts)
        scores = batch.pop("scores")
        with torch.no_grad():
            ref_logps = reference(**batch)["logps"] * batch["response_mask"]
        batch, stats = learner.experience(batch, scores, ref_logps)
        if hybrid and step == 0:
            traffic = _actor_traffic(actor, batch)
        result = learner.update(batch, stats)
        stats = {key: value for key, value in stats.items() if key != "rows"}
        steps.append({"tokens": rollouts, "actor": result["actor"], "critic": result["critic"], "stats": stats,
                      "kl_coef": controller.value})  # fmt: skip
    models = {"actor": actor, "critic": critic}
    if not hybrid:
        params = {role: dict(booster.unwrap().named_parameters()) for role, booster in models.items()}
        return {
            "steps": steps,
            "params": {r: {n: p.detach().clone() for n, p in ps.items()} for r, ps in params.items()},
        }
    return {"steps": steps, "traffic": traffic, "mismatches": _compare_parameters(models, expected["params"])}


def _compare_parameters(models: dict, expected: dict) -> list[str]:
    """Every parameter of the tp x dp run against the single process's: a tensor-parallel shard against the matching
    slice."""
    from colo.tensor import layout_of

    mismatches = []
    for role, booster in models.items():
        named = dict(booster.engine.model.named_parameters())
        full = booster.engine.optimizer.full_params()  # whole over dp, this rank's tensor-parallel shards
        if not full:
            mismatches.append(f"{role}: no parameters")
        for name, value in full.items():
            wanted = _single_process_value(expected[role], name)
            layout = layout_of(named[name]) if name in named else None
            if layout is not None:
                wanted = layout.local_slice(wanted)
            try:
                torch.testing.assert_close(value, wanted, **PARAMETER_TOLERANCE)
            except AssertionError as error:
                mismatches.append(f"{role} {name}: {error}")
    return mismatches


def _single_process_value(expected: dict, name: str) -> torch.Tensor:
    """The single-process tensor of a boosted parameter: the same name, or the tensor-parallel q / k / v weights'
    rows of the fused ``qkv_proj.weight``."""
    if name in expected:
        return expected[name]
    config = _config()
    base, _, part = name.rpartition(".")
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    fused = expected[f"{base}.weight"]
    return {"q_weight": fused[:q], "k_weight": fused[q : q + kv], "v_weight": fused[q + kv :]}[part]


def _close(actual: list[float], wanted: list[float]) -> bool:
    """rtol 1e-5, with 1e-5 of the largest as the floor (a clipped loss may sit near 0)."""
    scale = max([abs(value) for value in wanted], default=0.0)
    return actual == pytest.approx(wanted, rel=1e-5, abs=1e-5 * scale)


def test_ppo_under_tp2_x_dp2_matches_one_process():
    expected = run_distributed(_ppo_run, "one", world_size=1, timeout=120)[0]
    for layout in LAYOUTS:
        _check(layout, run_distributed(_ppo_run, layout, expected, world_size=4, timeout=180), expected)
    steps = expected["steps"]
    assert steps[-1]["kl_coef"] != 0.1  # the controller moved
    assert any(abs(loss) > 1e-3 for step in steps for loss in step["actor"] + step["critic"])  # real updates


def _check(layout: str, results: list[dict], expected: dict) -> None:
    config = _config()
    for rank, result in enumerate(results):
        dp_rank = rank // 2  # Mesh(dp=2, tp=2): tp is the inner axis
        for step, (got, wanted) in enumerate(zip(result["steps"], expected["steps"])):
            assert torch.equal(got["tokens"][0], wanted["tokens"][dp_rank]), f"rank {rank} step {step}: tokens"
            assert len(got["actor"]) == len(got["critic"]) == MINIBATCHES
            for role in ("actor", "critic"):
                assert _close(got[role], wanted[role]), (layout, rank, step, role, got[role], wanted[role])
            for name, value in wanted["stats"].items():  # means of per-token values of order 1 that cross 0
                assert got["stats"][name] == pytest.approx(value, rel=1e-5, abs=1e-5), (layout, rank, step, name)
            assert got["kl_coef"] == pytest.approx(wanted["kl_coef"], rel=1e-12), (layout, rank, step)
        assert not result["mismatches"], (layout, result["mismatches"][:4])
        rows, width, response = result["traffic"]["shape"]
        # the embedding's and every layer's o_proj / down_proj all-reduce of (rows, width, hidden), then the vocabulary
        # statistics: a max of one float and a sum of three per response token; all_reduce: 2 (tp - 1) / tp * S bytes
        activations = rows * width * config.hidden_size * (1 + 2 * config.num_hidden_layers)
        assert result["traffic"]["all_gathers"] == 0
        assert result["traffic"]["all_reduce_bytes"] == 4 * (activations + rows * response * 4)
