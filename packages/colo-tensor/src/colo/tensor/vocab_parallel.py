"""Vocabulary-parallel embedding and cross-entropy (Megatron-LM): the vocabulary is split over a mesh axis.

`VocabParallelEmbedding` holds a contiguous range of vocabulary rows per rank; each rank looks up the tokens
it owns, zeros the others and one all-reduce assembles the embeddings. `vocab_parallel_cross_entropy` takes
the logits of a column-parallel output layer (each rank holds a contiguous range of vocabulary columns) and
computes the cross-entropy with two small all-reduces per token row, never gathering the full logits.

A vocabulary that does not divide by the axis size is padded to ``tp * ceil(vocab / tp)`` rows; padding rows
are zero, never looked up, and masked out of the cross-entropy by ``vocab_size``.

Both take token ids that must be the same on every rank of the group and lie in the vocabulary: a rank looking up
another rank's ids, or an id no rank owns, would give a silently wrong embedding (a zero row) or loss where one
process raises. So the embedding's first forward, the cross-entropy with ``check=True`` (the Llama objective's first
call) and every call under ``COLO_DEBUG_CHECKS=1`` run `check_tokens`: one small exchange over the group, and the
same `ValueError` / `IndexError` on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Group, Mesh, all_reduce
from colo.comm.debug import debug_checks, disagreement, exchange, fingerprint

from .comm_ops import all_reduce_copy
from .layers import sharded_parameter, tp_size
from .layout import layout_of, set_layout
from .placement import chunk_size


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split over a mesh axis.

    Rank ``r`` holds rows ``[r * rows, (r + 1) * rows)`` with ``rows = ceil(num_embeddings / tp)``; rows past
    ``num_embeddings`` are zero padding. The weight's layout is ``Shard(0)`` on ``axis`` over the padded shape
    ``(tp * rows, embedding_dim)``. Forward: a local lookup of the tokens in this rank's range (others give
    zeros) and `all_reduce_copy` (forward all-reduce, backward identity).

    Token ids must lie in ``[0, num_embeddings)`` and be the same on every rank of the group: the first forward
    (and every forward under ``COLO_DEBUG_CHECKS=1``) checks both (`check_tokens`, one small exchange) and raises
    on every rank, an `IndexError` for an id outside the vocabulary as ``nn.Embedding`` does in one process.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: size of each embedding vector.
        mesh: the mesh; the weight is sharded on ``axis`` and replicated on its other axes.
        axis: the tensor-parallel mesh axis. Default ``"tp"``.
        padding_idx: as in ``torch.nn.Embedding``: that row starts at zero and gets no gradient. Default ``None``.
        device: where to create the weight (``"meta"``: no memory, no initialisation).
        dtype: weight dtype.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        mesh: Mesh,
        axis: str = "tp",
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp = tp_size(mesh, axis, "VocabParallelEmbedding")
        if num_embeddings < 1:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={num_embeddings} must be at least 1")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"VocabParallelEmbedding: padding_idx={padding_idx} must be in "
                    f"[-{num_embeddings}, {num_embeddings})"
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.mesh, self.axis, self.group = mesh, axis, mesh.group(axis)
        rows = chunk_size(num_embeddings, self.tp)
        self.num_embeddings_padded = rows * self.tp
        self.vocab_start = mesh.rank(axis) * rows
        self.vocab_end = min(self.vocab_start + rows, num_embeddings)
        local = torch.empty(rows, embedding_dim, device=device, dtype=dtype)
        self.weight = sharded_parameter(local, mesh, axis, 0, (self.num_embeddings_padded, embedding_dim))
        self.ids_checked = False
        """Whether a forward has checked its ids (`check_tokens`); later ones skip it unless ``COLO_DEBUG_CHECKS``."""
        self.reset_parameters()

    @property
    def local_padding_idx(self) -> int | None:
        """``padding_idx`` as a row of this rank's shard, or ``None`` when another rank holds it."""
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            return self.padding_idx - self.vocab_start
        return None

    def reset_parameters(self) -> None:
        """Draw the full table as ``nn.Embedding`` does (normal, padding row zero) and keep this rank's rows."""
        if self.weight.is_meta:
            return
        full = torch.empty(self.num_embeddings, self.embedding_dim, device=self.weight.device, dtype=self.weight.dtype)
        nn.init.normal_(full)
        if self.padding_idx is not None:
            with torch.no_grad():
                full[self.padding_idx].zero_()
        self._load_full(full)

    @torch.no_grad()
    def _load_full(self, full: torch.Tensor) -> None:
        rows = self.weight.shape[0]
        shard = torch.zeros(rows, self.embedding_dim, device=full.device, dtype=full.dtype)
        owned = self.vocab_end - self.vocab_start
        if owned > 0:
            shard[:owned] = full[self.vocab_start : self.vocab_end]
        if self.weight.is_meta:
            layout = layout_of(self.weight)
            self.weight = set_layout(nn.Parameter(shard, requires_grad=self.weight.requires_grad), layout)
        else:
            self.weight.copy_(shard)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, mesh: Mesh, axis: str = "tp") -> VocabParallelEmbedding:
        """The vocabulary-parallel layer holding this rank's rows of ``embedding``'s table."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"from_embedding: expected a torch.nn.Embedding, not {type(embedding).__name__}")
        if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
            raise ValueError("from_embedding: max_norm, sparse and scale_grad_by_freq are not supported")
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            mesh=mesh,
            axis=axis,
            padding_idx=embedding.padding_idx,
            device="meta",
            dtype=embedding.weight.dtype,
        )
        layer._load_full(embedding.weight.detach())
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: integer tensor of any shape, the same on every rank. Returns ``(*ids.shape, embedding_dim)``."""
        if not torch.compiler.is_compiling() and (not self.ids_checked or debug_checks()):
            check_tokens(ids, group=self.group, num_classes=self.num_embeddings, what="VocabParallelEmbedding: ids")
            self.ids_checked = True
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce_copy(out, group=self.group)

    def extra_repr(self) -> str:
        padded = ""
        if self.num_embeddings_padded != self.num_embeddings:
            padded = f" (padded to {self.num_embeddings_padded})"
        return (
            f"{self.num_embeddings}{padded}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"axis={self.axis!r}, tp={self.tp}"
        )


