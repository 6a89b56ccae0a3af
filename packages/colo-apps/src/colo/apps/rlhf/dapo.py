"""DAPO's changes to GRPO's rollouts (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"): overlong reward shaping, truncated completions masked out of the loss, and dynamic sampling.

The loss-side changes live in `colo.apps.rlhf.policy_loss` (clip-higher: ``eps_high``; token-level averaging:
``"token-mean"``). This module holds the rollout-side ones:

- **Soft overlong punishment** (DAPO Eq. 13, TRL's ``get_soft_overlong_punishment``): with ``L`` the generation
  budget and ``B`` the buffer, a completion of ``n`` tokens (its eos counted) gets ``0`` for ``n <= L - B``,
  ``penalty * (L - B - n) / B`` inside the buffer (down to ``-penalty`` at ``n = L``) and ``-penalty`` past ``L``:
  `soft_overlong_punishment`.
- **Truncated completions out of the loss** (DAPO's overlong filtering, TRL's ``mask_truncated_completions``): a
  completion that did not end with an eos (it ran out of budget) keeps its row in the batch but none of its tokens
  in the loss or in the token count of ``"token-mean"``: `truncated_rows`.
- **Dynamic sampling**: a group whose rewards are all equal has zero advantage and gives no policy gradient, yet its
  tokens dilute the token-mean; `fill_informative_groups` drops such groups and generates more groups from the next
  prompts, for at most a bounded number of extra rounds, until the step's batch holds as many informative groups as
  it had prompts. The number of rounds is agreed by every data-parallel rank (one all-reduce of one number per
  round), so ranks that drop different numbers of groups generate the same number of times (under ZeRO-3 / Gemini a
  generation gathers chunks: every rank must enter it) and end with the same number of rows, hence the same number
  of update microbatches. When the rounds run out before the batch is full, the shortfall is filled with dropped
  groups in the order they were generated: zero advantage, so the batch trains as plain GRPO would on them (DAPO keeps
  sampling without bound; a bound keeps a step's time bounded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..generation.rollout import Rollout


def soft_overlong_punishment(
    lengths: torch.Tensor | Sequence[int], *, max_length: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment of completions of ``lengths`` tokens (module docstring; TRL's
    ``get_soft_overlong_punishment(max_length, buffer)`` at ``penalty=1``).

    Args:
        lengths (torch.Tensor | Sequence[int]): ``(R,)`` completion lengths, the eos counted.
        max_length (int): ``L``, the generation budget.
        buffer (int): ``B``, the last tokens before ``L`` where the penalty grows linearly (``0 < B <= L``).
        penalty (float): the penalty at ``L`` and beyond. Default: ``1.0``.

    Returns:
        torch.Tensor: ``(R,)`` float64 rewards, each in ``[-penalty, 0]``.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"soft_overlong_punishment: buffer={buffer} must be in [1, max_length={max_length}]")
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    start = max_length - buffer
    inside = (start - lengths) / buffer
    rewards = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    rewards = torch.where(lengths > max_length, torch.full_like(lengths, -1.0), rewards)
    return rewards * penalty


def truncated_rows(rollout: Rollout, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """``(R,)`` bool: the rows of ``rollout`` whose completion holds no eos (it ran out of budget; TRL's
    ``is_truncated``: the last token is neither an eos nor padding)."""
    eos = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    ids, mask = rollout.response_ids, rollout.response_mask.bool()
    ended = (torch.isin(ids, eos.to(ids.device)) & mask).any(dim=1)
    return ~ended


def equal_reward_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(R / G,)`` bool: the groups (``group_size`` contiguous rows) whose rewards are all exactly equal, whose
    advantages are therefore all zero under every estimator of `colo.apps.rlhf.advantages`."""
    groups = rewards.reshape(-1, group_size)
    return groups.amax(dim=1) == groups.amin(dim=1)


@dataclass(frozen=True)
class DynamicSample:
    """What `fill_informative_groups` returns: the step's update batch and how it was filled.

    Attributes:
        records: one prompt record per kept group, in batch order.
        rollout: their rows (``G`` per group, contiguous), re-padded to a common width.
        rewards: ``(R,)`` the rows' rewards.
        extra_rounds: generation rounds after the first (the same on every rank).
        dropped_groups: groups with all-equal rewards seen over every round on this rank.
        shortfall_groups: dropped groups put back to fill the batch when the rounds ran out (on this rank).
        generated_tokens: response tokens generated over every round on this rank.
    """

    records: list
    rollout: Rollout
    rewards: torch.Tensor
    extra_rounds: int
    dropped_groups: int
    shortfall_groups: int
    generated_tokens: int


