"""The causal language-modelling objective: next-token cross-entropy from the final hidden states.

Labels follow Hugging Face's convention: ``labels`` is aligned with ``input_ids`` (usually a copy of it), position
``t`` is scored on predicting ``labels[t + 1]``, and ``-100`` marks tokens without a loss. The shift is done on
the labels (``labels[..., 1:]`` padded with the ignore index at the end), never on the hidden states or logits,
so nothing activation-sized is copied; the loss is the mean over the non-ignored targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colo.kernels import cross_entropy, fused_linear_cross_entropy

IGNORE_INDEX = -100
"""The label value of tokens that add no loss (Hugging Face's and PyTorch's default)."""


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The target of every position: ``labels[..., t + 1]``, and ``ignore_index`` at the last position.

    Args:
        labels (torch.Tensor): ``(batch, seq)`` integer labels aligned with the inputs.
        ignore_index (int): label of tokens without a loss. Default: ``-100``.

    Returns:
        torch.Tensor: ``(batch, seq)`` targets.
    """
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token cross-entropy of full-vocabulary logits (`colo.kernels.cross_entropy`), in fp32.

    Usable as a pipeline executor's ``loss_fn(output, target)`` when the last stage outputs logits.

    Args:
        logits (torch.Tensor): ``(batch, seq, vocab)``.
        labels (torch.Tensor): ``(batch, seq)`` labels aligned with the inputs (see the module docstring).
        ignore_index (int): label of tokens without a loss. Default: ``-100``.

    Returns:
        torch.Tensor: the scalar fp32 mean over non-ignored targets (0 when every target is ignored).
    """
    targets = shift_labels(labels, ignore_index)
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


def sharded_causal_lm_loss(
    logits: torch.Tensor, targets: dict[str, torch.Tensor], *, num_shards: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The next-token loss of a sequence shard, scaled so that the mean over the shards is the whole sequence's.

    A pipeline executor's ``loss_fn(output, target)`` under Ulysses or ring attention: each sequence-parallel rank
    holds a piece of every sequence, its labels shifted over the whole sequence before the split. The result is
    ``num_shards * (this shard's summed cross-entropy) / (the microbatch's labelled targets over all shards)``;
    averaging it over the shards (as the data-parallel gradient and loss means do) gives the mean over every
    labelled target of the microbatch, as `causal_lm_loss` of the whole sequence. No communication.

    Args:
        logits (torch.Tensor): ``(batch, local_seq, vocab)`` this shard's logits.
        targets (dict[str, torch.Tensor]): ``"labels"``: ``(batch, local_seq)`` this shard's targets (already
            shifted); ``"num_targets"``: ``(batch,)`` each row's labelled targets in the whole sequence.
        num_shards (int): the sequence-parallel size (bind it with ``functools.partial``).
        ignore_index (int): label of tokens without a loss. Default: ``-100``.

    Returns:
        torch.Tensor: the scaled fp32 scalar (0 when every target is ignored).
    """
    labels = targets["labels"]
    total = cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    count = targets["num_targets"].sum().clamp(min=1)
    return total * num_shards / count.to(total.dtype)


class LMHead(nn.Linear):
    """The output projection ``hidden -> vocab`` that can also return the next-token loss without the logits.

    ``lm_head(hidden)`` gives logits like ``nn.Linear``; ``lm_head(hidden, targets=t)`` gives the mean
    cross-entropy against per-position targets through `colo.kernels.fused_linear_cross_entropy`. Either way the
    weight is used inside this module's own forward, so hooks that manage its memory (ZeRO-3 / Gemini gathering
    it before the module runs) see the use.
    """

    def forward(
        self, hidden: torch.Tensor, targets: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden)
        return fused_linear_cross_entropy(hidden, self.weight, targets, bias=self.bias, ignore_index=ignore_index)


class CausalLMObjective(nn.Module):
    """How the final hidden states become logits and the next-token loss, given the model's output projection.

    A module without parameters so that a parallel plan can put another in its place: `parallelize_llama`
    swaps in the vocabulary-parallel version. By default the loss uses `colo.kernels.fused_linear_cross_entropy`,
    which never materializes the ``(tokens, vocab)`` logits; with ``return_logits`` the logits are computed once
    and the loss taken from them.

    Args:
        ignore_index (int): label of tokens without a loss. Default: ``-100``.
        fused (bool): compute the loss with the fused output projection + cross-entropy when no logits are
            asked for (``lm_head`` must then be a plain linear layer holding the whole vocabulary). Default:
            ``True``.
    """

    def __init__(self, *, ignore_index: int = IGNORE_INDEX, fused: bool = True):
        super().__init__()
        self.ignore_index, self.fused = ignore_index, fused
        self.labels_shifted = False
        """Set by sequence-parallel plans: ``labels`` are already the targets of their positions (shifted over
        the whole sequence before it was split), so the objective must not shift them again."""

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """The target of every position: ``labels`` shifted by one, unless they already are."""
        return labels if self.labels_shifted else shift_labels(labels, self.ignore_index)

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        labels: torch.Tensor | None = None,
        *,
        return_logits: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The loss (when ``labels`` are given) and the logits (when asked for, or without ``labels``).

        Args:
            hidden (torch.Tensor): ``(batch, seq, hidden)`` final hidden states (after the last norm).
            lm_head (nn.Module): the output projection ``hidden -> vocab``.
            labels (torch.Tensor | None): ``(batch, seq)`` labels aligned with the inputs. Default: ``None``.
            return_logits (bool): also return the logits when ``labels`` are given. Default: ``False``.

        Returns:
            tuple[torch.Tensor | None, torch.Tensor | None]: ``(loss, logits)``; the loss is an fp32 scalar,
            the logits ``(batch, seq, vocab)``.
        """
        if labels is None:
            return None, lm_head(hidden)
        if self.fused and not return_logits:
            targets = self.targets(labels)
            if isinstance(lm_head, LMHead):
                return lm_head(hidden, targets=targets, ignore_index=self.ignore_index), None
            loss = fused_linear_cross_entropy(
                hidden, lm_head.weight, targets, bias=getattr(lm_head, "bias", None), ignore_index=self.ignore_index
            )
            return loss, None
        logits = lm_head(hidden)
        targets = self.targets(labels)
        return cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=self.ignore_index
        ), logits

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, fused={self.fused}"
