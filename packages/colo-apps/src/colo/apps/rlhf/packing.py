"""Packed rows for the online-RL update: several rollout rows in one row of a token budget, with document masks, so
that no compute is spent on padding.

A rollout batch holds ``(R, P + T)`` rows: each prompt left-padded to ``P`` columns and each response right-padded to
``T`` (`colo.apps.generation.rollout_model_inputs`). Row ``r`` needs only its real tokens up to the one before its last
response token (the positions that predict its ``t_r`` response tokens); everything else is padding, and with prompts
and responses of different lengths (long reasoning responses above all) most of the batch can be. `pack_rollout_rows`
lays those segments one after another into rows of ``budget`` tokens (first fit, longest first), each a document of its
own (positions from 0, `colo.kernels.document_mask`: attention never crosses two segments); `packed_token_logps` runs
colo's `Llama` once over the packed rows and scatters the per-token log-probs and entropies back to ``(R, T)``, so the
loss, its aggregation and the microbatches are unchanged. Causal attention within a segment sees exactly what it saw in
its padded row, so the values are the padded forward's up to rounding (`tests/test_rlhf_grpo_pack.py`: log-probs, loss
and every gradient equal). Under Ulysses or ring attention the packed rows (their length rounded up to the layout's
chunks, `packing_budget`) are split over ``sp`` like any row and the values gathered before they are scattered back
(`tests/test_rlhf_grpo_pack_sp.py`: the same equalities at sp2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colo.tensor.zigzag import padded_seq_len

from ..booster.llama_plan import SequenceSplit
from ..models.llama import Llama
from .sequence_logps import split_selected_token_logps
from .token_logps import llama_token_logps


@dataclass(frozen=True)
class PackedRows:
    """Rollout rows packed into rows of a token budget (`pack_rollout_rows`).

    Attributes:
        input_ids: ``(N, budget)`` the packed tokens (0 after the last segment of a row).
        position_ids: ``(N, budget)`` positions from 0 in each segment.
        document_ids: ``(N, budget)`` one id per segment, non-decreasing; the tail padding an id of its own.
        rows, columns: ``(n,)`` where each scored response token's predicting position lies in the packed rows.
        source_rows, source_columns: ``(n,)`` that token's row and response column in the ``(R, T)`` output.
        targets: ``(n,)`` the tokens scored.
        padded_tokens: ``R x (P + T)``, what the padded forward computes.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    source_rows: torch.Tensor
    source_columns: torch.Tensor
    targets: torch.Tensor
    padded_tokens: int

    @property
    def packed_tokens(self) -> int:
        """``N x budget``, what the packed forward computes."""
        return self.input_ids.numel()


def pack_rollout_rows(
    input_ids: torch.Tensor, position_ids: torch.Tensor, response_mask: torch.Tensor, *, budget: int | None = None
) -> PackedRows:
    """Pack the segments of rollout rows that the response log-probs need into rows of ``budget`` tokens (module
    docstring).

    Args:
        input_ids (torch.Tensor): ``(R, P + T)`` rollout rows (prompts left-padded, responses right-padded).
        position_ids (torch.Tensor): ``(R, P + T)`` their positions, 0 at each row's first real token
            (`colo.apps.generation.rollout_model_inputs`); the left padding is read from them.
        response_mask (torch.Tensor): ``(R, T)`` 1 on response tokens (a prefix of each row's ``T`` columns).
        budget (int | None): the packed rows' length; ``None``: twice the padded rows' ``P + T`` (a packed row then
            wastes less than the longest segment: under half of it). Default: ``None``.

    Returns:
        PackedRows: the packed rows and where each response token's log-prob comes from and goes.

    Raises:
        ValueError: a budget shorter than a row's segment.
    """
    rows, width = input_ids.shape
    length = response_mask.shape[1]
    prompt = width - length
    budget = 2 * width if budget is None else budget
    padding = (prompt - 1 - position_ids[:, prompt - 1]).long().tolist()
    responses = response_mask.sum(dim=1).long().tolist()
    segments = []  # (row, first column, segment length); a row without response tokens needs nothing
    for row in range(rows):
        if responses[row]:
            first = padding[row]
            segments.append((row, first, prompt - 1 + responses[row] - first))
    longest = max((size for _, _, size in segments), default=0)
    if longest > budget:
        raise ValueError(f"pack_rollout_rows: a row needs {longest} tokens, more than the budget of {budget}")
    placed, used = [None] * len(segments), []  # (packed row, offset) per segment; tokens used per packed row
    for number in sorted(range(len(segments)), key=lambda n: -segments[n][2]):  # first fit, longest first
        size = segments[number][2]
        packed = next((k for k, tokens in enumerate(used) if tokens + size <= budget), len(used))
        if packed == len(used):
            used.append(0)
        placed[number] = (packed, used[packed])
        used[packed] += size
    device = input_ids.device
    ids = torch.zeros(len(used), budget, dtype=input_ids.dtype, device=device)
    positions = torch.zeros(len(used), budget, dtype=torch.long, device=device)
    documents = torch.zeros(len(used), budget, dtype=torch.long, device=device)
    index = {name: [] for name in ("rows", "columns", "source_rows", "source_columns")}
    count = [0] * len(used)
    for (packed, offset), (row, first, size) in sorted(zip(placed, segments)):  # document ids rise along a row
        ids[packed, offset : offset + size] = input_ids[row, first : first + size]
        positions[packed, offset : offset + size] = torch.arange(size, device=device)
        documents[packed, offset : offset + size] = count[packed]
        count[packed] += 1
        scored = responses[row]
        start = offset + size - scored  # the positions that predict the response tokens: the segment's last ones
        index["rows"].append(torch.full((scored,), packed))
        index["columns"].append(torch.arange(start, start + scored))
        index["source_rows"].append(torch.full((scored,), row))
        index["source_columns"].append(torch.arange(scored))
    for packed, size in enumerate(used):  # the tail padding: a document of its own after the last segment
        documents[packed, size:] = count[packed]
    index = {
        name: (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)
        for name, parts in index.items()
    }
    targets = input_ids[index["source_rows"], prompt + index["source_columns"]]
    return PackedRows(ids, positions, documents, **index, targets=targets, padded_tokens=input_ids.numel())