def check_tokens(
    tokens: torch.Tensor, *, group: Group, num_classes: int, what: str, ignore_index: int | None = None
) -> None:
    """Raise on every rank of ``group`` unless every rank holds the same ``tokens`` and each lies in
    ``[0, num_classes)`` (or equals ``ignore_index``): one exchange of ``(shape, fingerprint, min, max)``.

    Not for compiled code (its ``.item()`` calls break the graph): callers skip it under ``torch.compile``.

    Raises:
        ValueError: the ranks hold different tokens (naming the group and which ranks differ).
        IndexError: a token outside the vocabulary (naming it and ``num_classes``), as one process's lookup raises.
    """
    if tokens.is_meta:
        return
    valid = tokens if ignore_index is None else tokens[tokens != ignore_index]
    low, high = (int(valid.min()), int(valid.max())) if valid.numel() else (0, 0)
    everyone = exchange((tuple(tokens.shape), fingerprint(tokens), low, high), group, f"{what} check")
    differ = disagreement([summary[:2] for summary in everyone], group)
    if differ is not None:
        raise ValueError(
            f"{what} differ between the ranks of group {group.describe()}: {differ}. Every rank of a tensor-parallel "
            "group must get the same tokens (each computes a part of the same sequences): draw them with the same "
            "seed on every rank, or broadcast them from the group's first rank (colo.comm.broadcast)"
        )
    if low < 0 or high >= num_classes:
        allowed = "" if ignore_index is None else f", or ignore_index={ignore_index}"
        raise IndexError(
            f"{what}: token id {high if high >= num_classes else low} is out of range for a vocabulary of "
            f"{num_classes} (ids must be in [0, {num_classes}){allowed}); encode the data with the model's tokenizer "
            "or give the model a vocabulary that holds every id"
        )