def fill_informative_groups(
    records: list,
    rollout: Rollout,
    rewards: torch.Tensor,
    *,
    group_size: int,
    max_extra_rounds: int,
    generate: Callable[[list], Rollout],
    score: Callable[[list, Rollout], torch.Tensor],
    next_records: Callable[[], list],
    pad_token_id: int,
    group=None,
) -> DynamicSample:
    """DAPO's dynamic sampling over a first round already generated and scored (module docstring).

    Every rank of ``group`` must call it once per step. Each round: the groups with all-equal rewards are set aside;
    while some rank still lacks informative groups (one all-reduce of the largest deficit) and fewer than
    ``max_extra_rounds`` extra rounds ran, every rank draws ``next_records()``, generates and scores them.

    Args:
        records (list): the first round's prompt records (one per group).
        rollout (Rollout): their rollout, ``group_size`` rows per record.
        rewards (torch.Tensor): ``(R,)`` its rewards.
        group_size (int): ``G``.
        max_extra_rounds (int): the most rounds generated after the first.
        generate (Callable): ``records -> Rollout`` (the policy's sampler).
        score (Callable): ``(records, rollout) -> (R,)`` rewards.
        next_records (Callable): the next batch of prompt records (the data sampler's).
        pad_token_id (int): the padding of the re-padded batch.
        group: the colo `Group` of the data-parallel ranks (``None``: one process). Default: ``None``.

    Returns:
        DynamicSample: ``len(records)`` groups: the informative ones first found, then (when short) dropped ones.
    """
    target = len(records)
    kept: list[tuple[dict, Rollout, torch.Tensor]] = []
    dropped: list[tuple[dict, Rollout, torch.Tensor]] = []
    extra_rounds = dropped_groups = 0
    generated = int(rollout.response_mask.sum())
    while True:
        equal = equal_reward_groups(rewards, group_size).tolist()
        for index, record in enumerate(records):
            rows = slice(index * group_size, (index + 1) * group_size)
            (dropped if equal[index] else kept).append((record, _take_rows(rollout, rows), rewards[rows]))
        dropped_groups += sum(equal)
        if extra_rounds >= max_extra_rounds or not _any_rank_short(target - len(kept), group):
            break
        records = next_records()
        rollout = generate(records)
        rewards = score(records, rollout)
        generated += int(rollout.response_mask.sum())
        extra_rounds += 1
    chosen = kept[:target]
    shortfall = target - len(chosen)
    chosen += dropped[:shortfall]
    return DynamicSample(
        records=[record for record, _, _ in chosen],
        rollout=concat_rollouts([part for _, part, _ in chosen], group_size=group_size, pad_token_id=pad_token_id),
        rewards=torch.cat([part for _, _, part in chosen]),
        extra_rounds=extra_rounds,
        dropped_groups=dropped_groups,
        shortfall_groups=shortfall,
        generated_tokens=generated,
    )


def concat_rollouts(rollouts: Sequence[Rollout], *, group_size: int, pad_token_id: int) -> Rollout:
    """One `Rollout` of the rows of ``rollouts`` in order: prompts left-padded and responses right-padded to the
    widest, ``prompt_index`` renumbered one prompt per ``group_size`` rows."""
    prompt = max(part.prompt_length for part in rollouts)
    response = max(part.response_length for part in rollouts)
    pieces: dict[str, list[torch.Tensor]] = {"input_ids": [], "attention_mask": [], "response_mask": [], "logps": []}
    for part in rollouts:
        left, right = prompt - part.prompt_length, response - part.response_length
        pad = torch.nn.functional.pad
        pieces["input_ids"].append(pad(part.input_ids, (left, right), value=pad_token_id))
        pieces["attention_mask"].append(pad(part.attention_mask, (left, right), value=0))
        pieces["response_mask"].append(pad(part.response_mask, (0, right), value=0))
        pieces["logps"].append(pad(part.logprobs, (0, right), value=0.0))
    rows = sum(part.num_rows for part in rollouts)
    return Rollout(
        input_ids=torch.cat(pieces["input_ids"]),
        attention_mask=torch.cat(pieces["attention_mask"]),
        response_mask=torch.cat(pieces["response_mask"]),
        logprobs=torch.cat(pieces["logps"]),
        prompt_length=prompt,
        prompt_index=torch.arange(rows, device=rollouts[0].input_ids.device) // group_size,
        temperature=rollouts[0].temperature,
    )


def _take_rows(rollout: Rollout, rows: slice) -> Rollout:
    return Rollout(
        input_ids=rollout.input_ids[rows],
        attention_mask=rollout.attention_mask[rows],
        response_mask=rollout.response_mask[rows],
        logprobs=rollout.logprobs[rows],
        prompt_length=rollout.prompt_length,
        prompt_index=rollout.prompt_index[rows],
        temperature=rollout.temperature,
    )


def _any_rank_short(deficit: int, group) -> bool:
    """Whether any rank of ``group`` still lacks informative groups (every rank calls it: one all-reduce)."""
    value = torch.tensor([float(max(deficit, 0))], dtype=torch.float64)
    if group is not None and group.size > 1:
        import torch.distributed as dist

        from colo.comm import all_reduce

        nccl = dist.get_backend(group.process_group) == "nccl"
        reduced = value.to(torch.device("cuda", torch.cuda.current_device())) if nccl else value
        all_reduce(reduced, "max", group=group)
        value = reduced.cpu()
    return bool(value.item() > 0)
