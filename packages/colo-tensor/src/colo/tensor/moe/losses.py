"""The auxiliary losses of a router: load balancing (Switch / GShard) and z-loss (ST-MoE).

**Load balancing**, for ``E`` experts, ``k`` choices per token and a set of ``T`` tokens:
``L = E * sum_e f_e * P_e`` with ``f_e = (assignments to e) / T`` (not differentiable; sums to ``k``) and
``P_e = mean over the T tokens of p_e``, ``p`` the softmax scores (sigmoid scores normalized to sum to one per
token). Perfect balance gives ``k``. This is Hugging Face's ``load_balancing_loss_func`` for one layer.

- ``"batch"``: the set is every token of one forward on one rank (a microbatch). With data parallelism and
  gradient accumulation the training loss is the mean over ranks and microbatches of these per-microbatch losses,
  so its gradient is the mean of the per-microbatch gradients (what the tests check); the value depends on how
  the batch is split, as in Megatron's and Hugging Face's default.
- ``"sequence"``: ``L`` per sequence (the set is one sequence's ``S`` tokens), then the mean over sequences.
  Because each term sees one sequence only, the mean over ranks and microbatches of equal-sized shards is the mean
  over all sequences of the global batch: the loss and its gradient do not depend on the data-parallel size or the
  number of microbatches (DeepSeek-V3's sequence-wise balance loss has this form).

**Sequence parallelism** (``sequence_group``): each rank of the group holds a piece of every sequence. The
assignment counts (not differentiable) are summed over the group, so ``f`` is the whole sequences'; ``P`` stays
this rank's mean over its own tokens. The mean of the loss over the group's ranks (equal pieces) is then the
loss of the whole sequences, and so is the mean of its gradient: what averaging gradients over the group computes.

**z-loss**: ``mean over tokens of logsumexp(logits)^2`` (Zoph et al., 2022), keeps the logits small.
"""

from __future__ import annotations

import torch

from colo.comm import Group, all_reduce


def _balance_probs(scores: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "sigmoid":
        return scores / scores.sum(dim=-1, keepdim=True)
    return scores


def load_balancing_loss(
    scores: torch.Tensor,
    top_k_index: torch.Tensor,
    *,
    num_experts: int,
    batch_size: int | None = None,
    score_func: str = "softmax",
    sequence_group: Group | None = None,
) -> torch.Tensor:
    """The Switch / GShard load-balancing loss (see the module docstring), an fp32 scalar.

    Args:
        scores (torch.Tensor): ``(T, E)`` router scores.
        top_k_index (torch.Tensor): ``(T, k)`` chosen experts (kept and dropped alike: the router's choice).
        num_experts (int): ``E``.
        batch_size (int | None): ``None``: one set of all ``T`` tokens (the ``"batch"`` form); else the tokens are
            ``batch_size`` sequences of ``T / batch_size`` (the ``"sequence"`` form).
        score_func (str): ``"softmax"`` or ``"sigmoid"``.
        sequence_group (Group | None): the sequence-parallel group holding the other equal pieces of the same
            sequences (module docstring); ``None``: the tokens are whole sequences.
    """
    probs = _balance_probs(scores.to(torch.promote_types(scores.dtype, torch.float32)), score_func)
    groups = 1 if batch_size is None else batch_size
    tokens = probs.shape[0] // groups
    probs = probs.view(groups, tokens, num_experts)
    assigned = torch.zeros(groups, num_experts, dtype=probs.dtype, device=probs.device)
    ones = torch.ones(top_k_index.numel(), dtype=probs.dtype, device=probs.device)
    assigned.scatter_add_(1, top_k_index.reshape(groups, -1), ones.view(groups, -1))
    if sequence_group is not None and sequence_group.size > 1:  # whole sequences' counts; P stays this piece's
        assigned = all_reduce(assigned, group=sequence_group)
        fraction = assigned / (tokens * sequence_group.size)
    else:
        fraction = assigned / tokens
    mean_prob = probs.mean(dim=1)
    return num_experts * (fraction * mean_prob).sum(dim=-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The router z-loss ``mean_t logsumexp(logits_t)^2`` (an fp32 scalar) of ``(T, E)`` logits."""
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).square().mean()


class AuxLossScaler(torch.autograd.Function):
    """Forward: ``output`` unchanged (``aux_loss`` is only held). Backward: ``output``'s gradient passes through and
    ``aux_loss`` gets the constant gradient ``scale``, as if ``scale * aux_loss`` had been added to the loss.

    For a pipeline stage, whose output is not the loss: the stage's MoE blocks' aux losses join the backward that
    reaches the stage's output (Megatron-Core's ``MoEAuxLossAutoScaler`` does this), with ``scale`` the weight the
    schedule gives each microbatch's loss (``1 / num_microbatches``)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``output`` carrying ``aux_loss`` into its backward with weight ``scale`` (`AuxLossScaler`); ``output`` itself
    when there is no aux loss or it needs no gradient."""
    if aux_loss is None or not aux_loss.requires_grad:
        return output
    return AuxLossScaler.apply(output, aux_loss, scale)
