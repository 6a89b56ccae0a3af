"""colo.apps.rlhf.losses against hand-computed values and the gradients their docstrings state."""

import math

import pytest
import torch

from colo.apps.rlhf import PreferenceCriterion, bradley_terry_loss, dpo_loss, ipo_loss, preference_loss, simpo_loss

POLICY = torch.tensor([-10.0, -4.0, -7.5], dtype=torch.float64)
OTHER = torch.tensor([-12.0, -3.0, -7.0], dtype=torch.float64)
REF_CHOSEN = torch.tensor([-11.0, -5.0, -7.0], dtype=torch.float64)
REF_REJECTED = torch.tensor([-11.5, -2.0, -8.0], dtype=torch.float64)
LENGTHS_CHOSEN = torch.tensor([4.0, 2.0, 5.0], dtype=torch.float64)
LENGTHS_REJECTED = torch.tensor([3.0, 6.0, 5.0], dtype=torch.float64)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_bradley_terry_fixture_and_gradient():
    chosen = torch.tensor([1.0, -0.5], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.0, 0.5], dtype=torch.float64, requires_grad=True)
    losses = bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.0, 1.0], dtype=torch.float64))
    expected = [-math.log(sigmoid(1.0)), -math.log(sigmoid(-2.0))]  # r_w - r_l - m
    torch.testing.assert_close(losses, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    losses.sum().backward()
    grad = torch.tensor([-(1 - sigmoid(1.0)), -(1 - sigmoid(-2.0))], dtype=torch.float64)
    torch.testing.assert_close(chosen.grad, grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(rejected.grad, -grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_dpo_and_cdpo_fixture_and_gradient(label_smoothing):
    beta = 0.3
    policy_chosen, policy_rejected = POLICY.clone().requires_grad_(), OTHER.clone().requires_grad_()
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        policy_chosen, policy_rejected, REF_CHOSEN, REF_REJECTED, beta=beta, label_smoothing=label_smoothing
    )
    for i in range(3):
        h = beta * ((POLICY[i] - REF_CHOSEN[i]) - (OTHER[i] - REF_REJECTED[i])).item()
        expected = -(1 - label_smoothing) * math.log(sigmoid(h)) - label_smoothing * math.log(sigmoid(-h))
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)
        assert chosen_rewards[i].item() == pytest.approx(beta * (POLICY[i] - REF_CHOSEN[i]).item(), rel=1e-12)
    losses.sum().backward()
    h = beta * ((POLICY - REF_CHOSEN) - (OTHER - REF_REJECTED))
    dloss_dh = -(1 - label_smoothing) * torch.sigmoid(-h) + label_smoothing * torch.sigmoid(h)
    torch.testing.assert_close(policy_chosen.grad, beta * dloss_dh, rtol=1e-12, atol=0)
    torch.testing.assert_close(policy_rejected.grad, -beta * dloss_dh, rtol=1e-12, atol=0)


def test_ipo_fixture_and_gradient():
    beta = 0.5
    policy_chosen, policy_rejected = POLICY.clone().requires_grad_(), OTHER.clone().requires_grad_()
    losses, _, _ = ipo_loss(
        policy_chosen,
        policy_rejected,
        REF_CHOSEN,
        REF_REJECTED,
        chosen_lengths=LENGTHS_CHOSEN,
        rejected_lengths=LENGTHS_REJECTED,
        beta=beta,
    )
    h = (POLICY - REF_CHOSEN) / LENGTHS_CHOSEN - (OTHER - REF_REJECTED) / LENGTHS_REJECTED
    torch.testing.assert_close(losses, (h - 1 / (2 * beta)) ** 2, rtol=1e-12, atol=0)
    assert losses[0].item() == pytest.approx(((1 / 4 - (-0.5) / 3) - 1.0) ** 2, rel=1e-12)  # by hand
    losses.sum().backward()
    torch.testing.assert_close(policy_chosen.grad, 2 * (h - 1 / (2 * beta)) / LENGTHS_CHOSEN, rtol=1e-12, atol=0)
    torch.testing.assert_close(policy_rejected.grad, -2 * (h - 1 / (2 * beta)) / LENGTHS_REJECTED, rtol=1e-12, atol=0)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_fixture_and_gradient(label_smoothing):
    beta, gamma = 2.0, 0.5
    policy_chosen, policy_rejected = POLICY.clone().requires_grad_(), OTHER.clone().requires_grad_()
    losses, chosen_rewards, _ = simpo_loss(
        policy_chosen,
        policy_rejected,
        chosen_lengths=LENGTHS_CHOSEN,
        rejected_lengths=LENGTHS_REJECTED,
        beta=beta,
        gamma=gamma,
        label_smoothing=label_smoothing,
    )
    h0 = beta * (-10.0 / 4 - (-12.0 / 3)) - gamma  # by hand: 2 * 1.5 - 0.5 = 2.5
    expected = -(1 - label_smoothing) * math.log(sigmoid(h0)) - label_smoothing * math.log(sigmoid(-h0))
    assert losses[0].item() == pytest.approx(expected, rel=1e-12)
    assert chosen_rewards[0].item() == pytest.approx(beta * -2.5, rel=1e-12)
    losses.sum().backward()
    h = beta * (POLICY / LENGTHS_CHOSEN - OTHER / LENGTHS_REJECTED) - gamma
    dloss_dh = -(1 - label_smoothing) * torch.sigmoid(-h) + label_smoothing * torch.sigmoid(h)
    torch.testing.assert_close(policy_chosen.grad, beta * dloss_dh / LENGTHS_CHOSEN, rtol=1e-12, atol=0)
    torch.testing.assert_close(policy_rejected.grad, -beta * dloss_dh / LENGTHS_REJECTED, rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.0), ("sigmoid", 0.25), ("ipo", 0.0)])
