"""Critic-free advantages from the rewards of ``G`` samples per prompt: GRPO, Dr. GRPO and RLOO.

Every estimator takes the ``(R,)`` rewards of a rollout whose rows of one prompt are contiguous (prompt ``i`` owns
rows ``i * G .. i * G + G - 1``, the `colo.apps.generation.Rollout` layout) and returns one advantage per row,
applied to every token of that row's response. With ``r_i`` the rewards of one group, ``mean`` their mean and
``std`` their sample standard deviation (Bessel-corrected, as TRL's ``nanstd``):

- ``"grpo"`` (Shao et al., 2024, DeepSeekMath §4.1.2): ``A_i = (r_i - mean) / (std + eps)``;
- ``"dr_grpo"`` (Liu et al., 2025, "Understanding R1-Zero-Like Training", Dr. GRPO): ``A_i = r_i - mean``, without
  the division by the group's std that biases updates towards groups of nearly equal rewards;
- ``"rloo"`` (Ahmadian et al., 2024, REINFORCE Leave-One-Out; Kool et al., 2019): the baseline of sample ``i`` is
  the mean of the *other* ``G - 1`` rewards, ``A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) (r_i - mean)``.

All three need ``G >= 2``: with one sample a group has no std, no leave-one-out baseline, and a mean-centred
advantage of 0 (no learning signal).
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
"""The ``estimator`` values of `group_advantages`."""


def check_group_size(group_size: int, estimator: str, *, field: str = "group_size") -> None:
    """Raise a `ValueError` naming ``field`` when ``group_size`` samples per prompt cannot give ``estimator``'s
    advantages (see the module docstring), or the estimator is unknown."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is unknown; use one of {ADVANTAGE_ESTIMATORS}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        why = {
            "grpo": "the group normalization divides by the std of the group's rewards, undefined for one sample",
            "dr_grpo": "the advantage r_i - mean of a group of one is always 0: nothing to learn from",
            "rloo": "the leave-one-out baseline of a group of one has no other samples",
        }[estimator]
        raise ValueError(
            f"{field}={group_size!r} samples per prompt with the {estimator!r} advantage: {why}; use {field} >= 2"
        )


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, estimator: str = "grpo", std_eps: float = 1e-4
) -> torch.Tensor:
    """Per-row advantages of ``rewards`` grouped ``group_size`` rows per prompt (see the module docstring).

    Args:
        rewards (torch.Tensor): ``(R,)`` rewards, ``R`` a multiple of ``group_size``, groups contiguous.
        group_size (int): ``G``, samples per prompt (>= 2).
        estimator (str): ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``. Default: ``"grpo"``.
        std_eps (float): ``eps`` of ``"grpo"``'s denominator (TRL's 1e-4). Default: ``1e-4``.

    Returns:
        torch.Tensor: ``(R,)`` advantages in ``rewards``' floating dtype (float32 for integer rewards).

    Raises:
        ValueError: an unknown estimator, ``group_size < 2``, or ``R`` not a multiple of it.
    """
    check_group_size(group_size, estimator)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: rewards {tuple(rewards.shape)} must be (R,) with R a multiple of "
            f"group_size={group_size} (rows of one prompt contiguous)"
        )
    values = rewards if rewards.is_floating_point() else rewards.float()
    groups = values.reshape(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        advantages = centred / (groups.std(dim=1, keepdim=True) + std_eps)
    elif estimator == "dr_grpo":
        advantages = centred
    else:
        advantages = centred * (group_size / (group_size - 1))
    return advantages.reshape(-1)
