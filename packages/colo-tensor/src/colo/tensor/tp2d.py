"""2D tensor parallelism on a q x q grid (SUMMA / Optimus), and 2.5D (Tesseract) as d stacked grids.

Optimus (Xu et al., 2021, https://arxiv.org/abs/2104.05343) runs every linear of a transformer as SUMMA (van de
Geijn & Watts, 1997) on a q x q grid of ranks; Tesseract (Wang et al., 2021, https://arxiv.org/abs/2105.14500)
stacks d such grids that share the weights and split the batch further. Here 2.5D is this module's layers on a
mesh with a ``tp_dep`` axis (`colo.tensor.tp25d`), and d = 1 is 2D exactly.

Layouts (rank ``(i, j)`` = coordinates on ``tp_row`` / ``tp_col``, see `colo.tensor.tp_grid`):

- Activations ``(batch, seq, hidden)``: batch `Shard` over ``tp_row`` (2.5D: over ``tp_dep`` then ``tp_row``,
  nested), hidden `Shard` over ``tp_col``; the sequence is whole. Odd batches split as ``torch.chunk`` does.
- A linear's weight ``(out, in)``: ``in`` `Shard` over ``tp_row``, ``out`` `Shard` over ``tp_col`` (rank
  ``(i, j)`` holds block ``(i, j)`` of ``A = W^T``), replicated over ``tp_dep``; its bias ``out`` over ``tp_col``.
- Norm scales ``(hidden,)`` and a hidden-split embedding ``(vocab, hidden)``: hidden over ``tp_col``.
- Vocabulary-parallel embedding ``(vocab, hidden)``: vocabulary over the batch axes, hidden over ``tp_col``.
- Logits ``(batch, seq, vocab)``: batch over the batch axes, vocabulary over ``tp_col``.

Attention: batch over ``tp_row`` (and ``tp_dep``), heads over ``tp_col``. The q, k and v projections are separate
`Linear2D` layers, so column block ``j`` of their outputs is heads block ``j``; attention then runs locally on
``num_heads / q`` query heads and ``num_kv_heads / q`` kv heads, and ``o_proj`` takes that block as its input
block ``j``. Grouped-query attention needs q to divide ``num_kv_heads`` (and so ``num_heads``): query heads
block ``j`` are exactly the queries of kv heads block ``j``.

Communication (per layer, forward + backward; `colo.tensor.tp_cost` gives the bytes and calls exactly):

- `Linear2D` forward: q steps, each a broadcast of ``X[i, k]`` along the grid row and of ``W[k, j]`` along the grid
  column; step k + 1's broadcasts are in flight while step k multiplies (async handles). Backward: the same 2q
  broadcasts (re-sent, not kept: SUMMA's memory bound), then one reduce-scatter along the row for the input
  gradient and one along the column for the weight gradient (+ an all-reduce over ``tp_dep`` in 2.5D). A bias
  all-reduces its gradient over the batch axes.
- Norms: all-reduces of per-row statistics over the grid row (LayerNorm two, RMSNorm one, each way), and their
  scales' gradients over the batch axes.
- Cross-entropy: the vocabulary-parallel one (`vocab_parallel_cross_entropy`) over the grid row, then the loss
  sum over the batch axes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Group, Mesh, all_reduce, broadcast, reduce_scatter

from .comm_ops import all_reduce_copy, copy_all_reduce, reduce_scatter_all_gather
from .layers import _linear_init, _refill
from .layout import Layout, layout_of, set_layout
from .placement import Shard
from .tp_grid import Grid, check_grid_divides
from .vocab_parallel import vocab_parallel_cross_entropy


def _bcast(tensor: torch.Tensor, src: int, group: Group, mine: bool):
    """Start a broadcast of ``tensor`` (this rank's when ``mine``, else a buffer) from group rank ``src``."""
    buffer = tensor if mine else torch.empty_like(tensor)
    return broadcast(buffer, src=src, group=group, async_op=True)


class SummaLinear(torch.autograd.Function):
    """``y = x W^T`` on a q x q grid by SUMMA: rank ``(i, j)`` holds ``x[i, j]`` and ``W^T[i, j]``.

    Forward: for k = 0..q-1, broadcast ``x[i, k]`` along the grid row (``tp_col`` axis, from column k) and
    ``W^T[k, j]`` along the grid column (``tp_row`` axis, from row k), each step's broadcasts overlapped with the
    previous step's matmul; ``y[i, j] = sum_k x[i, k] W^T[k, j]``.
    Backward: the same 2q broadcasts; the input gradient's q partial blocks are reduce-scattered along the grid row
    and the weight gradient's along the grid column (then all-reduced over ``tp_dep`` in 2.5D).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, grid: Grid) -> torch.Tensor:
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        weight = weight.contiguous()
        out = rows.new_zeros(rows.shape[0], weight.shape[0])
        for x_k, w_k in _summa_steps(rows, weight, grid):
            out.addmm_(x_k, w_k.t())
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grid: Grid = ctx.grid
        q, width = grid.q, x.shape[-1]
        rows = x.reshape(-1, width).contiguous()
        grad_rows = grad.reshape(-1, weight.shape[0]).contiguous()
        grad_x_parts = rows.new_empty(rows.shape[0], q * width)
        grad_w_parts = weight.new_empty(weight.shape[0], q * width)
        for k, (x_k, w_k) in enumerate(_summa_steps(rows, weight.contiguous(), grid)):
            grad_x_parts[:, k * width : (k + 1) * width] = grad_rows @ w_k
            grad_w_parts[:, k * width : (k + 1) * width] = grad_rows.t() @ x_k
        grad_x = reduce_scatter(grad_x_parts, group=grid.row_group, dim=1).contiguous()
        grad_w = reduce_scatter(grad_w_parts, group=grid.col_group, dim=1).contiguous()
        if grid.depth > 1:
            all_reduce(grad_w, group=grid.depth_group)
        return grad_x.view(x.shape), grad_w, None


def _summa_steps(rows: torch.Tensor, weight: torch.Tensor, grid: Grid):
    """Yield ``(x[i, k], W^T[k, j] as (out/q, in/q))`` for k = 0..q-1, step k + 1's broadcasts already posted."""
    q, row_group, col_group = grid.q, grid.row_group, grid.col_group

    def post(k: int):
        return _bcast(rows, k, row_group, grid.col == k), _bcast(weight, k, col_group, grid.row == k)

    pending = post(0)
    for k in range(q):
        x_handle, w_handle = pending
        if k + 1 < q:
            pending = post(k + 1)
        yield x_handle.wait(), w_handle.wait()


class SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group, every rank using the sum. Backward: all-reduce (sum) of the
    gradient (each rank's input reached every rank's output). Used for statistics over a split hidden dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x.clone(memory_format=torch.contiguous_format), group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), group=ctx.group), None


