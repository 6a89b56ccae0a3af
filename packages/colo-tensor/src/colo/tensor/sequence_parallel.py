"""Megatron sequence parallelism: the tensor-parallel layers on sequence-sharded activations.

Megatron-SP (Korthikanti et al., 2022, https://arxiv.org/abs/2205.05198) keeps the activations *between* the
tensor-parallel regions of a transformer block split along the sequence over the ``tp`` ranks, so the norms,
dropouts and residual adds run on ``1 / tp`` of the tokens and store ``1 / tp`` of the activations. The
all-reduce that ends each region is replaced by its two halves: a reduce-scatter along the sequence after the
row-parallel layer (`SequenceParallelRowLinear`) and an all-gather along the sequence before the next
column-parallel layer (`SequenceParallelColumnLinear`, `SequenceParallelQKVLinear`). The ring volume is the
same as tensor parallelism's all-reduce, ``2 (tp - 1) / tp`` of the activation per region and direction.

**The backward variant: re-gather.** The column-parallel layer's weight gradient needs the *gathered* input.
`AllGatherLinear` saves only this rank's sequence shard and all-gathers it again in backward, overlapped with
the input-gradient matmul (Megatron-LM's default), instead of saving the gathered activation:

- memory: each column-parallel entry keeps ``b * s / tp * h`` elements instead of ``b * s * h``, the point of
  sequence parallelism (the norm's output it consumes is sharded too);
- communication: one more all-gather of ``(tp - 1) / tp * b * s * h`` elements per entry in backward. A block
  (two entries, two exits) then moves, per direction and in units of ``(tp - 1) / tp * b * s * h`` elements,
  forward 2 all-gathers + 2 reduce-scatters, backward 2 re-gathers + 2 reduce-scatters (the entries' input
  gradients) + 2 all-gathers (the exits' adjoints): 10 units against the 8 of saving the gathered input.

Parameters used on sequence shards are replicated over ``tp`` but each rank's gradient covers only its tokens:
the row-parallel bias passes `copy_all_reduce` (identity forward, all-reduce of the gradient backward), and
modules run whole on the shards (norms) get the same all-reduce from `sum_gradients_over` (the
`SequenceParallel` style).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Group, Mesh, all_gather, all_reduce, reduce_scatter

from .comm_ops import _check_group, all_gather_split, copy_all_reduce, reduce_scatter_all_gather, split_all_gather
from .layers import ColumnParallelLinear, RowParallelLinear
from .qkv import QKVParallelLinear


def _sequence_dim(x: torch.Tensor, dim: int, where: str) -> int:
    if x.dim() < 2 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{where}: sequence_dim={dim} is out of range for an input of shape {tuple(x.shape)}")
    dim %= x.dim()
    if dim == x.dim() - 1:
        raise ValueError(f"{where}: sequence_dim={dim} is the feature dimension of {tuple(x.shape)}; use e.g. 1")
    return dim


class AllGatherLinear(torch.autograd.Function):
    """``y = all_gather(x) @ W^T + b`` with the sharded input saved (Megatron-SP's re-gather backward).

    Forward: all-gather of ``x`` along the sequence dimension, then the matmul; the gathered input is freed.
    Backward: all-gather of the saved shard again, overlapped with ``dX = dY @ W``; reduce-scatter (sum) of
    ``dX`` along the sequence dimension, overlapped with ``dW = dY^T @ X``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim):
        ctx.group, ctx.dim, ctx.has_bias = group, dim, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather(x.contiguous(), group=group, dim=dim), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, dim = ctx.group, ctx.dim
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad = grad.contiguous()
        flat_grad = grad.reshape(-1, grad.shape[-1])
        gathering = all_gather(x.contiguous(), group=group, dim=dim, async_op=True) if needs_weight else None
        scattering = None
        if needs_input:
            grad_input = grad @ weight  # while the input is gathered again
            scattering = reduce_scatter(grad_input, group=group, dim=dim, async_op=True)
        grad_weight = grad_bias = grad_x = None
        if gathering is not None:
            full = gathering.wait()
            grad_weight = flat_grad.t() @ full.reshape(-1, full.shape[-1])  # while the input gradient scatters
        if needs_bias and ctx.has_bias:
            grad_bias = flat_grad.sum(0)
        if scattering is not None:
            grad_x = scattering.wait().contiguous()
        return grad_x, grad_weight, grad_bias, None, None