def shifted_vocab_parallel_rows(
    logits: torch.Tensor, tokens: torch.Tensor, *, group: Group, vocab_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The common first half of a loss over vocabulary-parallel logits: this rank's columns as fp32 rows minus each
    row's largest logit over every rank (one all-reduce of one number per row), and each row's token there.

    Rank ``r`` holds columns ``[r * V, (r + 1) * V)`` (``V = logits.shape[-1]``); columns from ``vocab_size`` on are
    padding (``-inf`` before the shift).

    Returns:
        ``(shifted, local_tokens, owned, token_logit, padding)``: ``shifted`` ``(N, V)``; per row the token's column
        here (0 where another rank owns it), whether this rank owns it, its shifted logit (0 where not owned); the
        ``(V,)`` padding mask or ``None``.
    """
    local_vocab = logits.shape[-1]
    start = group.rank * local_vocab
    rows = logits.reshape(-1, local_vocab).float()
    tokens = tokens.reshape(-1)
    padding = None
    if vocab_size is not None and start + local_vocab > vocab_size:
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        rows = rows.masked_fill(padding, float("-inf"))
    row_max = rows.max(dim=-1).values
    all_reduce(row_max, "max", group=group)
    shifted = rows - row_max.unsqueeze(-1)
    owned = (tokens >= start) & (tokens < start + local_vocab)
    local_tokens = (tokens - start).masked_fill(~owned, 0)
    token_logit = shifted.gather(1, local_tokens.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    return shifted, local_tokens, owned, token_logit, padding


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-parallel logits.

    Forward: all-reduce (max) of each row's largest logit, then one all-reduce (sum) of each row's target logit
    and sum of exponentials. Backward: no communication (softmax minus the one-hot target, on this rank's
    columns).
    """

    @staticmethod
    def forward(ctx, logits, target, group: Group, ignore_index: int, vocab_size: int | None):
        shifted, local_target, owned, target_logit, _ = shifted_vocab_parallel_rows(
            logits, target, group=group, vocab_size=vocab_size
        )
        target = target.reshape(-1)
        exp = shifted.exp()
        stats = torch.stack([target_logit, exp.sum(dim=-1)])
        all_reduce(stats, "sum", group=group)
        target_logit, sum_exp = stats
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, owned & ~ignored, ignored)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss.view(ctx.logits_shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, hit, ignored = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= hit.to(grad.dtype)
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        grad.mul_(scale.unsqueeze(-1))
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: Group,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    reduction: str = "mean",
    check: bool = False,
) -> torch.Tensor:
    """Cross-entropy of logits split over the vocabulary, equal to ``F.cross_entropy`` of the gathered logits.

    Rank ``r`` of ``group`` holds vocabulary columns ``[r * V, (r + 1) * V)`` with ``V = local_logits.shape[-1]``
    (the same on every rank), as a `ColumnParallelLinear` output layer produces them. The full logits are never
    gathered: per token row, one all-reduce (max) and one all-reduce (sum) of two numbers. Computed in float32.

    Args:
        local_logits: ``(..., V)`` this rank's columns of the logits.
        target: ``(...)`` class indices in ``[0, vocab_size)``, or ``ignore_index``; the same on every rank.
        group: the group the vocabulary is split over, e.g. ``mesh.group("tp")``.
        ignore_index: target value that contributes neither loss nor gradient. Default ``-100``.
        vocab_size: the true vocabulary size when the columns are padded (columns from ``vocab_size`` on are
            excluded); ``None``: every column is a class. Default ``None``.
        reduction: ``"mean"`` over the targets that are not ignored (NaN if all are), ``"sum"`` or ``"none"``.
        check: first check that every rank holds the same targets, each in the vocabulary or ``ignore_index``
            (`check_tokens`: one small exchange; a caller's first call, say); always under ``COLO_DEBUG_CHECKS=1``.
            Default ``False``.

    Returns:
        The loss, in ``local_logits``' dtype: a scalar, or one value per target with ``reduction="none"``.

    Raises:
        IndexError: (when checked) a target outside ``[0, vocab_size)`` that is not ``ignore_index``, as
            ``F.cross_entropy`` raises in one process. ValueError: (when checked) the ranks' targets differ.
    """
    if not isinstance(group, Group):
        raise TypeError(f"vocab_parallel_cross_entropy: group must be a colo.comm.Group, not {type(group).__name__}")
    if local_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: local_logits {tuple(local_logits.shape)} and target "
            f"{tuple(target.shape)} must agree on every dimension but the last (the vocabulary)"
        )
    if local_logits.dim() == 0 or local_logits.shape[-1] == 0:
        raise ValueError(
            f"vocab_parallel_cross_entropy: local_logits of shape {tuple(local_logits.shape)} hold no vocabulary "
            "columns; every rank needs at least one (pad the vocabulary to a multiple of the group size)"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    if not torch.compiler.is_compiling() and (check or debug_checks()):  # (compiled: checked by the eager calls)
        num_classes = vocab_size if vocab_size is not None else local_logits.shape[-1] * group.size
        check_tokens(
            target,
            group=group,
            num_classes=num_classes,
            what="vocab_parallel_cross_entropy: target",
            ignore_index=ignore_index,
        )
    losses = VocabParallelCrossEntropy.apply(local_logits, target, group, ignore_index, vocab_size)
    if reduction == "none":
        return losses.to(local_logits.dtype)
    total = losses.sum()
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total.to(local_logits.dtype)
