"""The criteria `Booster.boost(criterion=...)` takes for preference training, and their metrics.

A criterion is called as ``criterion(output, microbatch) -> scalar loss`` on the pair forward's output
(`colo.apps.rlhf.modeling.attach_pair_forward`); it also keeps this rank's per-pair statistics of the step
(detached), which `take_metrics` turns into means over the data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .losses import PREFERENCE_LOSSES, bradley_terry_loss, preference_loss
from .pair_pipeline import PairPipeline


class _PairMetrics:
    """Per-pair statistics of the microbatches since the last `take_metrics` (this rank's)."""

    def __init__(self) -> None:
        self._columns: dict[str, list[torch.Tensor]] = {}

    def record(self, **columns: torch.Tensor) -> None:
        for name, values in columns.items():
            self._columns.setdefault(name, []).append(values.detach().double().cpu().reshape(-1))

    def take_metrics(self, group=None) -> dict[str, float]:
        """The means of every statistic over the pairs recorded since the last call, on every rank of ``group``
        (a colo `Group`; one all-reduce), then forget them."""
        if not self._columns:
            return {}
        names = sorted(self._columns)
        sums = torch.stack(
            [torch.cat(self._columns[n]).sum() for n in names] + [torch.tensor(0.0, dtype=torch.float64)]
        )
        sums[-1] = torch.cat(self._columns[names[0]]).numel()
        if group is not None and group.size > 1:
            from colo.comm import all_reduce

            all_reduce(sums, group=group)
        self._columns = {}
        return {name: float(sums[i] / sums[-1]) for i, name in enumerate(names)}


class RewardCriterion(PairPipeline, _PairMetrics):
    """The Bradley-Terry loss of a reward model's pair output (`colo.apps.rlhf.losses.bradley_terry_loss`).

    Metrics: ``accuracy`` (chosen reward above rejected), ``margin`` (their difference), ``reward_chosen``,
    ``reward_rejected``.

    Args:
        margin (float | None): a fixed margin; a ``margin`` tensor in the batch (``(pairs,)``) wins over it.
            Default: ``None``.
        pad_id (int | None): the padding token, read under a pipeline (the reward is the head's value at the
            rightmost other token; `colo.apps.rlhf.pair_pipeline`). Default: ``None``.
    """

    pipeline_head = "reward"

    def __init__(self, *, margin: float | None = None, pad_id: int | None = None) -> None:
        super().__init__()
        self.margin, self.pad_id = margin, pad_id

    def __call__(self, output: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        rewards = output["rewards"]
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        margin = batch.get("margin", self.margin)
        losses = bradley_terry_loss(chosen, rejected, margin=margin)
        self.record(
            loss=losses,
            accuracy=(chosen > rejected).double(),
            margin=chosen - rejected,
            reward_chosen=chosen,
            reward_rejected=rejected,
        )
        return losses.mean()


class PreferenceCriterion(PairPipeline, _PairMetrics):
    """A DPO-family loss of the policy's pair output (`colo.apps.rlhf.losses.preference_loss`).

    The reference log-probs come from the batch (``ref_logps``, ``(pairs, 2)``: precomputed once, see
    `colo.apps.rlhf.reference`); ``"simpo"`` needs none. Metrics: ``accuracy`` (implicit reward of the chosen
    response above the rejected one's), ``margin``, ``reward_chosen``, ``reward_rejected``, ``logps_chosen``,
    ``logps_rejected``.

    Args:
        loss_type (str): ``"sigmoid"`` (DPO; cDPO with ``label_smoothing``), ``"ipo"`` or ``"simpo"``.
        beta (float): the temperature. Default: ``0.1``.
        label_smoothing (float): cDPO's ``eps`` (``sigmoid`` and ``simpo``). Default: ``0.0``.
        simpo_gamma (float): SimPO's target margin. Default: ``0.5``.
    """

    def __init__(
        self, loss_type: str = "sigmoid", *, beta: float = 0.1, label_smoothing: float = 0.0, simpo_gamma: float = 0.5
    ) -> None:
        super().__init__()
        if loss_type not in PREFERENCE_LOSSES:
            raise ValueError(f"PreferenceCriterion: loss_type={loss_type!r} is unknown; use one of {PREFERENCE_LOSSES}")
        if not beta > 0:
            raise ValueError(f"PreferenceCriterion: beta={beta} must be positive")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"PreferenceCriterion: label_smoothing={label_smoothing} must be in [0, 0.5)")
        if loss_type == "ipo" and label_smoothing:
            raise ValueError("PreferenceCriterion: label_smoothing applies to 'sigmoid' and 'simpo', not 'ipo'")
        self.loss_type, self.beta, self.label_smoothing, self.simpo_gamma = (
            loss_type,
            beta,
            label_smoothing,
            simpo_gamma,
        )
        self.sft = False
        """While set, the loss is the next-token loss of the chosen responses (token mean): the SFT stage a DPO
        recipe starts with."""

    @property
    def needs_reference(self) -> bool:
        return self.loss_type != "simpo"

    def __call__(self, output: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logps, counts = output["logps"], output["num_tokens"]
        if self.sft:
            loss = -logps[:, 0].sum() / counts[:, 0].sum().clamp(min=1)
            self.record(sft_loss=loss.expand(logps.shape[0]))
            return loss
        reference = batch.get("ref_logps")
        if self.needs_reference and reference is None:
            raise ValueError(
                f"loss_type={self.loss_type!r} needs the reference log-probs in the batch ('ref_logps', (pairs, 2)); "
                "precompute them with colo.apps.rlhf.precompute_reference_logps"
            )
        reference = reference.to(logps.dtype) if reference is not None else None
        losses, chosen_rewards, rejected_rewards = preference_loss(
            self.loss_type,
            logps[:, 0],
            logps[:, 1],
            None if reference is None else reference[:, 0],
            None if reference is None else reference[:, 1],
            chosen_lengths=counts[:, 0],
            rejected_lengths=counts[:, 1],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            simpo_gamma=self.simpo_gamma,
        )
        self.record(
            loss=losses,
            accuracy=(chosen_rewards > rejected_rewards).double(),
            margin=chosen_rewards - rejected_rewards,
            reward_chosen=chosen_rewards,
            reward_rejected=rejected_rewards,
            logps_chosen=logps[:, 0],
            logps_rejected=logps[:, 1],
        )
        return losses.mean()
