"""PPO's arithmetic (colo.apps.rlhf.ppo) against naive loops and hand fixtures, and the critic's values
(colo.apps.rlhf.critic) against plain torch computations of the same models."""

from __future__ import annotations

import math

import pytest
import torch

from colo.apps.rlhf.ppo import (
    AdaptiveKLController,
    FixedKLController,
    PPOCriterion,
    build_kl_controller,
    clipped_value_loss,
    explained_variance,
    gae,
    kl_shaped_rewards,
    masked_moments,
    ppo_policy_loss,
    whiten,
)
from colo.comm.testing import run_distributed


def _masks(lengths, width):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def _naive_gae(rewards, values, mask, gamma, lam):
    """A double loop over rows and start tokens: ``A_t = sum_l (gamma lam)^l delta_{t+l}`` within the row."""
    rows, width = rewards.shape
    advantages = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        n = int(mask[i].sum())
        deltas = []
        for t in range(n):
            following = float(values[i, t + 1]) if t + 1 < n else 0.0
            deltas.append(float(rewards[i, t]) + gamma * following - float(values[i, t]))
        for t in range(n):
            advantages[i, t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t))
    returns = (advantages + values.double()) * mask
    return advantages, returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_a_naive_double_loop(gamma, lam):
    generator = torch.Generator().manual_seed(0)
    lengths, width = [7, 3, 1, 0, 5], 7
    mask = _masks(lengths, width)
    rewards = torch.randn(5, width, generator=generator)
    values = torch.randn(5, width, generator=generator)  # garbage past the ends must not leak in
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected_advantages, expected_returns = _naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages.double(), expected_advantages, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(returns.double(), expected_returns, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="gamma=1.5"):
        gae(rewards, values, mask, gamma=1.5, lam=lam)


def test_kl_shaped_rewards_put_the_score_on_the_last_token():
    mask = _masks([3, 1, 0], 3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 9.0, 9.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rewards, kl = kl_shaped_rewards(torch.tensor([1.0, -2.0, 5.0]), old, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    expected = torch.tensor([[-0.05, 0.1, 1.0], [-0.1 - 2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


def test_whitening_uses_the_moments_of_the_masked_tokens():
    generator = torch.Generator().manual_seed(1)
    mask = _masks([4, 2, 3], 4)
    values = torch.randn(3, 4, generator=generator) * 3 + 1
    picked = values[mask.bool()].double()
    mean, variance, count = masked_moments(values, mask)
    assert count == 9
    assert mean == pytest.approx(float(picked.mean()), rel=1e-12)
    assert variance == pytest.approx(float(picked.var(unbiased=True)), rel=1e-12)
    whitened = whiten(values, mask)
    expected = (picked - picked.mean()) / torch.sqrt(picked.var() + 1e-8)
    torch.testing.assert_close(whitened[mask.bool()].double(), expected, rtol=1e-5, atol=1e-6)
    assert float(whitened[~mask.bool()].abs().sum()) == 0.0
    kept = whiten(values, mask, shift_mean=False)[mask.bool()].double()
    torch.testing.assert_close(kept, expected + picked.mean(), rtol=1e-5, atol=1e-6)


def _whiten_half(values, mask):
    from colo.comm import world_group

    group = world_group()
    rows = values.shape[0] // 2
    part = slice(group.rank * rows, (group.rank + 1) * rows)
    explained = explained_variance(values[part], values[part] * 2.0 + 1.0, mask[part], group)
    return whiten(values[part], mask[part], group=group), explained


def test_whitening_over_two_ranks_matches_the_whole_batch():
    generator = torch.Generator().manual_seed(2)
    mask = _masks([4, 2, 3, 1], 4)
    values = torch.randn(4, 4, generator=generator)
    halves = run_distributed(_whiten_half, values, mask, world_size=2, timeout=60)
    torch.testing.assert_close(torch.cat([h[0] for h in halves]), whiten(values, mask), rtol=1e-6, atol=1e-7)
    whole = explained_variance(values, values * 2.0 + 1.0, mask)
    assert halves[0][1] == pytest.approx(whole, rel=1e-9) and halves[1][1] == pytest.approx(whole, rel=1e-9)


def test_clipped_value_loss_fixture():
    values = torch.tensor([1.0, 1.0, 0.0, 2.0])
    old = torch.tensor([0.5, 1.2, 0.5, 1.5])
    returns = torch.tensor([2.0, 0.0, -1.0, 1.5])
    terms = clipped_value_loss(values, old, returns, clip=0.2)
    # clip(V, old +- 0.2) = [0.7, 1.0, 0.3, 1.7]
    plain = torch.tensor([1.0, 1.0, 1.0, 0.25])
    clipped = torch.tensor([1.69, 1.0, 1.69, 0.04])
    torch.testing.assert_close(terms.loss, 0.5 * torch.max(plain, clipped))
    torch.testing.assert_close(terms.clipped, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(clipped_value_loss(values, old, returns, clip=None).loss, 0.5 * plain)


def test_policy_loss_asymmetric_clip_dual_clip_and_entropy_bonus():
    ratio = torch.tensor([[0.5, 1.5, 5.0, 5.0, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, 1.0, -2.0]])
    logps = torch.log(ratio).requires_grad_()
    old = torch.zeros(1, 5)
    entropy = torch.full((1, 5), 2.0)
    terms = ppo_policy_loss(
        logps, old, advantages, eps_low=0.2, eps_high=0.28, dual_clip=3.0, entropy=entropy, entropy_coef=0.01
    )
    # -min(rho A, clip(rho, 0.8, 1.28) A): [-0.5, -1.28, 5.0 -> dual clip 3.0, -1.28, 2.0], minus 0.02
    expected = torch.tensor([[-0.5, -1.28, 3.0, -1.28, 2.0]]) - 0.02
    torch.testing.assert_close(terms.loss.detach(), expected)
    torch.testing.assert_close(terms.clipped, torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(terms.dual_clipped, torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]]))
    terms.loss.sum().backward()
    # gradient flows only where nothing clips: d(-rho A)/d logp = -rho A
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.5, 0.0, 0.0, 0.0, 2.0]]))
    with pytest.raises(ValueError, match="dual_clip=0.5 must be > 1"):
        ppo_policy_loss(logps, old, advantages, dual_clip=0.5)
    with pytest.raises(ValueError, match="needs the policy's entropy"):
        ppo_policy_loss(logps, old, advantages, entropy_coef=0.1)