def test_policy_equal_to_reference_gives_the_closed_form(loss_type, label_smoothing):
    beta = 0.1
    logps = POLICY.clone().requires_grad_()
    rejected = OTHER.clone().requires_grad_()
    losses, _, _ = preference_loss(
        loss_type,
        logps,
        rejected,
        POLICY,
        OTHER,
        chosen_lengths=LENGTHS_CHOSEN,
        rejected_lengths=LENGTHS_REJECTED,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    expected = math.log(2) if loss_type == "sigmoid" else (1 / (2 * beta)) ** 2  # = 1 / (4 beta^2), rounded once
    assert torch.equal(losses, torch.full((3,), expected, dtype=torch.float64))  # exactly
    losses.sum().backward()
    if loss_type == "sigmoid":  # d/dh at h = 0: -(1 - eps) / 2 + eps / 2
        grad = beta * (-(1 - label_smoothing) * 0.5 + label_smoothing * 0.5)
        torch.testing.assert_close(logps.grad, torch.full((3,), grad, dtype=torch.float64), rtol=1e-12, atol=0)
    else:  # 2 (0 - 1 / (2 beta)) / |y_w|
        torch.testing.assert_close(logps.grad, -(1 / beta) / LENGTHS_CHOSEN, rtol=1e-12, atol=0)


def test_criterion_checks_and_metrics():
    with pytest.raises(ValueError, match="unknown"):
        PreferenceCriterion("kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        PreferenceCriterion("ipo", label_smoothing=0.1)
    criterion = PreferenceCriterion("sigmoid", beta=0.5)
    output = {
        "logps": torch.stack([POLICY, OTHER], 1),
        "num_tokens": torch.stack([LENGTHS_CHOSEN, LENGTHS_REJECTED], 1),
    }
    with pytest.raises(ValueError, match="ref_logps"):
        criterion(output, {})
    loss = criterion(output, {"ref_logps": torch.stack([REF_CHOSEN, REF_REJECTED], 1)})
    metrics = criterion.take_metrics()
    assert metrics["loss"] == pytest.approx(loss.item())
    assert metrics["accuracy"] == pytest.approx(2 / 3)  # log-ratio margins 1.5, 2, -1.5
    assert criterion.take_metrics() == {}
