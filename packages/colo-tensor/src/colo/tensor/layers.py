"""1D tensor-parallel linear layers: `ColumnParallelLinear` and `RowParallelLinear` (Megatron-LM).

Megatron-LM (Shoeybi et al., 2019, https://arxiv.org/abs/1909.08053) splits an MLP's first linear by output
features (column parallel: no communication in forward) and its second by input features (row parallel: one
all-reduce of the partial outputs), so a block costs one all-reduce in forward and one in backward.

Weights are plain parameters holding this rank's shard, with their `Layout` attached (`layout_of`): sharded
on the tensor-parallel axis, replicated on every other axis of the mesh. Built directly, a layer initialises
the *full* weight the way ``torch.nn.Linear`` does and keeps its shard, so with the same seed it equals the
unsharded layer; ``from_linear`` shards an existing ``nn.Linear``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Mesh

from .comm_ops import all_gather_split, all_reduce_copy, copy_all_reduce, split_all_gather
from .layout import Layout, layout_of, set_layout
from .placement import Shard


def tp_size(mesh: Mesh, axis: str, where: str) -> int:
    """The size of ``axis`` on ``mesh``, or a clear error when the mesh has no such axis."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be a colo.comm.Mesh, not {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{where}: the mesh has no axis {axis!r}; its axes are {mesh.axis_names}; pass axis=...")
    return mesh.size(axis)


def check_divides(tp: int, extent: int, name: str, where: str) -> None:
    """Raise a `ValueError` naming ``name`` when the axis size ``tp`` does not divide ``extent``."""
    if extent % tp:
        choices = sorted(d for d in range(1, extent + 1) if extent % d == 0)
        raise ValueError(f"{where}: tp={tp} does not divide {name}={extent}; choose tp in {choices} or change {name}")


def sharded_parameter(local: torch.Tensor, mesh: Mesh, axis: str, dim: int | None, global_shape) -> nn.Parameter:
    """A parameter holding ``local`` with its layout: ``Shard(dim)`` on ``axis`` (``None``: replicated)."""
    param = nn.Parameter(local)
    placements = {axis: Shard(dim)} if dim is not None else {}
    set_layout(param, Layout(mesh, placements, global_shape))
    return param


def _linear_init(out_features: int, in_features: int, bias: bool, device, dtype):
    """Full weight and bias drawn exactly as ``torch.nn.Linear.reset_parameters`` draws them."""
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    full_bias = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        full_bias = torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound)
    return weight, full_bias


class _ParallelLinear(nn.Module):
    """What column- and row-parallel linears share: sizes, the group, parameters and their initialisation."""

    _shard_dim: int  # the weight dimension split over the axis: 0 (output features) or 1 (input features)

    def __init__(self, in_features, out_features, *, mesh, axis, bias, device, dtype):
        super().__init__()
        where = type(self).__name__
        self.tp = tp_size(mesh, axis, where)
        split = out_features if self._shard_dim == 0 else in_features
        check_divides(self.tp, split, "out_features" if self._shard_dim == 0 else "in_features", where)
        self.in_features, self.out_features = in_features, out_features
        self.mesh, self.axis = mesh, axis
        self.group = mesh.group(axis)
        shape = [out_features, in_features]
        shape[self._shard_dim] //= self.tp
        local = torch.empty(shape, device=device, dtype=dtype)
        self.weight = sharded_parameter(local, mesh, axis, self._shard_dim, (out_features, in_features))
        if bias:
            bias_dim = 0 if self._shard_dim == 0 else None
            local_bias = torch.empty(shape[0], device=device, dtype=dtype)
            self.bias = sharded_parameter(local_bias, mesh, axis, bias_dim, (out_features,))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the full weights as ``nn.Linear`` does and keep this rank's shard (nothing on the meta device)."""
        if self.weight.is_meta:
            return
        weight, bias = _linear_init(
            self.out_features, self.in_features, self.bias is not None, self.weight.device, self.weight.dtype
        )
        self._load_full(weight, bias)

    @torch.no_grad()
    def _load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy this rank's shard of full weights in (replacing meta parameters, keeping their layouts)."""
        rank = self.mesh.rank(self.axis)
        part = weight.shape[self._shard_dim] // self.tp
        shard = weight.narrow(self._shard_dim, rank * part, part)
        self.weight = _refill(self.weight, shard)
        if bias is not None:
            self.bias = _refill(self.bias, bias.narrow(0, rank * part, part) if self._shard_dim == 0 else bias)

    @classmethod
    def _from_full(cls, linear: nn.Linear, **kwargs):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear: expected a torch.nn.Linear, not {type(linear).__name__}")
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
            **kwargs,
        )
        layer._load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"axis={self.axis!r}, tp={self.tp}"
        )