def packed_token_logps(
    model: Llama,
    packed: PackedRows,
    shape: tuple[int, int],
    *,
    temperature: float = 1.0,
    entropy: bool = True,
    split: SequenceSplit | None = None,
    vocab_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logps, entropy)``, each ``(R, T)`` float32 and 0 past each row's response: colo's `Llama` over the packed
    rows (one forward), the log-probs (under tensor parallelism from this rank's vocabulary columns,
    `colo.apps.rlhf.token_logps.llama_token_logps`) and detached entropies of the scored tokens, scattered back.

    Under Ulysses or ring attention (``split``) each packed row is split over ``sp`` as any row is: each rank runs its
    piece (its tokens and positions; the whole rows' document ids, which each attention core cuts as it cuts the
    sequence), scores the tokens its piece predicts, and the values are gathered over ``sp``
    (`colo.apps.rlhf.sequence_logps.split_selected_token_logps`) before they are scattered back; the same on every
    sp rank.

    Args:
        model (Llama): the policy.
        packed (PackedRows): from `pack_rollout_rows` (under ``split``, with a budget that divides into the layout's
            chunks, `packing_budget`, else the rows are padded at their end).
        shape (tuple[int, int]): ``(R, T)``.
        temperature (float): the sampling temperature. Default: ``1.0``.
        entropy (bool): also the entropies. Default: ``True``.
        split (SequenceSplit | None): the sequence-parallel group and layout of ``model``
            (`colo.apps.booster.llama_plan.sequence_split_of`); ``None``: whole rows. Default: ``None``.
        vocab_limit (int | None): only ids below it are classes (`colo.apps.rlhf.token_logps.llama_token_logps`).
            Default: ``None``.
    """
    if split is not None:
        logps, entropies = split_selected_token_logps(
            model, split, packed.input_ids, rows=packed.rows, columns=packed.columns, targets=packed.targets,
            position_ids=packed.position_ids, document_ids=packed.document_ids, temperature=temperature,
            entropy=entropy, vocab_limit=vocab_limit,
        )  # fmt: skip
    else:
        hidden = model.hidden_states(packed.input_ids, packed.position_ids, document_ids=packed.document_ids)
        scored = hidden[packed.rows, packed.columns].unsqueeze(0)
        logps, entropies = llama_token_logps(
            model, scored, packed.targets.unsqueeze(0), temperature=temperature, entropy=entropy,
            vocab_limit=vocab_limit,
        )  # fmt: skip
        logps, entropies = logps[0], (entropies[0].detach() if entropies is not None else None)
    where = (packed.source_rows, packed.source_columns)
    zeros = torch.zeros(shape, dtype=torch.float32, device=packed.input_ids.device)
    logps = zeros.index_put(where, logps.float())
    if entropies is not None:
        entropies = zeros.index_put(where, entropies.float())
    return logps, entropies


def packing_budget(width: int, split: SequenceSplit | None = None) -> int:
    """The packed rows' length for rollout rows of ``width`` tokens: twice it (`pack_rollout_rows`), rounded up
    under sequence parallelism to the chunks its layout splits a row into (``sp`` for Ulysses, ``2 sp`` for ring's
    zigzag), so the packed rows split without padding."""
    budget = 2 * width
    if split is None:
        return budget
    return padded_seq_len(budget, split.group.size, split.layout)
