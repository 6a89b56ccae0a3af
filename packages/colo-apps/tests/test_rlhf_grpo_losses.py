"""GRPO / RLOO formulas against hand-computed fixtures: group advantages (GRPO, Dr. GRPO, RLOO), the k1/k2/k3 KL
estimators, the clipped surrogate (symmetric and clip-higher), and each loss aggregation mode."""

from __future__ import annotations

import math

import pytest
import torch

from colo.apps.rlhf.advantages import group_advantages
from colo.apps.rlhf.policy_loss import AggregationCounts, aggregate_loss, clipped_policy_loss, kl_penalty

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of G = 4


def test_group_advantages_by_hand():
    std = math.sqrt((4 * 0.25) / 3)  # Bessel-corrected std of [1, 0, 0, 1]
    grpo = 0.5 / (std + 1e-4)
    expected = {
        "grpo": [grpo, -grpo, -grpo, grpo, 0, 0, 0, 0],
        "dr_grpo": [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0],
        # leave-one-out: 1 - (0 + 0 + 1) / 3 = 2/3 and 0 - (1 + 0 + 1) / 3 = -2/3
        "rloo": [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0],
    }
    for estimator, values in expected.items():
        got = group_advantages(REWARDS, 4, estimator=estimator)
        torch.testing.assert_close(got, torch.tensor(values), rtol=1e-6, atol=1e-7, msg=estimator)
    # integer rewards are accepted (float32 advantages)
    assert group_advantages(torch.tensor([1, 0]), 2, estimator="rloo").tolist() == [1.0, -1.0]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_of_one_is_rejected_naming_the_field(estimator):
    with pytest.raises(ValueError, match=r"group_size=1 samples per prompt.*use group_size >= 2"):
        group_advantages(torch.ones(4), 1, estimator=estimator)
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(torch.ones(4), 3, estimator=estimator)
    with pytest.raises(ValueError, match="unknown"):
        group_advantages(torch.ones(4), 2, estimator="ppo")


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    x = math.log(0.5)  # ref - logp
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-x, rel=1e-6)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * x * x, rel=1e-6)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - x - 1, rel=1e-6)
    equal = kl_penalty(ref, ref, "k3")
    assert equal.item() == 0.0  # no divergence from itself
    with pytest.raises(ValueError, match="unknown"):
        kl_penalty(logp, ref, "k4")


def test_clipped_surrogate_by_hand():
    # ratios 1.5, 0.5, 0.5, 1.5, 1.25 against advantages +1, +1, -1, -1, +1
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.25]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    old = torch.zeros(1, 5)
    logps = ratios.log().requires_grad_(True)
    terms = clipped_policy_loss(logps, old, advantages, eps_low=0.2)
    # -min(r A, clip(r, 0.8, 1.2) A): 1.5*1 -> clipped to 1.2; 0.5*1 -> 0.5 (the min); 0.5*-1 -> clip 0.8 gives -0.8;
    # 1.5*-1 -> -1.5 (the min); 1.25*1 -> clipped to 1.2
    torch.testing.assert_close(terms.loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5, -1.2]]))
    assert terms.clipped.tolist() == [[1.0, 0.0, 1.0, 0.0, 1.0]]
    # clip-higher (DAPO): eps_high 0.28 lets 1.25 through
    high = clipped_policy_loss(logps, old, advantages, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(high.loss[0, 4], torch.tensor(-1.25))
    assert high.clipped[0, 4].item() == 0.0
    # d(-r A)/d logp = -r A where unclipped, 0 where clipped
    high.loss.sum().backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5, -1.25]]))
    # the KL term: + beta * k3
    ref = torch.full((1, 5), -0.1)
    with_kl = clipped_policy_loss(logps.detach(), old, advantages, ref_logps=ref, beta=0.1)
    torch.testing.assert_close(with_kl.loss - terms.loss, 0.1 * kl_penalty(logps.detach(), ref, "k3"))
    with pytest.raises(ValueError, match="needs the reference"):
        clipped_policy_loss(logps, old, advantages, beta=0.1)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [0.5, 0.5, 100.0]])  # 100: masked out
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (6 + 4 + 1) / 6),  # tokens of the whole batch
        ("seq-mean-token-mean", (2 + 4 + 0.5) / 3),  # each row's mean, then the rows' mean
        ("seq-mean-token-sum-norm", (6 + 4 + 1) / (3 * 5)),  # sums over rows x max_new_tokens (5)
    ],
)
def test_aggregation_by_hand_and_split_invariance(mode, expected):
    counts = AggregationCounts(num_tokens=6, num_sequences=3, max_new_tokens=5)
    whole = aggregate_loss(LOSS, MASK, mode, counts)
    assert whole.item() == pytest.approx(expected, rel=1e-6)
    # split rows over "microbatches" / "ranks": the shares sum to the same loss with the global counts
    parts = sum(aggregate_loss(LOSS[i : i + 1], MASK[i : i + 1], mode, counts) for i in range(3))
    assert parts.item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="unknown"):
        aggregate_loss(LOSS, MASK, "sum", counts)