def sum_over_group(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward and backward (`SumOverGroup`)."""
    return SumOverGroup.apply(x, group)


# --- layouts ---------------------------------------------------------------------------------------------------


def activation_layout(mesh: Mesh, global_shape, *, hidden_split: bool = True) -> Layout:
    """The 2D / 2.5D layout of an activation ``(batch, ..., hidden)``: batch over the batch axes, hidden over
    ``tp_col`` (``hidden_split=False``: whole, e.g. token ids or per-token losses)."""
    grid = Grid.of(mesh, "activation_layout")
    placements = {axis: Shard(0) for axis in grid.batch_axes}
    if hidden_split:
        placements["tp_col"] = Shard(len(global_shape) - 1)
    return Layout(mesh, placements, global_shape)


def shard_batch(x: torch.Tensor, mesh: Mesh, *, hidden_split: bool = False) -> torch.Tensor:
    """This rank's rows of a replicated ``x`` (and its hidden block with ``hidden_split``); no communication, no
    gradient to other ranks (for data: token ids, labels, or a test's input)."""
    layout = activation_layout(mesh, x.shape, hidden_split=hidden_split)
    return set_layout(layout.local_slice(x).contiguous(), layout)


def _param(local: torch.Tensor, mesh: Mesh, placements: dict, global_shape) -> nn.Parameter:
    return set_layout(nn.Parameter(local), Layout(mesh, placements, global_shape))


def _load(param: nn.Parameter, full: torch.Tensor) -> nn.Parameter:
    """``param`` (meta or not) holding its layout's slice of ``full``."""
    return _refill(param, layout_of(param).local_slice(full))


def _check_features(x: torch.Tensor, param: torch.Tensor, dim: int, name: str, where: str) -> None:
    if x.shape[-1] != param.shape[dim]:
        raise ValueError(
            f"{where}: the input has {x.shape[-1]} features but this rank holds {param.shape[dim]} of {name}; pass "
            "this rank's block (colo.tensor.tp2d.shard_batch(x, mesh, hidden_split=True))"
        )


# --- layers ----------------------------------------------------------------------------------------------------


class Linear2D(nn.Module):
    """``y = x W^T + b`` on a 2D (or 2.5D) grid by SUMMA (`SummaLinear`).

    Args:
        in_features: input size; must divide by q.
        out_features: output size; must divide by q.
        mesh: a mesh with ``tp_row`` / ``tp_col`` (and ``tp_dep``) axes (`colo.tensor.grid_mesh`).
        bias: add a bias (``out`` over ``tp_col``, its gradient summed over the batch axes). Default ``True``.
        device: where to create the parameters (``"meta"``: no memory, no initialisation).
        dtype: parameter dtype.

    Input ``(batch_i, ..., in / q)``; output ``(batch_i, ..., out / q)`` (module docstring: layouts).
    """

    def __init__(self, in_features: int, out_features: int, *, mesh: Mesh, bias: bool = True, device=None, dtype=None):
        super().__init__()
        where = type(self).__name__
        self.grid = grid = Grid.of(mesh, where)
        check_grid_divides(in_features, grid.q, "in_features", "2D", where)
        check_grid_divides(out_features, grid.q, "out_features", "2D", where)
        self.in_features, self.out_features, self.mesh = in_features, out_features, mesh
        local = torch.empty(out_features // grid.q, in_features // grid.q, device=device, dtype=dtype)
        placements = {"tp_row": Shard(1), "tp_col": Shard(0)}
        self.weight = _param(local, mesh, placements, (out_features, in_features))
        if bias:
            local_bias = torch.empty(out_features // grid.q, device=device, dtype=dtype)
            self.bias = _param(local_bias, mesh, {"tp_col": Shard(0)}, (out_features,))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the full weights as ``nn.Linear`` does and keep this rank's blocks (nothing on the meta device)."""
        if self.weight.is_meta:
            return
        weight, bias = _linear_init(
            self.out_features, self.in_features, self.bias is not None, self.weight.device, self.weight.dtype
        )
        self.load_full(weight, bias)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's blocks of full weights in (the same full tensors on every rank)."""
        self.weight = _load(self.weight, weight)
        if self.bias is not None and bias is not None:
            self.bias = _load(self.bias, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, mesh: Mesh) -> Linear2D:
        """The 2D layer holding this rank's blocks of ``linear``'s weight and bias."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear: expected a torch.nn.Linear, not {type(linear).__name__}")
        layer = cls(
            linear.in_features,
            linear.out_features,
            mesh=mesh,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        layer.load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch_i, ..., in / q)``. Returns ``(batch_i, ..., out / q)``."""
        _check_features(x, self.weight, 1, f"in_features={self.in_features}", type(self).__name__)
        y = SummaLinear.apply(x, self.weight, self.grid)
        if self.bias is not None:
            y = y + copy_all_reduce(self.bias, group=self.grid.batch_group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"q={self.grid.q}, depth={self.grid.depth}"
        )


class QKVLinear2D(nn.Module):
    """A fused q/k/v projection (output rows: q heads, k heads, v heads) on a 2D / 2.5D grid, by heads.

    Three weights with exact 2D layouts (``(num_heads * head_dim, hidden)`` and twice ``(num_kv_heads *
    head_dim, hidden)``, each ``in`` over ``tp_row`` and ``out`` over ``tp_col``), concatenated locally into one
    SUMMA (`SummaLinear`): rank ``(i, j)``'s output block is ``[q | k | v]`` of heads block ``j``, so attention
    runs on ``num_heads / q`` and ``num_kv_heads / q`` local heads. Grouped-query attention: q must divide
    ``num_kv_heads`` (the kv heads of query heads block ``j`` are kv heads block ``j``); fewer kv heads than q
    (1D's replicated kv weights) is not supported here.

    Args:
        hidden_size: input size; must divide by q.
        num_heads: query heads; must divide by q.
        num_kv_heads: key/value heads; must divide by q and divide ``num_heads``.
        head_dim: size of each head.
        mesh: a 2D / 2.5D mesh.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, mesh: Mesh, device=None, dtype=None
    ):
        super().__init__()
        where = "QKVLinear2D"
        self.grid = grid = Grid.of(mesh, where)
        check_grid_divides(hidden_size, grid.q, "hidden_size", "2D", where)
        check_grid_divides(num_heads, grid.q, "num_heads", "2D", where)
        check_grid_divides(num_kv_heads, grid.q, "num_kv_heads", "2D", where)
        if num_heads % num_kv_heads:
            raise ValueError(f"{where}: num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        self.hidden_size, self.head_dim, self.mesh = hidden_size, head_dim, mesh
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_num_heads, self.local_num_kv_heads = num_heads // grid.q, num_kv_heads // grid.q
        placements = {"tp_row": Shard(1), "tp_col": Shard(0)}
        for name, heads in (("q_weight", num_heads), ("k_weight", num_kv_heads), ("v_weight", num_kv_heads)):
            local = torch.empty(heads * head_dim // grid.q, hidden_size // grid.q, device=device, dtype=dtype)
            setattr(self, name, _param(local, mesh, placements, (heads * head_dim, hidden_size)))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's blocks of the fused ``(q + 2 kv) * head_dim x hidden`` weight in."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = weight.split([q_rows, kv_rows, kv_rows])
        self.q_weight, self.k_weight, self.v_weight = (
            _load(self.q_weight, q),
            _load(self.k_weight, k),
            _load(self.v_weight, v),
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, num_heads: int, num_kv_heads: int, mesh: Mesh) -> QKVLinear2D:
        """The 2D projection holding this rank's blocks of a fused, bias-free ``linear``."""
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise TypeError(f"QKVLinear2D.from_linear: expected a bias-free torch.nn.Linear, got {linear!r}")
        head_dim, rest = divmod(linear.out_features, num_heads + 2 * num_kv_heads)
        if rest:
            raise ValueError(
                f"QKVLinear2D.from_linear: out_features={linear.out_features} is not (num_heads + 2 num_kv_heads) "
                f"x head_dim for num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        layer = cls(
            linear.in_features, num_heads, num_kv_heads, head_dim, mesh=mesh, device="meta", dtype=linear.weight.dtype
        )
        layer.load_full(linear.weight.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch_i, ..., hidden / q)``. Returns ``(batch_i, ..., (heads + 2 kv_heads) / q * head_dim)``."""
        _check_features(x, self.q_weight, 1, f"hidden_size={self.hidden_size}", "QKVLinear2D")
        weight = torch.cat([self.q_weight, self.k_weight, self.v_weight])
        return SummaLinear.apply(x, weight, self.grid)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, q={self.grid.q}, depth={self.grid.depth}"
        )


class _Norm2D(nn.Module):
    """What the 2D norms share: the scale (and shift) over ``tp_col``, their gradients summed over the batch axes."""

    def __init__(self, hidden_size: int, *, mesh: Mesh, eps: float, bias: bool, device=None, dtype=None):
        super().__init__()
        where = type(self).__name__
        self.grid = grid = Grid.of(mesh, where)
        check_grid_divides(hidden_size, grid.q, "hidden_size", "2D", where)
        self.hidden_size, self.eps, self.mesh = hidden_size, eps, mesh
        local = hidden_size // grid.q
        self.weight = _param(torch.ones(local, device=device, dtype=dtype), mesh, {"tp_col": Shard(0)}, (hidden_size,))
        if bias:
            zeros = torch.zeros(local, device=device, dtype=dtype)
            self.bias = _param(zeros, mesh, {"tp_col": Shard(0)}, (hidden_size,))
        else:
            self.register_parameter("bias", None)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's blocks of the full scale (and shift) in."""
        self.weight = _load(self.weight, weight)
        if self.bias is not None and bias is not None:
            self.bias = _load(self.bias, bias)

    def _affine(self, normalized: torch.Tensor) -> torch.Tensor:
        y = normalized * copy_all_reduce(self.weight, group=self.grid.batch_group)
        if self.bias is not None:
            y = y + copy_all_reduce(self.bias, group=self.grid.batch_group)
        return y

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, q={self.grid.q}, depth={self.grid.depth}"


class LayerNorm2D(_Norm2D):
    """``torch.nn.LayerNorm`` over a hidden dim split over ``tp_col``: the mean and then the variance are
    all-reduced over the grid row (`sum_over_group`, which all-reduces their gradients in backward too).

    Args:
        hidden_size: the normalized (last) dimension; must divide by q.
        mesh: a 2D / 2.5D mesh.
        eps: added to the variance. Default ``1e-5``.
        bias: learn a shift. Default ``True``.
    """

    def __init__(self, hidden_size: int, *, mesh: Mesh, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__(hidden_size, mesh=mesh, eps=eps, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm, *, mesh: Mesh) -> LayerNorm2D:
        """The 2D norm holding this rank's block of ``norm``'s scale and shift."""
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1 or norm.weight is None:
            raise TypeError(f"LayerNorm2D.from_layer_norm: expected an affine 1-dim nn.LayerNorm, got {norm!r}")
        layer = cls(norm.normalized_shape[0], mesh=mesh, eps=norm.eps, bias=norm.bias is not None)
        layer.load_full(norm.weight.detach(), None if norm.bias is None else norm.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch_i, ..., hidden / q)``; returns the same shape."""
        _check_features(x, self.weight, 0, f"hidden_size={self.hidden_size}", "LayerNorm2D")
        group = self.grid.row_group
        mean = sum_over_group(x.sum(-1, keepdim=True), group=group) / self.hidden_size
        centered = x - mean
        var = sum_over_group((centered * centered).sum(-1, keepdim=True), group=group) / self.hidden_size
        return self._affine(centered * torch.rsqrt(var + self.eps))


class RMSNorm2D(_Norm2D):
    """Root-mean-square norm over a hidden dim split over ``tp_col``, as `colo.kernels.rms_norm` computes it
    (float32, scaled, cast back); the mean square is all-reduced over the grid row (`sum_over_group`).

    Args:
        hidden_size: the normalized (last) dimension; must divide by q.
        mesh: a 2D / 2.5D mesh.
        eps: added to the mean square. Default ``1e-6``.
    """

    def __init__(self, hidden_size: int, *, mesh: Mesh, eps: float = 1e-6, device=None, dtype=None):
        super().__init__(hidden_size, mesh=mesh, eps=eps, bias=False, device=device, dtype=dtype)

    @classmethod
    def from_norm(cls, norm: nn.Module, *, mesh: Mesh) -> RMSNorm2D:
        """The 2D norm holding this rank's block of an RMS norm's ``weight`` (1-dim) with its ``eps``."""
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not hasattr(norm, "eps"):
            raise TypeError(f"RMSNorm2D.from_norm: expected an RMS norm with a 1-dim weight and eps, got {norm!r}")
        layer = cls(weight.shape[0], mesh=mesh, eps=norm.eps, device="meta", dtype=weight.dtype)
        layer.load_full(weight.detach())
        return layer

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x``: ``(batch_i, ..., hidden / q)``; returns the same shape. With ``residual`` it normalizes
        ``h = x + residual`` and returns ``(normalized, h)`` (as `colo.kernels.rms_norm`)."""
        _check_features(x, self.weight, 0, f"hidden_size={self.hidden_size}", "RMSNorm2D")
        h = x if residual is None else x + residual
        h32 = h.float()
        square = sum_over_group((h32 * h32).sum(-1, keepdim=True), group=self.grid.row_group) / self.hidden_size
        weight = copy_all_reduce(self.weight, group=self.grid.batch_group)
        y = (h32 * torch.rsqrt(square + self.eps) * weight.float()).to(x.dtype)
        return y if residual is None else (y, h)


class Embedding2D(nn.Module):
    """``torch.nn.Embedding`` with the hidden dim over ``tp_col``: each rank looks up its batch rows; no forward
    communication, the weight gradient all-reduced over the batch axes.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size; must divide by q.
        mesh: a 2D / 2.5D mesh.

    Input: the full ``(batch, seq)`` ids (every rank the same); output ``(batch_i, seq, hidden / q)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mesh: Mesh, device=None, dtype=None):
        super().__init__()
        self.grid = grid = Grid.of(mesh, "Embedding2D")
        check_grid_divides(embedding_dim, grid.q, "embedding_dim", "2D", "Embedding2D")
        self.num_embeddings, self.embedding_dim, self.mesh = num_embeddings, embedding_dim, mesh
        local = torch.empty(num_embeddings, embedding_dim // grid.q, device=device, dtype=dtype)
        self.weight = _param(local, mesh, {"tp_col": Shard(1)}, (num_embeddings, embedding_dim))
        if not self.weight.is_meta:
            self.load_full(torch.randn(num_embeddings, embedding_dim, device=device, dtype=dtype))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's block of the full weight in."""
        self.weight = _load(self.weight, weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: the full ``(batch, seq)``. Returns ``(batch_i, seq, hidden / q)``."""
        own = shard_batch(ids, self.mesh)
        return F.embedding(own, copy_all_reduce(self.weight, group=self.grid.batch_group))


class VocabParallelEmbedding2D(nn.Module):
    """An embedding with the vocabulary over the batch axes and the hidden dim over ``tp_col``.

    Each rank looks up every row's ids in its vocabulary block (zeros elsewhere), and a reduce-scatter over the
    batch axes sums the blocks and leaves each rank its batch rows; backward all-gathers the output gradient and
    accumulates into the local block (`reduce_scatter_all_gather`). The batch must divide by the batch axes' size.

    Args:
        num_embeddings: vocabulary size; must divide by the batch axes' size (q, or d q in 2.5D).
        embedding_dim: hidden size; must divide by q.
        mesh: a 2D / 2.5D mesh.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mesh: Mesh, device=None, dtype=None):
        super().__init__()
        where = "VocabParallelEmbedding2D"
        self.grid = grid = Grid.of(mesh, where)
        parts = grid.batch_group.size
        check_grid_divides(embedding_dim, grid.q, "embedding_dim", "2D", where)
        check_grid_divides(num_embeddings, parts, "num_embeddings", "2D batch-axes", where)
        self.num_embeddings, self.embedding_dim, self.mesh = num_embeddings, embedding_dim, mesh
        rows = num_embeddings // parts
        self.vocab_start = grid.batch_group.rank * rows
        local = torch.empty(rows, embedding_dim // grid.q, device=device, dtype=dtype)
        placements = {axis: Shard(0) for axis in grid.batch_axes} | {"tp_col": Shard(1)}
        self.weight = _param(local, mesh, placements, (num_embeddings, embedding_dim))
        if not self.weight.is_meta:
            self.load_full(torch.randn(num_embeddings, embedding_dim, device=device, dtype=dtype))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's block of the full weight in."""
        self.weight = _load(self.weight, weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: the full ``(batch, seq)``; batch must divide by the batch axes' size. Returns
        ``(batch / (d q), seq, hidden / q)``."""
        parts = self.grid.batch_group.size
        if ids.shape[0] % parts:
            raise ValueError(
                f"VocabParallelEmbedding2D: batch={ids.shape[0]} does not divide by the {parts} ranks of the batch "
                f"axes; use a batch that is a multiple of {parts}, or Embedding2D (which takes any batch)"
            )
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        partial = F.embedding(local.masked_fill(~owned, 0), self.weight) * owned.unsqueeze(-1)
        return reduce_scatter_all_gather(partial, group=self.grid.batch_group, dim=0)


def cross_entropy_2d(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    mesh: Mesh,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of 2D logits (batch over the batch axes, vocabulary over ``tp_col``), equal to
    ``F.cross_entropy`` of the full logits over the non-ignored targets.

    Per row: the vocabulary-parallel cross-entropy over the grid row (`vocab_parallel_cross_entropy`); then the
    loss sum and the target count are all-reduced over the batch axes.

    Args:
        local_logits: ``(batch_i, ..., vocab / q)`` this rank's block.
        target: ``(batch_i, ...)`` this rank's rows of the targets (`shard_batch`).
        mesh: the 2D / 2.5D mesh.
        ignore_index: target value that contributes nothing. Default ``-100``.

    Returns:
        The scalar mean loss (0 when every target is ignored), the same on every rank.
    """
    grid = Grid.of(mesh, "cross_entropy_2d")
    total = vocab_parallel_cross_entropy(
        local_logits, target, group=grid.row_group, ignore_index=ignore_index, reduction="sum"
    )
    total = all_reduce_copy(total.float().reshape(1), group=grid.batch_group)
    count = all_reduce((target != ignore_index).sum().float().reshape(1), group=grid.batch_group)
    return (total / count.clamp(min=1)).reshape(()).to(local_logits.dtype)  # 0, not NaN, when all are ignored
