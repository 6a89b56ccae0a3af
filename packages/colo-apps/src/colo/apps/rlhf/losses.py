"""Preference losses: the Bradley-Terry reward-model loss and the DPO family (DPO, cDPO, IPO, SimPO).

Every function takes per-pair tensors of shape ``(pairs,)`` and returns the per-pair losses (``(pairs,)``, reduce
them yourself: the trainer takes the mean) together with the implicit rewards where the method defines them. The
inputs are *sequence* log-probabilities: the sum over the response's tokens of ``log pi(y_t | x, y_<t)``
(`colo.apps.rlhf.modeling.sequence_logps`); IPO and SimPO divide them by the number of response tokens.

Notation: ``sigma`` the logistic function, ``pi`` the policy, ``ref`` the frozen reference, ``y_w`` / ``y_l`` the
chosen / rejected response, ``|y|`` its number of tokens, ``beta`` the temperature, ``eps`` the label smoothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo")
"""The ``loss_type`` values of `preference_loss`: DPO (with cDPO's label smoothing), IPO, SimPO."""


def bradley_terry_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, *, margin: torch.Tensor | float | None = None
) -> torch.Tensor:
    """The reward model's pairwise loss (Bradley & Terry, 1952; Ouyang et al., 2022, Eq. 1; Llama 2's margin).

    ``loss = -log sigma(r_w - r_l - m)`` per pair, with ``m = 0`` without a margin. Its gradient with respect to
    ``r_w`` is ``-(1 - sigma(r_w - r_l - m))`` and with respect to ``r_l`` the negative of that.

    Args:
        chosen_rewards (torch.Tensor): ``(pairs,)`` scalar rewards of the chosen responses.
        rejected_rewards (torch.Tensor): ``(pairs,)`` rewards of the rejected ones.
        margin (torch.Tensor | float | None): a per-pair (or shared) margin the chosen reward must exceed the rejected
            one by (Touvron et al., 2023, Eq. 2). Default: ``None`` (no margin).

    Returns:
        torch.Tensor: ``(pairs,)`` losses.
    """
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        difference = difference - margin
    return -F.logsigmoid(difference)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss (Rafailov et al., 2023, Eq. 7) and conservative DPO's label smoothing (Mitchell, 2023).

    With ``h = beta * ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)))``::

        loss = -(1 - eps) log sigma(h) - eps log sigma(-h)

    ``eps = 0`` is DPO. ``d loss / d h = -(1 - eps) sigma(-h) + eps sigma(h)``. With the policy equal to the
    reference ``h = 0`` and the loss is exactly ``log 2`` for every ``eps``.

    Args:
        policy_chosen (torch.Tensor): ``(pairs,)`` policy log-probs of the chosen responses.
        policy_rejected (torch.Tensor): ``(pairs,)`` of the rejected ones.
        reference_chosen (torch.Tensor): ``(pairs,)`` reference log-probs of the chosen responses.
        reference_rejected (torch.Tensor): ``(pairs,)`` of the rejected ones.
        beta (float): the KL temperature.
        label_smoothing (float): ``eps`` in ``[0, 0.5)``, the assumed probability that a label is flipped.
            Default: ``0.0``.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(pairs,)``; the implicit rewards
        ``beta * (log pi - log ref)`` are detached.
    """
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    h = beta * (chosen_ratio - rejected_ratio)
    losses = -F.logsigmoid(h) * (1 - label_smoothing) - F.logsigmoid(-h) * label_smoothing
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IPO (Azar et al., 2023, Eq. 17) on per-token log-ratios, as TRL computes it.

    With ``h = (log pi(y_w) - log ref(y_w)) / |y_w| - (log pi(y_l) - log ref(y_l)) / |y_l|``::

        loss = (h - 1 / (2 beta))^2,      d loss / d h = 2 (h - 1 / (2 beta))

    With the policy equal to the reference the loss is exactly ``1 / (4 beta^2)``.

    Args:
        policy_chosen, policy_rejected, reference_chosen, reference_rejected (torch.Tensor): ``(pairs,)`` sequence
            log-probs (sums over the response tokens).
        chosen_lengths, rejected_lengths (torch.Tensor): ``(pairs,)`` response token counts (clamped to >= 1).
        beta (float): the regularization ``tau`` of the paper.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``; the rewards are ``beta * (log pi - log ref)`` (summed, as
        for DPO), detached.
    """
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    h = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
    losses = (h - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    *,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng et al., 2024, Eq. 6): reference-free, length-normalized, with a target margin ``gamma``.

    With ``a_w = log pi(y_w) / |y_w|``, ``a_l = log pi(y_l) / |y_l|`` and ``h = beta (a_w - a_l) - gamma``::

        loss = -(1 - eps) log sigma(h) - eps log sigma(-h)

    (TRL's ``CPOTrainer(loss_type="simpo")`` writes it ``beta * (a_w - a_l - gamma / beta)``: the same number.)

    Args:
        policy_chosen, policy_rejected (torch.Tensor): ``(pairs,)`` sequence log-probs of the policy.
        chosen_lengths, rejected_lengths (torch.Tensor): ``(pairs,)`` response token counts (clamped to >= 1).
        beta (float): the reward scale.
        gamma (float): the target reward margin.
        label_smoothing (float): ``eps``. Default: ``0.0``.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``; the rewards are ``beta * a`` (detached).
    """
    chosen_average = policy_chosen / chosen_lengths.clamp(min=1)
    rejected_average = policy_rejected / rejected_lengths.clamp(min=1)
    h = beta * (chosen_average - rejected_average - gamma / beta)
    losses = -F.logsigmoid(h) * (1 - label_smoothing) - F.logsigmoid(-h) * label_smoothing
    return losses, beta * chosen_average.detach(), beta * rejected_average.detach()


def preference_loss(
    loss_type: str,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor | None,
    reference_rejected: torch.Tensor | None,
    *,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dpo_loss` (``"sigmoid"``, with label smoothing: cDPO), `ipo_loss` or `simpo_loss` by name.

    Raises:
        ValueError: an unknown ``loss_type``, or a reference-based loss without reference log-probs.
    """
    if loss_type == "simpo":
        return simpo_loss(
            policy_chosen,
            policy_rejected,
            chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths,
            beta=beta,
            gamma=simpo_gamma,
            label_smoothing=label_smoothing,
        )
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"loss_type={loss_type!r} is unknown; use one of {PREFERENCE_LOSSES}")
    if reference_chosen is None or reference_rejected is None:
        raise ValueError(f"loss_type={loss_type!r} needs the reference model's log-probs; 'simpo' needs none")
    if loss_type == "ipo":
        return ipo_loss(
            policy_chosen,
            policy_rejected,
            reference_chosen,
            reference_rejected,
            chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths,
            beta=beta,
        )
    return dpo_loss(
        policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=beta, label_smoothing=label_smoothing
    )
