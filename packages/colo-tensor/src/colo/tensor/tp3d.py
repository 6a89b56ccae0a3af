"""3D tensor parallelism on a q x q x q cube (Bian et al., 2021, https://arxiv.org/abs/2105.14450), in the
all-gather / reduce-scatter form, on the mesh axes ``tp_dep``, ``tp_row``, ``tp_col`` (`colo.tensor.grid_mesh`).

Roles of the axes. The batch is split over ``tp_col`` everywhere; the sequence and the hidden dim over ``tp_dep``
and ``tp_row``, which swap at every linear:

- layout ``A`` (a block's input, the residual stream, the norms): batch over ``tp_col``, sequence over ``tp_row``,
  hidden over ``tp_dep``;
- layout ``B`` (between a block's two linears: q/k/v and the MLP's inner activation): batch over ``tp_col``,
  sequence over ``tp_dep``, hidden (heads) over ``tp_row``.

`Linear3D` with ``in_axis="tp_dep"`` maps layout A to B, with ``in_axis="tp_row"`` B to A. On rank ``(a, b, c)``
it all-gathers the input's sequence over the output axis, all-gathers its weight block over ``tp_col`` (each rank
stores 1/q of it), multiplies, and reduce-scatters the partial products (summed over the input axis) onto the
sequence; backward is the adjoint of each step (`all_gather_reduce_scatter` and `reduce_scatter_all_gather`). So the
sequence must divide by q (the batch may be odd). A weight ``(out, in)``: ``in`` over the input axis, ``out`` over
the output axis and, nested inside, over ``tp_col``; a bias ``out`` over the output axis.

Attention (`attention_3d`): the q/k/v projections leave layout B, i.e. heads over ``tp_row`` and the sequence over
``tp_dep``; keys and values are all-gathered over ``tp_dep`` (reduce-scattered in backward) and each rank attends
with its own queries under a causal mask offset to their positions. Grouped-query attention: q must divide
``num_kv_heads`` (query heads block ``b`` use kv heads block ``b``). ``o_proj`` then maps B back to A.

Communication per linear, forward + backward: three all-gathers and three reduce-scatters of ``tokens x in / q^2``,
``tokens x out / q^2`` and ``out x in / q^2`` elements (`colo.tensor.tp_cost.linear_3d` has them exactly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Group, Mesh, all_reduce

from .comm_ops import all_gather_reduce_scatter, all_reduce_copy, copy_all_reduce, reduce_scatter_all_gather
from .layers import _linear_init
from .layout import Layout, set_layout
from .placement import Shard
from .tp2d import _check_features, _load, _param, sum_over_group
from .tp_grid import check_grid_divides
from .vocab_parallel import vocab_parallel_cross_entropy

BATCH_AXIS = "tp_col"
HIDDEN_AXES = ("tp_dep", "tp_row")
LAYOUTS = {"A": ("tp_row", "tp_dep"), "B": ("tp_dep", "tp_row")}
"""Layout name -> (sequence axis, hidden axis)."""


def _cube(mesh: Mesh, where: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be a colo.comm.Mesh, not {type(mesh).__name__}")
    missing = [a for a in (*HIDDEN_AXES, BATCH_AXIS) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{where}: the mesh has axes {mesh.axis_names} but 3D layers need 'tp_dep', 'tp_row' and 'tp_col'; "
            "build it with colo.tensor.grid_mesh('3d', tp)"
        )
    sizes = {mesh.size(a) for a in (*HIDDEN_AXES, BATCH_AXIS)}
    if len(sizes) != 1:
        raise ValueError(f"{where}: tp_dep, tp_row and tp_col must have one size (a cube), got {mesh.shape}")
    return sizes.pop()


def _other(axis: str) -> str:
    if axis not in HIDDEN_AXES:
        raise ValueError(f"the hidden axis must be one of {HIDDEN_AXES}, not {axis!r}")
    return HIDDEN_AXES[1 - HIDDEN_AXES.index(axis)]


def activation_layout_3d(mesh: Mesh, global_shape, layout: str = "A", *, hidden_split: bool = True) -> Layout:
    """The 3D layout ``"A"`` or ``"B"`` of ``(batch, seq, ..., hidden)`` (``hidden_split=False``: ids, labels)."""
    if layout not in LAYOUTS:
        raise ValueError(f"activation_layout_3d: layout={layout!r}; use 'A' or 'B'")
    sequence_axis, hidden_axis = LAYOUTS[layout]
    placements = {BATCH_AXIS: Shard(0), sequence_axis: Shard(1)}
    if hidden_split:
        placements[hidden_axis] = Shard(len(global_shape) - 1)
    return Layout(mesh, placements, global_shape)


def shard_3d(x: torch.Tensor, mesh: Mesh, layout: str = "A", *, hidden_split: bool = False) -> torch.Tensor:
    """This rank's piece of a replicated ``x`` under layout ``"A"`` / ``"B"``; no communication (for data)."""
    placed = activation_layout_3d(mesh, x.shape, layout, hidden_split=hidden_split)
    return set_layout(placed.local_slice(x).contiguous(), placed)


