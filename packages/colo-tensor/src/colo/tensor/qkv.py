"""A fused, column-parallel q/k/v projection with grouped-query attention: `QKVParallelLinear`.

The unsharded projection is one ``nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim)`` whose output
rows are the q heads, then the k heads, then the v heads. Sharded by heads over a mesh axis of size ``tp``,
rank ``r`` holds q heads ``[r * num_heads / tp, (r + 1) * num_heads / tp)`` and the kv heads those q heads
attend with, so attention stays local to the rank (the output projection is then row parallel):

- ``num_kv_heads`` divisible by ``tp``: kv heads are sharded like the q heads (rank ``r`` holds kv heads
  ``[r * num_kv_heads / tp, ...)``, exactly the groups of its q heads).
- ``tp`` divisible by ``num_kv_heads`` (fewer kv heads than ranks): the k and v weights are replicated on every
  rank and each rank projects only the one kv head of its q heads' group, ``r // (tp / num_kv_heads)``. The
  weight goes through `copy_all_reduce`, so its gradient (non-zero only in the rows of that head) is summed
  over the axis: every replica gets the full gradient and the replicas stay equal after the optimizer step.
- anything else has no such assignment and is rejected with the valid choices of ``tp``.

The q, k and v weights are three parameters with exact layouts (``Shard(0)`` of ``(num_heads * head_dim,
hidden)``; ``Shard(0)`` or ``Replicate`` of ``(num_kv_heads * head_dim, hidden)``), which is how a checkpoint
stores a fused projection (three rectangles); the forward concatenates them for a single matmul. The output is
this rank's ``[q | k | v]``: ``(..., (local_num_heads + 2 * local_num_kv_heads) * head_dim)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Mesh

from .comm_ops import copy_all_reduce
from .layers import _refill, sharded_parameter, tp_size


def valid_tp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """Axis sizes a fused QKV projection with these head counts can be sharded over."""
    return [
        tp
        for tp in range(1, num_heads + 1)
        if num_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)
    ]


def check_heads(tp: int, num_heads: int, num_kv_heads: int, where: str) -> None:
    """Raise a `ValueError` that lists the valid ``tp`` when heads cannot be split over ``tp`` ranks."""
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"{where}: num_kv_heads={num_kv_heads} must be at least 1 and divide num_heads={num_heads} "
            "(each kv head serves a group of q heads)"
        )
    valid = valid_tp_sizes(num_heads, num_kv_heads)
    if num_heads % tp:
        raise ValueError(f"{where}: tp={tp} does not divide num_heads={num_heads}; choose tp in {valid}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"{where}: tp={tp} neither divides num_kv_heads={num_kv_heads} nor is a multiple of it, so a rank's q "
            f"heads would need kv heads of two groups; choose tp in {valid}"
        )


class QKVParallelLinear(nn.Module):
    """The fused q/k/v projection of grouped-query attention, column parallel by heads.

    Built directly it initialises the full fused weight and bias as ``nn.Linear(in_features, (num_heads + 2 *
    num_kv_heads) * head_dim)`` does (one tensor at a time) and keeps this rank's rows, so with the same seed it
    equals the unsharded projection. Forward: `copy_all_reduce` on the input (the input gradient is summed
    over the axis in backward) and one local matmul.

    Args:
        in_features: size of each input sample (the model's hidden size).
        num_heads: number of query heads; must divide by the axis size.
        num_kv_heads: number of key/value heads; divides ``num_heads`` and either divides by the axis size or
            divides it (see the module docstring).
        head_dim: size of each head.
        mesh: the mesh; parameters are replicated on its other axes.
        axis: the tensor-parallel mesh axis. Default ``"tp"``.
        bias: whether the projection has a bias. Default ``True``.
        device: where to create the parameters (``"meta"``: no memory, no initialisation).
        dtype: parameter dtype.

    Attributes:
        local_num_heads: q heads on this rank.
        local_num_kv_heads: kv heads this rank projects (1 when kv heads are replicated).
        kv_head: the first of those kv heads.
        kv_replicated: whether the k and v weights are replicated (fewer kv heads than ranks).
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        mesh: Mesh,
        axis: str = "tp",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp = tp_size(mesh, axis, "QKVParallelLinear")
        check_heads(self.tp, num_heads, num_kv_heads, "QKVParallelLinear")
        self.in_features, self.head_dim = in_features, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.mesh, self.axis, self.group = mesh, axis, mesh.group(axis)
        rank = mesh.rank(axis)
        self.local_num_heads = num_heads // self.tp
        self.kv_replicated = num_kv_heads % self.tp != 0
        self.local_num_kv_heads = 1 if self.kv_replicated else num_kv_heads // self.tp
        self.kv_head = rank // (self.tp // num_kv_heads) if self.kv_replicated else rank * self.local_num_kv_heads
        kv_dim = None if self.kv_replicated else 0
        kv_rows = num_kv_heads * head_dim if self.kv_replicated else self.local_num_kv_heads * head_dim
        q_shape, kv_shape = (num_heads * head_dim, in_features), (num_kv_heads * head_dim, in_features)

        def param(rows, dim, global_shape):
            local = torch.empty((rows,) + tuple(global_shape[1:]), device=device, dtype=dtype)
            return sharded_parameter(local, mesh, axis, dim, global_shape)

        self.q_weight = param(self.local_num_heads * head_dim, 0, q_shape)
        self.k_weight = param(kv_rows, kv_dim, kv_shape)
        self.v_weight = param(kv_rows, kv_dim, kv_shape)
        if bias:
            self.q_bias = param(self.local_num_heads * head_dim, 0, q_shape[:1])
            self.k_bias = param(kv_rows, kv_dim, kv_shape[:1])
            self.v_bias = param(kv_rows, kv_dim, kv_shape[:1])
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.reset_parameters()

    @property
    def out_features(self) -> int:
        """Width of the unsharded fused output, ``(num_heads + 2 * num_kv_heads) * head_dim``."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def local_out_features(self) -> int:
        """Width of this rank's output, ``(local_num_heads + 2 * local_num_kv_heads) * head_dim``."""
        return (self.local_num_heads + 2 * self.local_num_kv_heads) * self.head_dim

    @property
    def split_sizes(self) -> tuple[int, int, int]:
        """Widths of this rank's q, k and v in the output."""
        kv = self.local_num_kv_heads * self.head_dim
        return self.local_num_heads * self.head_dim, kv, kv

    def reset_parameters(self) -> None:
        """Draw the full fused weight, then the full bias, as ``nn.Linear`` does; keep this rank's rows."""
        if self.q_weight.is_meta:
            return
        like = {"device": self.q_weight.device, "dtype": self.q_weight.dtype}
        weight = torch.empty(self.out_features, self.in_features, **like)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        self._load_rows(weight, "weight")
        del weight  # one full tensor alive at a time
        if self.q_bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            bias = torch.empty(self.out_features, device=self.q_bias.device, dtype=self.q_bias.dtype)
            self._load_rows(bias.uniform_(-bound, bound), "bias")

    @torch.no_grad()
    def _load_rows(self, full: torch.Tensor, kind: str) -> None:
        """Copy this rank's q, k and v rows of a full fused weight or bias in."""
        hd, q_rows, kv_rows = self.head_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = full.split([q_rows, kv_rows, kv_rows])
        q = q.narrow(0, self.mesh.rank(self.axis) * self.local_num_heads * hd, self.local_num_heads * hd)
        if not self.kv_replicated:
            k, v = (t.narrow(0, self.kv_head * hd, self.local_num_kv_heads * hd) for t in (k, v))
        for name, values in (("q", q), ("k", k), ("v", v)):
            attr = f"{name}_{kind}"
            setattr(self, attr, _refill(getattr(self, attr), values))

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, num_heads: int, num_kv_heads: int, mesh: Mesh, axis: str = "tp"
    ) -> QKVParallelLinear:
        """The sharded projection holding this rank's rows of a fused ``nn.Linear`` (rows: q, then k, then v)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QKVParallelLinear.from_linear: expected a torch.nn.Linear, not {type(linear).__name__}")
        head_dim = fused_head_dim(linear.out_features, num_heads, num_kv_heads, "QKVParallelLinear.from_linear")
        layer = cls(
            linear.in_features,
            num_heads,
            num_kv_heads,
            head_dim,
            mesh=mesh,
            axis=axis,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        layer._load_rows(linear.weight.detach(), "weight")
        if linear.bias is not None:
            layer._load_rows(linear.bias.detach(), "bias")
        return layer

    def _kv(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's kv rows; replicated weights pass `copy_all_reduce` so their gradient sums over the axis."""
        if tensor is None or not self.kv_replicated:
            return tensor
        return copy_all_reduce(tensor, group=self.group).narrow(0, self.kv_head * self.head_dim, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(..., in_features)``, replicated. Returns this rank's ``[q | k | v]`` (see `split_sizes`)."""
        weight = torch.cat([self.q_weight, self._kv(self.k_weight), self._kv(self.v_weight)])
        bias = None
        if self.q_bias is not None:
            bias = torch.cat([self.q_bias, self._kv(self.k_bias), self._kv(self.v_bias)])
        return F.linear(copy_all_reduce(x, group=self.group), weight, bias)

    def extra_repr(self) -> str:
        kv = "replicated" if self.kv_replicated else "sharded"
        return (
            f"in_features={self.in_features}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads} ({kv}), "
            f"head_dim={self.head_dim}, bias={self.q_bias is not None}, axis={self.axis!r}, tp={self.tp}"
        )


def fused_head_dim(out_features: int, num_heads: int, num_kv_heads: int, where: str) -> int:
    """``head_dim`` of a fused projection with ``out_features`` rows, or a `ValueError` when they do not fit."""
    heads = num_heads + 2 * num_kv_heads
    if num_heads < 1 or num_kv_heads < 1 or out_features % heads:
        raise ValueError(
            f"{where}: out_features={out_features} is not (num_heads + 2 * num_kv_heads) * head_dim with "
            f"num_heads={num_heads}, num_kv_heads={num_kv_heads}; check the head counts"
        )
    return out_features // heads