def all_gather_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group: Group, sequence_dim: int = 1
) -> torch.Tensor:
    """All-gather a sequence-sharded ``x`` along ``sequence_dim`` and apply ``F.linear`` (`AllGatherLinear`).

    Every rank's shard must have the same length: the sequence must divide by the group size (pad it; the
    reduce-scatter of the exit layer checks it too).

    Args:
        x: this rank's sequence shard, e.g. ``(batch, seq / tp, in_features)``.
        weight: ``(out, in_features)``, this rank's rows of a column-parallel weight.
        bias: ``(out,)`` or ``None``.
        group: the tensor-parallel group.
        sequence_dim: the sequence dimension of ``x``. Default ``1``.

    Returns:
        ``(batch, seq, out)``: the whole sequence, this rank's output features.
    """
    group = _check_group(group, "all_gather_linear")
    dim = _sequence_dim(x, sequence_dim, "all_gather_linear")
    return AllGatherLinear.apply(x, weight, bias, group, dim)


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """A `ColumnParallelLinear` whose input arrives split along the sequence (Megatron-SP's entry layer).

    Forward: `all_gather_linear` (all-gather of the sequence, matmul; backward re-gathers the saved shard and
    reduce-scatters the input gradient), then with ``gather_output`` an all-gather of the output features.

    Args:
        in_features, out_features, mesh, axis, bias, gather_output, device, dtype: as `ColumnParallelLinear`.
        sequence_dim: the sequence dimension of the input. Default ``1`` (``(batch, seq, features)``).
    """

    def __init__(self, in_features: int, out_features: int, *, sequence_dim: int = 1, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.sequence_dim = sequence_dim

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, mesh: Mesh, axis: str = "tp", gather_output: bool = False, sequence_dim: int = 1
    ) -> SequenceParallelColumnLinear:
        """The layer holding this rank's rows of ``linear``'s weight and bias."""
        return cls._from_full(linear, mesh=mesh, axis=axis, gather_output=gather_output, sequence_dim=sequence_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq / tp, in_features)``. Returns ``(batch, seq, out_features / tp)`` (or all features)."""
        y = all_gather_linear(x, self.weight, self.bias, group=self.group, sequence_dim=self.sequence_dim)
        return all_gather_split(y, group=self.group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sequence_dim={self.sequence_dim}"


class SequenceParallelRowLinear(RowParallelLinear):
    """A `RowParallelLinear` whose output leaves split along the sequence (Megatron-SP's exit layer).

    Forward: the local matmul, a reduce-scatter (sum) of the partial outputs along the sequence
    (`reduce_scatter_all_gather`: the backward all-gathers the output gradient), and the bias, which passes
    `copy_all_reduce` because each rank adds it to its own tokens only (its gradient is summed over the axis).

    Args:
        in_features, out_features, mesh, axis, bias, input_is_parallel, device, dtype: as `RowParallelLinear`.
        sequence_dim: the sequence dimension of the input and output. Default ``1``.
    """

    def __init__(self, in_features: int, out_features: int, *, sequence_dim: int = 1, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.sequence_dim = sequence_dim

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, mesh: Mesh, axis: str = "tp", input_is_parallel: bool = True, sequence_dim: int = 1
    ) -> SequenceParallelRowLinear:
        """The layer holding this rank's columns of ``linear``'s weight (and all of its bias)."""
        return cls._from_full(
            linear, mesh=mesh, axis=axis, input_is_parallel=input_is_parallel, sequence_dim=sequence_dim
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq, in_features / tp)``. Returns ``(batch, seq / tp, out_features)``.

        Raises:
            ValueError: the sequence does not divide by the axis size (pad it), before any communication.
        """
        if not self.input_is_parallel:
            x = split_all_gather(x, group=self.group, dim=-1)
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"SequenceParallelRowLinear: the input has {x.shape[-1]} features but this rank holds "
                f"{self.weight.shape[1]} of {self.in_features}; pass this rank's slice or set input_is_parallel=False"
            )
        dim = _sequence_dim(x, self.sequence_dim, "SequenceParallelRowLinear")
        y = reduce_scatter_all_gather(F.linear(x, self.weight), group=self.group, dim=dim)
        return y + copy_all_reduce(self.bias, group=self.group) if self.bias is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sequence_dim={self.sequence_dim}"