class Linear3D(nn.Module):
    """``y = x W^T + b`` on a q x q x q cube (module docstring: layouts and collectives).

    Args:
        in_features: input size; must divide by q.
        out_features: output size; must divide by q^2 (``out / q`` is split again over ``tp_col``).
        mesh: a 3D mesh (`colo.tensor.grid_mesh("3d", tp)`).
        in_axis: the axis the input's hidden dim is split over: ``"tp_dep"`` (layout A -> B, the default) or
            ``"tp_row"`` (B -> A).
        bias: add a bias (its gradient summed over the input and batch axes). Default ``True``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        in_axis: str = "tp_dep",
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        where = "Linear3D"
        self.q = q = _cube(mesh, where)
        self.in_axis, self.out_axis = in_axis, _other(in_axis)
        check_grid_divides(in_features, q, "in_features", "3D", where)
        check_grid_divides(out_features, q * q, "out_features", "3D", where)
        self.in_features, self.out_features, self.mesh = in_features, out_features, mesh
        placements = {self.out_axis: Shard(0), BATCH_AXIS: Shard(0), self.in_axis: Shard(1)}
        local = torch.empty(out_features // (q * q), in_features // q, device=device, dtype=dtype)
        self.weight = _param(local, mesh, placements, (out_features, in_features))
        if bias:
            local_bias = torch.empty(out_features // q, device=device, dtype=dtype)
            self.bias = _param(local_bias, mesh, {self.out_axis: Shard(0)}, (out_features,))
        else:
            self.register_parameter("bias", None)
        if not self.weight.is_meta:
            weight, full_bias = _linear_init(out_features, in_features, bias, self.weight.device, self.weight.dtype)
            self.load_full(weight, full_bias)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's pieces of full weights in."""
        self.weight = _load(self.weight, weight)
        if self.bias is not None and bias is not None:
            self.bias = _load(self.bias, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, mesh: Mesh, in_axis: str = "tp_dep") -> Linear3D:
        """The 3D layer holding this rank's pieces of ``linear``'s weight and bias."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Linear3D.from_linear: expected a torch.nn.Linear, not {type(linear).__name__}")
        layer = cls(
            linear.in_features,
            linear.out_features,
            mesh=mesh,
            in_axis=in_axis,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        layer.load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch_c, seq / q, ..., in / q)`` with the sequence over the output axis. Returns
        ``(batch_c, seq / q, ..., out / q)`` with the sequence over the input axis."""
        _check_features(x, self.weight, 1, f"in_features={self.in_features}", "Linear3D")
        if x.dim() < 3:
            raise ValueError(f"Linear3D: the input must be (batch, seq, ..., features), got {tuple(x.shape)}")
        mesh = self.mesh
        x_full = all_gather_reduce_scatter(x, group=mesh.group(self.out_axis), dim=1)
        weight = all_gather_reduce_scatter(self.weight, group=mesh.group(BATCH_AXIS), dim=0)
        partial = F.linear(x_full, weight)
        y = reduce_scatter_all_gather(partial, group=mesh.group(self.in_axis), dim=1)
        if self.bias is not None:
            y = y + copy_all_reduce(self.bias, group=mesh.group(self.in_axis, BATCH_AXIS))
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"in_axis={self.in_axis!r}, q={self.q}"
        )