def test_adaptive_kl_controller_fixture_and_state():
    controller = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    controller.update(9.0, 256)  # error clipped to +0.2
    assert controller.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000), rel=1e-15)
    controller.update(6.6, 128)  # error 0.1
    after = 0.2 * (1 + 0.2 * 256 / 10000) * (1 + 0.1 * 128 / 10000)
    assert controller.value == pytest.approx(after, rel=1e-15)
    controller.update(0.0, 1000)  # error clipped to -0.2
    after *= 1 - 0.2 * 1000 / 10000
    assert controller.value == pytest.approx(after, rel=1e-15)
    restored = build_kl_controller("adaptive", init=1.0, target=1.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.state_dict() == controller.state_dict()
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="same ppo.kl_controller"):
        fixed.load_state_dict(controller.state_dict())
    with pytest.raises(ValueError, match="needs a target KL"):
        build_kl_controller("adaptive", init=0.1)


def test_explained_variance_fixture():
    mask = _masks([3, 2], 3)
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    values = returns + torch.tensor([[0.5, -0.5, 0.5], [-0.5, 0.5, 0.0]])
    residual = torch.tensor([-0.5, 0.5, -0.5, 0.5, -0.5], dtype=torch.float64).var()
    spread = torch.tensor([1.0, 2, 3, 4, 5], dtype=torch.float64).var()
    assert explained_variance(values, returns, mask) == pytest.approx(1 - float(residual / spread))
    assert math.isnan(explained_variance(values, torch.ones(2, 3), mask))


# --- the critic's values and the first minibatch -------------------------------------------------------------------


def _native(seed=3):
    from colo.apps import Llama, get_preset

    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(seed)
    return model


def _rollout_inputs():
    from colo.apps.generation import Rollout

    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(4, 128, (3, 9), generator=generator)
    attention = torch.ones_like(input_ids)
    input_ids[1, :2], attention[1, :2] = 0, 0
    mask = _masks([4, 2, 3], 4)
    rollout = Rollout(input_ids, attention, mask, torch.zeros(3, 4), 5, torch.arange(3), 0.7)
    return rollout, mask


def test_value_heads_match_plain_torch():
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf import make_reward_model
    from colo.apps.rlhf.critic import add_value_head, attach_ppo_forward

    rollout, mask = _rollout_inputs()
    inputs = rollout_model_inputs(rollout, hf=False)
    critic = make_reward_model(_native(), seed=1)
    with torch.no_grad():
        hidden = critic.hidden_states(inputs["input_ids"], inputs["position_ids"], document_ids=inputs["document_ids"])
        expected = (hidden @ critic.lm_head.weight.T)[:, 4:-1, 0]
    attach_ppo_forward(critic, role="critic")
    torch.testing.assert_close(critic(**inputs, response_mask=mask)["values"], expected, rtol=1e-6, atol=1e-6)

    shared = add_value_head(_native(), seed=2)
    plain_logits = shared(inputs["input_ids"], inputs["position_ids"], return_logits=True,
                          document_ids=inputs["document_ids"]).logits  # fmt: skip
    attach_ppo_forward(shared, role="actor_critic", temperature=0.7)
    out = shared(**inputs, response_mask=mask)
    with torch.no_grad():
        hidden = shared.hidden_states(inputs["input_ids"], inputs["position_ids"], document_ids=inputs["document_ids"])
    torch.testing.assert_close(out["values"], (hidden @ shared.value_head.weight.T)[:, 4:-1, 0], rtol=1e-6, atol=1e-6)
    log_probs = torch.log_softmax(plain_logits[:, 4:-1].float() / 0.7, -1)
    picked = log_probs.gather(-1, inputs["input_ids"][:, 5:, None])[..., 0]
    torch.testing.assert_close(out["logps"], picked, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["entropy"], -(log_probs.exp() * log_probs).sum(-1), rtol=1e-5, atol=1e-6)
    assert out["entropy"].requires_grad  # the entropy bonus has a gradient

    with pytest.raises(ValueError, match="make_reward_model"):
        attach_ppo_forward(_native(), role="critic")
    with pytest.raises(ValueError, match="add_value_head"):
        attach_ppo_forward(_native(), role="actor_critic")


