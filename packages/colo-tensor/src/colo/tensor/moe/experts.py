"""`GroupedExperts`: the SwiGLU experts of a mixture-of-experts block, stored as 3-D tensors.

Expert ``e`` computes ``w2[e] (silu(w1[e] x) * (w3[e] x))`` (Mixtral's names: ``w1`` gate, ``w3`` up, ``w2`` down;
Hugging Face keeps ``w1`` and ``w3`` fused as ``gate_up_proj``). The rows handed in are grouped by expert
(`colo.tensor.moe.permute`) with ``counts[e]`` rows for expert ``e``; the ``"grouped"`` implementation runs each
projection as one ``torch.nn.functional.grouped_mm`` over all experts, the ``"loop"`` reference one matmul per
expert (also used for dtypes ``grouped_mm`` lacks, such as float64). Under expert parallelism the tensors hold this
rank's experts only (``num_experts`` is the local count); under expert tensor parallelism (`split_expert_ffns`) each
expert's intermediate width is this tp rank's share.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm_ops import AllReduceCopy, CopyAllReduce
from .config import EXPERT_IMPLS

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What ``grouped_mm`` computes in; other dtypes (float64 in tests) take the loop."""


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return nn.functional.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs (see the module docstring).

    Args:
        num_experts (int): experts held here.
        hidden_size (int): width of the tokens.
        intermediate_size (int): width of each expert's gate and up projections.
        impl (str): ``"grouped"`` or ``"loop"``. Default: ``"grouped"``.

    Parameters:
        w1: ``(num_experts, intermediate_size, hidden_size)`` gate projections.
        w3: ``(num_experts, intermediate_size, hidden_size)`` up projections.
        w2: ``(num_experts, hidden_size, intermediate_size)`` down projections.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, impl: str = "grouped") -> None:
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"GroupedExperts: impl={impl!r}; choose one of {EXPERT_IMPLS}")
        self.impl = impl
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.grad_scale = 1.0
        """Multiplies the weights' gradients (not the activations'): ``1 / ep`` under expert parallelism, so that
        averaging expert gradients over the ``dp`` ranks holding the same experts gives the gradient of the mean
        loss over all ``dp * ep`` data ranks (each expert saw the tokens of its ``ep`` group)."""
        self.tp_group = None
        """The group each expert's FFN is split over (expert tensor parallelism, `split_expert_ffns`), or ``None``."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs for ``x`` (``(N, hidden)``, grouped by expert, ``counts[e]`` rows for expert ``e``)."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        split = self.tp_group is not None and self.tp_group.size > 1
        if split:  # the same rows on every tp rank: their gradient is the sum of the ranks' partial ones
            x = CopyAllReduce.apply(x, self.tp_group)
        if self.impl == "loop" or x.dtype not in _GROUPED_DTYPES:
            out = _loop(x, counts, w1, w2, w3)
        else:
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            h = nn.functional.silu(_grouped(x, w1, offsets)) * _grouped(x, w3, offsets)
            out = _grouped(h, w2, offsets)
        return AllReduceCopy.apply(out, self.tp_group) if split else out


def _loop(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    """The reference: one matmul per expert over its rows."""
    outputs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        h = nn.functional.silu(rows @ w1[e].t()) * (rows @ w3[e].t())
        outputs.append(h @ w2[e].t())
    return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


class _ScaleGrad(torch.autograd.Function):
    """Forward: identity. Backward: the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class SharedExperts(nn.Module):
    """The always-on experts of a DeepSeek-MoE block (Dai et al., "DeepSeekMoE", 2024): one SwiGLU MLP
    ``down_proj(silu(gate_proj(x)) * up_proj(x))`` every token goes through, its width the shared experts' summed
    widths. The module names are Hugging Face DeepseekV3's (``mlp.shared_experts.gate_proj`` / ``up_proj`` /
    ``down_proj``); the weights are dense parameters (replicated over ``ep``).

    Args:
        hidden_size (int): width of the tokens.
        intermediate_size (int): width of the gate and up projections.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of ``x`` (``(..., hidden)``)."""
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