def _refill(param: nn.Parameter, values: torch.Tensor) -> nn.Parameter:
    """``param`` holding a copy of ``values`` (a new parameter if ``param`` is on the meta device), layout kept."""
    layout = layout_of(param)
    if param.is_meta:
        fresh = nn.Parameter(values.clone(memory_format=torch.contiguous_format), requires_grad=param.requires_grad)
        return set_layout(fresh, layout)
    param.copy_(values)
    return param


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W's rows (the output features) split over a mesh axis.

    Rank ``r`` holds output features ``[r * out/tp, (r + 1) * out/tp)`` of the weight and bias; the input is
    replicated. Forward: `copy_all_reduce` on the input (the backward all-reduces the input gradient), a local
    matmul, and with ``gather_output`` an all-gather of the outputs.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample; must divide by the axis size.
        mesh: the mesh; parameters are sharded on ``axis`` and replicated on its other axes.
        axis: the tensor-parallel mesh axis. Default ``"tp"``.
        bias: whether to add a (sharded) bias. Default ``True``.
        gather_output: return the full output on every rank instead of this rank's features. Default ``False``.
        device: where to create the parameters (``"meta"``: no memory, no initialisation).
        dtype: parameter dtype.
    """

    _shard_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        axis: str = "tp",
        bias: bool = True,
        gather_output: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_features, out_features, mesh=mesh, axis=axis, bias=bias, device=device, dtype=dtype)
        self.gather_output = gather_output

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, mesh: Mesh, axis: str = "tp", gather_output: bool = False
    ) -> ColumnParallelLinear:
        """The column-parallel layer holding this rank's rows of ``linear``'s weight and bias."""
        return cls._from_full(linear, mesh=mesh, axis=axis, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(..., in_features)``, replicated. Returns ``(..., out_features / tp)``, or the full output."""
        y = F.linear(copy_all_reduce(x, group=self.group), self.weight, self.bias)
        return all_gather_split(y, group=self.group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W's columns (the input features) split over a mesh axis.

    Rank ``r`` holds input features ``[r * in/tp, (r + 1) * in/tp)`` of the weight; the bias is replicated and
    added once, after the reduction. Forward: a local matmul on this rank's input features and `all_reduce_copy`
    of the partial outputs (the backward passes the output gradient through).

    Args:
        in_features: size of each input sample; must divide by the axis size.
        out_features: size of each output sample.
        mesh: the mesh; parameters are sharded (weight) or replicated (bias) on ``axis``, replicated elsewhere.
        axis: the tensor-parallel mesh axis. Default ``"tp"``.
        bias: whether to add a bias. Default ``True``.
        input_is_parallel: the input is already split over the axis (the output of a `ColumnParallelLinear`);
            otherwise this rank's features are split off a replicated input. Default ``True``.
        device: where to create the parameters (``"meta"``: no memory, no initialisation).
        dtype: parameter dtype.
    """

    _shard_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        axis: str = "tp",
        bias: bool = True,
        input_is_parallel: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_features, out_features, mesh=mesh, axis=axis, bias=bias, device=device, dtype=dtype)
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, mesh: Mesh, axis: str = "tp", input_is_parallel: bool = True
    ) -> RowParallelLinear:
        """The row-parallel layer holding this rank's columns of ``linear``'s weight (and all of its bias)."""
        return cls._from_full(linear, mesh=mesh, axis=axis, input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(..., in_features / tp)``, or ``(..., in_features)`` replicated when not ``input_is_parallel``.
        Returns ``(..., out_features)``, the same on every rank of the axis."""
        if not self.input_is_parallel:
            x = split_all_gather(x, group=self.group, dim=-1)
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"RowParallelLinear: the input has {x.shape[-1]} features but this rank holds "
                f"{self.weight.shape[1]} of {self.in_features}; pass this rank's slice or set input_is_parallel=False"
            )
        y = all_reduce_copy(F.linear(x, self.weight), group=self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"