def test_hf_critic_reads_score_at_every_position():
    transformers = pytest.importorskip("transformers")
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf.critic import attach_ppo_forward

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.LlamaForSequenceClassification(config).eval()
    rollout, mask = _rollout_inputs()
    inputs = rollout_model_inputs(rollout, hf=True)
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state
        expected = model.score(hidden)[:, 4:-1, 0]
        pooled = model(input_ids=inputs["input_ids"][:1]).logits[0, 0]  # row 0 has no padding: the last token
    attach_ppo_forward(model, role="critic")
    values = model(**inputs, response_mask=mask)["values"]
    torch.testing.assert_close(values, expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        last = model.score(model.model(input_ids=inputs["input_ids"][:1]).last_hidden_state)[0, -1, 0]
    assert float(pooled) == pytest.approx(float(last), rel=1e-5, abs=1e-6)


def test_first_minibatch_with_recomputed_old_logps_has_ratio_one_and_no_clip():
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf import global_counts
    from colo.apps.rlhf.critic import add_value_head, attach_ppo_forward

    rollout, mask = _rollout_inputs()
    model = attach_ppo_forward(add_value_head(_native()), role="actor_critic", temperature=0.7)
    inputs = rollout_model_inputs(rollout, hf=False)
    with torch.no_grad():
        first = model(**inputs, response_mask=mask)
    advantages = whiten(torch.randn(3, 4, generator=torch.Generator().manual_seed(6)), mask)
    batch = {
        **inputs,
        "response_mask": mask,
        "old_logps": first["logps"] * mask,
        "old_values": first["values"] * mask,
        "advantages": advantages,
        "returns": advantages + 1.0,
    }
    criterion = PPOCriterion("actor_critic", eps_low=0.2, eps_high=0.28, dual_clip=3.0, entropy_coef=0.01)
    criterion.prepare(global_counts(mask, max_new_tokens=4), num_microbatches=1, num_data_ranks=1)
    loss = criterion(model(**batch), batch)
    loss.backward()
    metrics = criterion.take_metrics()
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_fraction"] == 0.0 and metrics["dual_clip_fraction"] == 0.0
    assert metrics["value_clip_fraction"] == 0.0
    assert model.value_head.weight.grad is not None and float(model.value_head.weight.grad.abs().sum()) > 0


def test_vocab_limit_takes_log_probs_over_the_sampled_ids():
    """With a padded vocabulary the actor's log-probs and entropy are those of the softmax over the ids generation
    samples from: over the whole vocabulary, moving mass onto never-sampled ids would lower log pi of every sampled
    token below the reference's and pay a negative k1 'KL' as reward."""
    from colo.apps.generation import rollout_model_inputs
    from colo.apps.rlhf.critic import attach_ppo_forward

    rollout, mask = _rollout_inputs()
    inputs = rollout_model_inputs(rollout, hf=False)
    limit = int(inputs["input_ids"].max()) + 1  # the fixture's ids; the model's vocabulary is larger
    whole = _native()
    assert limit < whole.config.vocab_size
    plain = whole(inputs["input_ids"], inputs["position_ids"], return_logits=True,
                  document_ids=inputs["document_ids"]).logits[:, 4:-1].detach()  # fmt: skip
    attach_ppo_forward(whole, role="actor", temperature=0.7)
    limited = attach_ppo_forward(_native(), role="actor", temperature=0.7, vocab_limit=limit)
    out, full = limited(**inputs, response_mask=mask), whole(**inputs, response_mask=mask)
    log_probs = torch.log_softmax(plain[..., :limit].float() / 0.7, -1)
    picked = log_probs.gather(-1, inputs["input_ids"][:, 5:, None])[..., 0]
    torch.testing.assert_close(out["logps"], picked, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["entropy"], -(log_probs.exp() * log_probs).sum(-1), rtol=1e-5, atol=1e-6)
    assert bool((full["logps"] < out["logps"]).all())  # the padded ids hold some mass
