"""Per-token log-probs of whole rows from a sequence-parallel Llama (Ulysses or ring attention over ``sp``).

Under `colo.apps.HybridParallel` with ``sp > 1`` each rank of the ``sp`` group holds a piece of every row
(contiguous for Ulysses, zigzag for ring attention: `colo.tensor.shard_sequence`) and the same, whole weights. The
online-RL and preference losses need per-token log-probs of the *whole* row: `split_token_logps` cuts the rows
itself, runs the model on this rank's piece, computes the log-probs (and entropies) of only the positions of its piece
that score a token (never the ``(tokens, vocab)`` logits of anything else; under tensor parallelism from this rank's
vocabulary columns, `colo.apps.rlhf.token_logps`), and all-gathers the ``(rows, length)`` values over ``sp``: every
rank then holds the same per-token values and computes the same loss from them, unchanged.

Gradients: the data-parallel reduction averages the parameter gradients over ``("dp", "sp")`` (sequence-parallel
ranks replicate the weights), and every ``sp`` rank's loss is the whole loss. The gather's backward is therefore a
reduce-scatter (`colo.tensor.gather_sequence` with ``sum_grad``): each rank receives the sum of the ranks'
gradients of its positions, ``sp`` times its own, and the average over ``sp`` of the per-rank parameter gradients is
the sum over the pieces, the one-process gradient. The loss needs no weight (1: the reported mean over the data ranks
is the loss).

A row whose length does not split into the layout's chunks is padded at its end (token 0, position 0, a document of
its own): under causal attention the padding follows every real token and changes nothing before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colo.tensor import gather_sequence, shard_positions, shard_sequence
from colo.tensor.zigzag import padded_seq_len

from ..booster.llama_plan import SequenceSplit
from ..models.llama import Llama
from .token_logps import llama_token_logps


def _pad_rows(
    input_ids: torch.Tensor, position_ids: torch.Tensor | None, document_ids: torch.Tensor | None, padding: int
):
    """The rows, ``padding`` positions longer (token 0, position 0, the row's last document id + 1)."""
    if not padding:
        return input_ids, position_ids, document_ids
    ids = F.pad(input_ids, (0, padding))
    if position_ids is not None:
        position_ids = F.pad(position_ids.expand(input_ids.shape[0], -1), (0, padding))
    if document_ids is not None:
        document_ids = document_ids.expand(input_ids.shape[0], -1)
        tail = (document_ids[:, -1:] + 1).expand(-1, padding)
        document_ids = torch.cat([document_ids, tail], dim=1)
    return ids, position_ids, document_ids


def _local_hidden(model: Llama, split: SequenceSplit, input_ids, position_ids, document_ids):
    """``(hidden, held, padded)``: the final hidden states of this rank's piece of the rows (padded to the layout's
    chunks), the positions of the row it holds, and the padded length."""
    rows, length = input_ids.shape
    num_shards, rank, layout = split.group.size, split.group.rank, split.layout
    padded = padded_seq_len(length, num_shards, layout)
    ids, positions, documents = _pad_rows(input_ids, position_ids, document_ids, padded - length)
    if positions is None:
        positions = torch.arange(padded, device=ids.device).expand(rows, -1)
    held = shard_positions(padded, num_shards, rank, layout).to(ids.device)
    hidden = model.hidden_states(
        shard_sequence(ids, num_shards=num_shards, rank=rank, layout=layout),
        shard_sequence(positions, num_shards=num_shards, rank=rank, layout=layout),
        document_ids=documents,
    )
    return hidden, held, padded


def _gather_rows(local: torch.Tensor, split: SequenceSplit, padded: int) -> torch.Tensor:
    """``(..., rows, padded)`` whole rows from every rank's ``(..., rows, padded / sp)`` piece; the backward sums the
    ranks' gradients (module docstring)."""
    return gather_sequence(local, group=split.group, layout=split.layout, seq_len=padded, dim=-1, sum_grad=True)


def _split_positions(model, split, input_ids, first, last, position_ids, document_ids, compute) -> torch.Tensor:
    """``(k, rows, last - first)``: the ``k`` per-position values ``compute(hidden, held)`` gives for this rank's
    positions among ``first .. last - 1`` (``hidden`` their final hidden states, ``held`` their column in the row),
    gathered over the ``sp`` group in one all-gather."""
    rows, length = input_ids.shape
    if not 0 <= first <= last <= length:
        raise ValueError(f"sequence-parallel forward: positions {first} .. {last} are not within rows of {length}")
    hidden, held, padded = _local_hidden(model, split, input_ids, position_ids, document_ids)
    scoring = ((held >= first) & (held < last)).nonzero().flatten()
    values = torch.stack([value.float() for value in compute(hidden.index_select(1, scoring), held[scoring])])
    local = torch.zeros(values.shape[0], rows, held.numel(), dtype=torch.float32, device=input_ids.device)
    local = local.index_copy(2, scoring, values)
    return _gather_rows(local, split, padded)[:, :, first:last]


def split_selected_token_logps(
    model: Llama,
    split: SequenceSplit,
    input_ids: torch.Tensor,
    *,
    rows: torch.Tensor,
    columns: torch.Tensor,
    targets: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    vocab_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and detached entropies) of ``targets`` at scattered positions ``(rows[i], columns[i])`` of whole
    rows (packed rows, where each row scores other columns: `colo.apps.rlhf.packing`), computed on this rank's piece
    of the rows, only at the positions it holds, and gathered over the ``sp`` group in one all-gather of ``(k, rows,
    length)`` values (the backward sums the ranks' gradients, module docstring). The rows' ``document_ids`` go to the
    model whole, as the pretraining path passes them (each attention core takes its piece's), and their
    ``position_ids`` are split with the tokens.

    Args:
        model, split, input_ids, position_ids, document_ids, temperature, vocab_limit: as `split_token_logps`
            (``input_ids`` padded at the end to the layout's chunks if they do not split into them).
        rows (torch.Tensor): ``(n,)`` the row of each scored position.
        columns (torch.Tensor): ``(n,)`` its column in the row.
        targets (torch.Tensor): ``(n,)`` the token it is scored on.
        entropy (bool): also return the (detached) entropies. Default: ``False``.

    Returns:
        tuple[torch.Tensor, torch.Tensor | None]: ``(logps, entropy)``, each ``(n,)`` float32, the same on every rank;
        ``logps`` differentiable.
    """
    num_rows = input_ids.shape[0]
    hidden, held, padded = _local_hidden(model, split, input_ids, position_ids, document_ids)
    local_column = torch.full((padded,), -1, dtype=torch.long, device=held.device)
    local_column[held] = torch.arange(held.numel(), device=held.device)
    where = local_column[columns]
    mine = (where >= 0).nonzero().flatten()  # the scored positions this rank holds
    local_rows, local_columns = rows[mine], where[mine]
    logps, entropies = llama_token_logps(
        model, hidden[local_rows, local_columns].unsqueeze(0), targets[mine].unsqueeze(0), temperature=temperature,
        entropy=entropy, vocab_limit=vocab_limit,
    )  # fmt: skip
    values = [logps[0]] + ([entropies[0].detach()] if entropies is not None else [])
    local = torch.zeros(num_rows, held.numel(), len(values), dtype=torch.float32, device=input_ids.device)
    local = local.index_put((local_rows, local_columns), torch.stack([v.float() for v in values], dim=-1))
    local = local.permute(2, 0, 1)  # (k, rows, this rank's positions)
    whole = _gather_rows(local, split, padded)[:, rows, columns]
    return whole[0], (whole[1] if entropy else None)


def split_token_logps(
    model: Llama,
    split: SequenceSplit,
    input_ids: torch.Tensor,
    *,
    first: int,
    last: int,
    targets: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
    vocab_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the tokens that positions ``first .. last - 1`` of whole rows predict, computed
    on this rank's piece of each row and gathered over the ``sp`` group (module docstring).

    Every rank of ``split.group`` must call it with the same rows.

    Args:
        model (Llama): the sequence-parallel Llama (`colo.apps.booster.llama_plan.sequence_split_of`).
        split (SequenceSplit): its group and layout.
        input_ids (torch.Tensor): ``(rows, length)`` whole rows.
        first (int): the first scoring position (``>= 0``).
        last (int): one past the last scoring position (``<= length``).
        targets (torch.Tensor | None): ``(rows, length)`` the token each position is scored on (``targets[:, j]``
            for position ``j``; only ``first .. last - 1`` are read); ``None``: the next token,
            ``input_ids[:, j + 1]`` (then ``last <= length - 1``). Default: ``None``.
        position_ids (torch.Tensor | None): ``(rows, length)`` or ``(1, length)`` positions. Default: ``None``.
        document_ids (torch.Tensor | None): ``(rows, length)`` the whole rows' document ids. Default: ``None``.
        temperature (float): the sampling temperature. Default: ``1.0``.
        entropy (bool): also return the entropies. Default: ``False``.
        entropy_grad (bool): keep the entropies differentiable (an entropy bonus; gathered as the log-probs are);
            else they are detached (a metric). Default: ``False``.
        vocab_limit (int | None): only ids below it are classes (`colo.apps.rlhf.token_logps.llama_token_logps`).
            Default: ``None``.

    Returns:
        tuple[torch.Tensor, torch.Tensor | None]: ``(logps, entropy)``, each ``(rows, last - first)`` float32, the
        same on every rank; ``logps`` differentiable.
    """
    outputs = split_rollout_outputs(
        model, split, input_ids, first=first, last=last, targets=targets, position_ids=position_ids,
        document_ids=document_ids, temperature=temperature, entropy=entropy, entropy_grad=entropy_grad,
        vocab_limit=vocab_limit,
    )  # fmt: skip
    return outputs["logps"], outputs.get("entropy")


def split_rollout_outputs(
    model: Llama,
    split: SequenceSplit,
    input_ids: torch.Tensor,
    *,
    first: int,
    last: int,
    targets: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    logps: bool = True,
    entropy: bool = False,
    entropy_grad: bool = False,
    vocab_limit: int | None = None,
    value_head: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """PPO's per-token outputs of whole rows from one pass of a sequence-parallel backbone: the log-probs (and
    entropies) of `split_token_logps` and, with ``value_head`` (a ``hidden -> 1`` module: a critic's scalar
    ``lm_head`` or a shared backbone's ``value_head``), its value at each position ``first .. last - 1``, all
    computed on this rank's piece and gathered over ``sp`` together (one all-gather; the backward sums the ranks'
    gradients, module docstring).

    Args:
        model, split, input_ids, first, last, targets, position_ids, document_ids, temperature, entropy,
            entropy_grad, vocab_limit: as `split_token_logps`.
        logps (bool): compute the log-probs (``False``: a critic, values only). Default: ``True``.
        value_head (torch.nn.Module | None): the value head; ``None``: no values. Default: ``None``.

    Returns:
        dict[str, torch.Tensor]: ``logps`` (and ``entropy``) when ``logps``, ``values`` with a ``value_head``; each
        ``(rows, last - first)`` float32, the same on every rank.
    """
    if not logps and value_head is None:
        raise ValueError("split_rollout_outputs: asked for neither log-probs nor values")
    length = input_ids.shape[1]
    if logps and targets is None:
        targets = F.pad(input_ids[:, 1:], (0, 1))
        if last > length - 1:
            raise ValueError(f"split_token_logps: last={last} leaves no next token in rows of {length}")
    names = []

    def compute(hidden: torch.Tensor, held: torch.Tensor) -> list[torch.Tensor]:
        values = []
        if logps:
            token_logps, entropies = llama_token_logps(
                model, hidden, targets.index_select(1, held), temperature=temperature, vocab_limit=vocab_limit,
                entropy=entropy, entropy_grad=entropy_grad,
            )  # fmt: skip
            names.append("logps")
            values.append(token_logps)
            if entropies is not None:
                names.append("entropy")
                values.append(entropies if entropy_grad else entropies.detach())
        if value_head is not None:
            names.append("values")
            values.append(value_head(hidden)[..., 0])
        return values

    whole = _split_positions(model, split, input_ids, first, last, position_ids, document_ids, compute)
    return dict(zip(names, whole))


def split_head_outputs(model: Llama, split: SequenceSplit, input_ids: torch.Tensor) -> torch.Tensor:
    """``(rows, length)`` float32: a one-output ``lm_head``'s value at every position of whole rows (a reward model,
    `colo.apps.rlhf.modeling.make_reward_model`), each rank computing its piece's and the values gathered over the
    ``sp`` group as `split_token_logps` gathers log-probs (the same on every rank; the backward sums the ranks'
    gradients)."""
    hidden, _, padded = _local_hidden(model, split, input_ids, None, None)
    local = model.lm_head(hidden)
    if local.shape[-1] != 1:
        raise ValueError(f"split_head_outputs: lm_head gives {local.shape[-1]} outputs a position, a reward head 1")
    return _gather_rows(local[..., 0].float(), split, padded)[:, : input_ids.shape[1]]