class LayerNorm3D(nn.Module):
    """``torch.nn.LayerNorm`` (``rms=False``) or an RMS norm (``rms=True``, as `colo.kernels.rms_norm`) over a
    hidden dim split over ``hidden_axis`` (layout A: ``tp_dep``): statistics all-reduced over that axis
    (`sum_over_group`), the scale's gradient over the sequence and batch axes.

    Args:
        hidden_size: the normalized dimension; must divide by q.
        mesh: a 3D mesh.
        eps: added to the variance / mean square. Default ``1e-5``.
        rms: RMS norm without shift instead of LayerNorm. Default ``False``.
        hidden_axis: ``"tp_dep"`` (layout A, the default) or ``"tp_row"`` (layout B).
    """

    def __init__(
        self, hidden_size: int, *, mesh: Mesh, eps: float = 1e-5, rms: bool = False, hidden_axis: str = "tp_dep"
    ):
        super().__init__()
        self.q = q = _cube(mesh, "LayerNorm3D")
        check_grid_divides(hidden_size, q, "hidden_size", "3D", "LayerNorm3D")
        self.hidden_size, self.eps, self.rms, self.mesh = hidden_size, eps, rms, mesh
        self.hidden_axis = hidden_axis
        self.replica_axes = (_other(hidden_axis), BATCH_AXIS)
        placements = {hidden_axis: Shard(0)}
        self.weight = _param(torch.ones(hidden_size // q), mesh, placements, (hidden_size,))
        if rms:
            self.register_parameter("bias", None)
        else:
            self.bias = _param(torch.zeros(hidden_size // q), mesh, placements, (hidden_size,))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's pieces of the full scale (and shift) in."""
        self.weight = _load(self.weight, weight)
        if self.bias is not None and bias is not None:
            self.bias = _load(self.bias, bias)

    @classmethod
    def from_norm(cls, norm: nn.Module, *, mesh: Mesh) -> LayerNorm3D:
        """The 3D norm of an ``nn.LayerNorm`` or of an RMS norm (a module with a 1-dim ``weight`` and ``eps``)."""
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not hasattr(norm, "eps"):
            raise TypeError(
                f"LayerNorm3D.from_norm: expected a LayerNorm or an RMS norm with a 1-dim weight, got {norm!r}"
            )
        rms = not isinstance(norm, nn.LayerNorm)
        layer = cls(weight.shape[0], mesh=mesh, eps=norm.eps, rms=rms)
        layer.load_full(weight.detach(), None if rms else norm.bias.detach())
        return layer

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x``: ``(batch_c, seq / q, ..., hidden / q)``; returns the same shape. With ``residual`` (RMS only) it
        normalizes ``h = x + residual`` and returns ``(normalized, h)``, as `colo.kernels.rms_norm` does."""
        _check_features(x, self.weight, 0, f"hidden_size={self.hidden_size}", "LayerNorm3D")
        group = self.mesh.group(self.hidden_axis)
        replicas = self.mesh.group(*self.replica_axes)
        weight = copy_all_reduce(self.weight, group=replicas)
        if self.rms:
            h = x if residual is None else x + residual
            h32 = h.float()
            square = sum_over_group((h32 * h32).sum(-1, keepdim=True), group=group) / self.hidden_size
            y = (h32 * torch.rsqrt(square + self.eps) * weight.float()).to(x.dtype)
            return y if residual is None else (y, h)
        if residual is not None:
            raise ValueError("LayerNorm3D: residual= is supported for the RMS norm only")
        mean = sum_over_group(x.sum(-1, keepdim=True), group=group) / self.hidden_size
        centered = x - mean
        var = sum_over_group((centered * centered).sum(-1, keepdim=True), group=group) / self.hidden_size
        return centered * torch.rsqrt(var + self.eps) * weight + copy_all_reduce(self.bias, group=replicas)


class Embedding3D(nn.Module):
    """``torch.nn.Embedding`` into layout A: each rank looks up its batch rows (``tp_col``) and sequence piece
    (``tp_row``) in its hidden block (``tp_dep``); the weight gradient is all-reduced over ``tp_row`` and ``tp_col``.

    Input: the full ``(batch, seq)`` ids; output ``(batch_c, seq / q, hidden / q)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mesh: Mesh):
        super().__init__()
        self.q = q = _cube(mesh, "Embedding3D")
        check_grid_divides(embedding_dim, q, "embedding_dim", "3D", "Embedding3D")
        self.num_embeddings, self.embedding_dim, self.mesh = num_embeddings, embedding_dim, mesh
        local = torch.empty(num_embeddings, embedding_dim // q)
        self.weight = _param(local, mesh, {"tp_dep": Shard(1)}, (num_embeddings, embedding_dim))
        self.load_full(torch.randn(num_embeddings, embedding_dim))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's block of the full weight in."""
        self.weight = _load(self.weight, weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: the full ``(batch, seq)``; the sequence must divide by q."""
        if ids.shape[1] % self.q:
            raise ValueError(f"Embedding3D: seq={ids.shape[1]} must divide by q={self.q} (3D splits the sequence)")
        own = shard_3d(ids, self.mesh, "A")
        return F.embedding(own, copy_all_reduce(self.weight, group=self.mesh.group("tp_row", BATCH_AXIS)))


class VocabParallelEmbedding3D(nn.Module):
    """An embedding with the vocabulary over ``tp_row`` x ``tp_col`` (q^2 blocks) and the hidden dim over ``tp_dep``,
    into layout A. Each rank looks every token up in its vocabulary block (zeros elsewhere); the partial lookups,
    arranged so that block ``r = b q + c`` is batch piece ``c`` and sequence piece ``b``, are reduce-scattered over
    the q^2 ranks of ``tp_row`` x ``tp_col`` (their gradient all-gathered in backward: `reduce_scatter_all_gather`).

    Args:
        num_embeddings: vocabulary size; must divide by q^2.
        embedding_dim: hidden size; must divide by q.
        mesh: a 3D mesh.

    Input: the full ``(batch, seq)`` ids, both divisible by q; output ``(batch / q, seq / q, hidden / q)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mesh: Mesh):
        super().__init__()
        where = "VocabParallelEmbedding3D"
        self.q = q = _cube(mesh, where)
        check_grid_divides(embedding_dim, q, "embedding_dim", "3D", where)
        check_grid_divides(num_embeddings, q * q, "num_embeddings", "3D", where)
        self.num_embeddings, self.embedding_dim, self.mesh = num_embeddings, embedding_dim, mesh
        self.group = mesh.group("tp_row", BATCH_AXIS)
        rows = num_embeddings // (q * q)
        self.vocab_start = self.group.rank * rows
        placements = {"tp_row": Shard(0), BATCH_AXIS: Shard(0), "tp_dep": Shard(1)}
        self.weight = _param(torch.empty(rows, embedding_dim // q), mesh, placements, (num_embeddings, embedding_dim))
        self.load_full(torch.randn(num_embeddings, embedding_dim))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's block of the full weight in."""
        self.weight = _load(self.weight, weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: the full ``(batch, seq)``. Returns layout A ``(batch / q, seq / q, hidden / q)``."""
        q, (batch, seq) = self.q, ids.shape
        if batch % q or seq % q:
            raise ValueError(
                f"VocabParallelEmbedding3D: batch={batch} and seq={seq} must divide by q={q}; use Embedding3D for "
                "any batch"
            )
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        partial = F.embedding(local.masked_fill(~owned, 0), self.weight) * owned.unsqueeze(-1)
        width = partial.shape[-1]
        # block r = b * q + c of the fused (tp_row, tp_col) group gets batch piece c and sequence piece b
        blocks = partial.view(q, batch // q, q, seq // q, width).permute(2, 0, 1, 3, 4)
        blocks = blocks.reshape(q * q, batch // q, seq // q, width)
        return reduce_scatter_all_gather(blocks, group=self.group, dim=0).squeeze(0)


def attention_3d(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Mesh, causal: bool = True, scale: float | None = None
):
    """Scaled dot-product attention of layout-B heads: ``q`` ``(batch_c, seq / q, heads / q, head_dim)`` (this
    rank's queries), ``k`` / ``v`` ``(batch_c, seq / q, kv_heads / q, head_dim)``. Keys and values are all-gathered
    over ``tp_dep`` (their gradients reduce-scattered); the causal mask is offset to this rank's query positions.
    Returns ``(batch_c, seq / q, heads / q, head_dim)``."""
    group: Group = mesh.group("tp_dep")
    k = all_gather_reduce_scatter(k, group=group, dim=1)
    v = all_gather_reduce_scatter(v, group=group, dim=1)
    repeat = q.shape[2] // k.shape[2]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    mask = None
    if causal:
        start = group.rank * q.shape[1]
        rows = torch.arange(start, start + q.shape[1], device=q.device)
        mask = rows.unsqueeze(1) >= torch.arange(k.shape[1], device=q.device).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def cross_entropy_3d(local_logits: torch.Tensor, target: torch.Tensor, *, mesh: Mesh, ignore_index: int = -100):
    """Mean cross-entropy of layout-B logits (vocabulary over ``tp_row``; batch over ``tp_col``, sequence over
    ``tp_dep``) against this rank's targets (`shard_3d(target, mesh, "B")`): the vocabulary-parallel cross-entropy
    over ``tp_row``, then the loss sum and the target count all-reduced over ``tp_dep`` and ``tp_col``."""
    _cube(mesh, "cross_entropy_3d")
    total = vocab_parallel_cross_entropy(
        local_logits, target, group=mesh.group("tp_row"), ignore_index=ignore_index, reduction="sum"
    )
    others = mesh.group("tp_dep", BATCH_AXIS)
    total = all_reduce_copy(total.float().reshape(1), group=others)
    count = all_reduce((target != ignore_index).sum().float().reshape(1), group=others)
    return (total / count.clamp(min=1)).reshape(()).to(local_logits.dtype)


class QKVLinear3D(nn.Module):
    """A fused, bias-free q/k/v projection (output rows: q heads, k heads, v heads) on the cube, layout A -> B, by
    heads: three weights with exact 3D layouts (as `Linear3D` with ``in_axis="tp_dep"``), gathered over ``tp_col``
    in one all-gather and reordered locally so rank ``(a, b, c)``'s output is ``[q | k | v]`` of heads block ``b``.
    q must divide ``num_kv_heads``; ``heads * head_dim`` must divide by q^2.

    Args:
        hidden_size: input size; must divide by q.
        num_heads, num_kv_heads, head_dim: the attention's shape.
        mesh: a 3D mesh.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, mesh: Mesh):
        super().__init__()
        where = "QKVLinear3D"
        self.q = q = _cube(mesh, where)
        check_grid_divides(hidden_size, q, "hidden_size", "3D", where)
        check_grid_divides(num_heads, q, "num_heads", "3D", where)
        check_grid_divides(num_kv_heads, q, "num_kv_heads", "3D", where)
        for name, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            check_grid_divides(heads * head_dim, q * q, f"{name} * head_dim", "3D", where)
        self.hidden_size, self.head_dim, self.mesh = hidden_size, head_dim, mesh
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_num_heads, self.local_num_kv_heads = num_heads // q, num_kv_heads // q
        placements = {"tp_row": Shard(0), BATCH_AXIS: Shard(0), "tp_dep": Shard(1)}
        for name, heads in (("q_weight", num_heads), ("k_weight", num_kv_heads), ("v_weight", num_kv_heads)):
            local = torch.empty(heads * head_dim // (q * q), hidden_size // q)
            setattr(self, name, _param(local, mesh, placements, (heads * head_dim, hidden_size)))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's pieces of the fused ``(q + 2 kv) * head_dim x hidden`` weight in."""
        rows = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        q, k, v = weight.split(rows)
        self.q_weight, self.k_weight, self.v_weight = (
            _load(self.q_weight, q),
            _load(self.k_weight, k),
            _load(self.v_weight, v),
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, num_heads: int, num_kv_heads: int, mesh: Mesh) -> QKVLinear3D:
        """The 3D projection holding this rank's pieces of a fused, bias-free ``linear``."""
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise TypeError(f"QKVLinear3D.from_linear: expected a bias-free torch.nn.Linear, got {linear!r}")
        head_dim = linear.out_features // (num_heads + 2 * num_kv_heads)
        layer = cls(linear.in_features, num_heads, num_kv_heads, head_dim, mesh=mesh)
        layer.load_full(linear.weight.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: layout A ``(batch_c, seq / q, hidden / q)``. Returns layout B ``(batch_c, seq / q, (heads + 2
        kv_heads) / q * head_dim)``."""
        _check_features(x, self.q_weight, 1, f"hidden_size={self.hidden_size}", "QKVLinear3D")
        mesh, q = self.mesh, self.q
        sizes = [self.q_weight.shape[0], self.k_weight.shape[0], self.v_weight.shape[0]]
        local = torch.cat([self.q_weight, self.k_weight, self.v_weight])
        gathered = all_gather_reduce_scatter(local, group=mesh.group(BATCH_AXIS), dim=0)
        parts = gathered.view(q, sum(sizes), -1).split(sizes, dim=1)  # per tp_col piece: [q | k | v] rows
        weight = torch.cat([part.reshape(-1, part.shape[-1]) for part in parts])
        x_full = all_gather_reduce_scatter(x, group=mesh.group("tp_row"), dim=1)
        return reduce_scatter_all_gather(F.linear(x_full, weight), group=mesh.group("tp_dep"), dim=1)


class AttentionCore3D(nn.Module):
    """An attention core (``core(q, k, v)`` over ``(batch, seq, heads, head_dim)``, as colo's Llama calls it) for
    layout-B heads: `attention_3d` (keys and values all-gathered over ``tp_dep``, causal mask offset to this rank's
    queries). Document masks are not supported.

    Args:
        mesh: a 3D mesh.
        causal: causal attention. Default ``True``.
        scale: score scale; ``None``: ``1 / sqrt(head_dim)``.
    """

    def __init__(self, *, mesh: Mesh, causal: bool = True, scale: float | None = None):
        super().__init__()
        _cube(mesh, "AttentionCore3D")
        self.mesh, self.causal, self.scale = mesh, causal, scale

    def forward(self, q, k, v, *, document_ids=None):
        if document_ids is not None:
            raise ValueError("AttentionCore3D: document masks (packed rows) are not supported under 3D")
        return attention_3d(q, k, v, mesh=self.mesh, causal=self.causal, scale=self.scale)