class SequenceParallelQKVLinear(QKVParallelLinear):
    """A `QKVParallelLinear` whose input arrives split along the sequence (Megatron-SP's attention entry).

    Forward: `all_gather_linear` on the fused local ``[q | k | v]`` weight (all-gather of the sequence; backward
    re-gathers the saved shard and reduce-scatters the input gradient). Replicated kv weights (fewer kv heads
    than ranks) still pass `copy_all_reduce`, as in `QKVParallelLinear`.

    Args:
        in_features, num_heads, num_kv_heads, head_dim, mesh, axis, bias, device, dtype: as `QKVParallelLinear`.
        sequence_dim: the sequence dimension of the input. Default ``1``.
    """

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, *, sequence_dim=1, **kw):
        super().__init__(in_features, num_heads, num_kv_heads, head_dim, **kw)
        self.sequence_dim = sequence_dim

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, num_heads: int, num_kv_heads: int, mesh: Mesh, axis: str = "tp", sequence_dim=1
    ) -> SequenceParallelQKVLinear:
        """The layer holding this rank's q, k and v rows of a fused ``nn.Linear``."""
        layer = super().from_linear(linear, num_heads=num_heads, num_kv_heads=num_kv_heads, mesh=mesh, axis=axis)
        layer.sequence_dim = sequence_dim
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq / tp, in_features)``. Returns ``(batch, seq, local_out_features)``."""
        weight = torch.cat([self.q_weight, self._kv(self.k_weight), self._kv(self.v_weight)])
        bias = None
        if self.q_bias is not None:
            bias = torch.cat([self.q_bias, self._kv(self.k_bias), self._kv(self.v_bias)])
        return all_gather_linear(x, weight, bias, group=self.group, sequence_dim=self.sequence_dim)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sequence_dim={self.sequence_dim}"


_HOOKED = "_colo_sum_gradients_over"


def sum_gradients_over(module: nn.Module, group: Group) -> list[nn.Parameter]:
    """Make every parameter of ``module`` sum its gradient over ``group`` in backward (all-reduce, sum).

    For a module that runs on this rank's sequence shard with parameters replicated over the axis (a norm under
    Megatron-SP): each rank's gradient covers its own tokens, the sum covers all of them. The all-reduce runs in
    a hook on the parameter's gradient before it is accumulated into ``.grad`` (so gradient accumulation over
    micro-batches stays correct), once per backward pass, one call per parameter.

    Args:
        module: the module; its parameters and its submodules' are hooked.
        group: the axis group, e.g. ``mesh.group("tp")``.

    Returns:
        The hooked parameters.

    Raises:
        ValueError: a parameter is hooked already (its gradient would be summed twice).
    """
    group = _check_group(group, "sum_gradients_over")
    params = [p for p in module.parameters() if p.requires_grad]
    for param in params:
        if getattr(param, _HOOKED, None) is not None:
            raise ValueError(
                f"sum_gradients_over: a parameter of shape {tuple(param.shape)} already sums its gradient over "
                f"{getattr(param, _HOOKED)!r}; apply SequenceParallel to each module once"
            )
    for param in params:
        param.register_hook(lambda grad: all_reduce(grad.clone(memory_format=torch.contiguous_format), group=group))
        setattr(param, _HOOKED, group.name)
    return params
