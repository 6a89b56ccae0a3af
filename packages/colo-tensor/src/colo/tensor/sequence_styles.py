"""Sequence-parallel styles for `parallelize`: switch a model between SP modes by its plan, not its code.

A model keeps its attention core a module called as ``core(q, k, v)`` on ``(batch, seq, heads, head_dim)`` tensors
(with ``causal`` and optionally ``scale`` attributes), the way torchtitan's and Megatron-Core's models do. Then:

- **Megatron-SP** (over ``tp``): ``Colwise(input_layout=Shard(1))``, ``FusedQKV(input_layout=Shard(1))`` and
  ``Rowwise(output_layout=Shard(1))`` on the linears, `SequenceParallel` on the norms, ``ShardedRNG`` on the
  dropouts that now see a sequence shard, and ``PrepareInput(Replicate(), Shard(1))`` where the sequence is
  split (after the embedding).
- **Ulysses** (over ``sp``): `UlyssesAttention` on the attention core; nothing else changes.
- **Ring attention** (over ``sp``): `RingAttention` on the attention core; nothing else changes.

For Ulysses and ring attention every rank holds its part of the sequence from the data on (`shard_sequence`),
weights are replicated over ``sp`` and their gradients are summed or averaged over it with the data-parallel
ones (``("dp", "sp")``); a loss over this rank's tokens, averaged over ``dp x sp``, is the global mean.

The styles assume the sequence fills the shards (no padding): with padding at the end, causal attention is
still exact for the real tokens; non-causal attention needs ``seq_len`` and so the functional API
(`ulysses_attention`, `ring_attention`).
"""

from __future__ import annotations

from torch import nn

from .ring_attention import RingAttentionCore
from .sequence_parallel import _HOOKED, sum_gradients_over
from .styles import ParallelStyle, StyleTarget
from .ulysses import check_ulysses_heads, gather_heads, scatter_heads
from .zigzag import check_attention_inputs, check_layout, check_sequence_shard


class SequenceParallel(ParallelStyle):
    """Run a module (a norm) on this rank's sequence shard, summing its parameters' gradients over the axis.

    The module itself is unchanged: a norm or an element-wise module is correct on any slice of the tokens. Its
    parameters stay replicated, but each rank's gradient covers only its tokens, so a hook all-reduces (sums)
    each parameter's gradient over the axis in backward (`sum_gradients_over`). A dropout on a sequence shard
    needs `ShardedRNG` instead (a different mask per rank); a module without parameters needs nothing.

    Args:
        axis: mesh axis; default: `parallelize`'s.
    """

    def __init__(self, *, axis: str | None = None):
        self.axis = axis

    def check(self, target: StyleTarget) -> None:
        if next(target.module.parameters(), None) is None:
            raise ValueError(
                f"{self!r} cannot handle {target.describe()}: it has no parameters, so there is nothing to sum; a "
                "dropout on a sequence shard needs ShardedRNG(tracker), other modules need no style"
            )
        params = [p for p in target.module.parameters() if p.requires_grad]  # frozen ones (LoRA) need no sum
        if any(getattr(p, _HOOKED, None) is not None for p in params):
            raise ValueError(f"{self!r} on {target.describe()}: its parameters already sum their gradients")

    def apply(self, target: StyleTarget) -> nn.Module:
        sum_gradients_over(target.module, target.mesh.group(target.axis))
        return target.module

    def __repr__(self) -> str:
        return "SequenceParallel()" if self.axis is None else f"SequenceParallel(axis={self.axis!r})"


class UlyssesAttention(ParallelStyle):
    """Run an attention core on the whole sequence and ``num_heads / sp`` heads (DeepSpeed-Ulysses).

    Hooks around the module: before it, an all-to-all turns its first three positional arguments q, k, v from
    this rank's sequence shard (all heads) into the whole sequence (this rank's heads; kv heads repeated when
    there are fewer than ranks); after it, an all-to-all turns the output back (`colo.tensor.ulysses`). The core
    runs unchanged on its heads, so any attention implementation works.

    Args:
        layout: how the sequence is split, ``"contiguous"`` or ``"zigzag"``. Default ``"contiguous"``.
        axis: mesh axis; default: `parallelize`'s.
    """

    def __init__(self, *, layout: str = "contiguous", axis: str | None = None):
        self.layout, self.axis = check_layout(layout, "UlyssesAttention"), axis

    def apply(self, target: StyleTarget) -> nn.Module:
        group, where = target.mesh.group(target.axis), f"UlyssesAttention on {target.name or '<root>'!r}"
        local_lens: list[int] = []

        def before(module, args):
            if len(args) < 3:
                raise ValueError(f"{where}: call the attention core with q, k, v as its first positional arguments")
            q, k, v = args[:3]
            check_attention_inputs(q, k, v, group, where)
            check_ulysses_heads(group.size, q.shape[2], k.shape[2], where)
            seq_len = check_sequence_shard(q.shape[1], group.size, self.layout, None, where)
            local_lens.append(q.shape[1])
            return (*scatter_heads(q, k, v, group=group, layout=self.layout, seq_len=seq_len), *args[3:])

        def after(module, args, output):
            return gather_heads(output, group=group, layout=self.layout, local_len=local_lens.pop())

        target.module.register_forward_pre_hook(before)
        target.module.register_forward_hook(after)
        return target.module

    def __repr__(self) -> str:
        return f"UlyssesAttention(layout={self.layout!r})"


class RingAttention(ParallelStyle):
    """Replace an attention core by a `RingAttentionCore` (ring attention over the axis, `colo.kernels` blocks).

    The core must be a plain ``softmax(scale * q k^T) v`` without parameters or dropout: ring attention computes
    it itself. Its ``causal`` attribute (unless ``causal`` is given) and ``scale`` attribute (if any) are kept.

    Args:
        causal: causal mask; ``None``: the module's ``causal`` attribute.
        layout: ``"zigzag"`` (load-balanced) or ``"contiguous"``. Default ``"zigzag"``.
        backend: `colo.kernels` backend of the block steps (``None``: its dispatcher).
        axis: mesh axis; default: `parallelize`'s.
    """

    replaces = True

    def __init__(
        self, *, causal: bool | None = None, layout: str = "zigzag", backend: str | None = None, axis: str | None = None
    ):
        self.causal, self.layout = causal, check_layout(layout, "RingAttention")
        self.backend, self.axis = backend, axis

    def _causal(self, target: StyleTarget) -> bool:
        if self.causal is not None:
            return bool(self.causal)
        causal = getattr(target.module, "causal", None)
        if not isinstance(causal, bool):
            raise ValueError(
                f"{self!r} cannot handle {target.describe()}: it has no bool attribute 'causal'; pass "
                "RingAttention(causal=True or False)"
            )
        return causal

    def check(self, target: StyleTarget) -> None:
        tensors = [name for name, _ in target.module.named_parameters()] + [n for n, _ in target.module.named_buffers()]
        if tensors:
            raise ValueError(
                f"{self!r} cannot replace {target.describe()}: it holds {tensors[:3]}, which ring attention would "
                "drop; point the pattern at the parameter-free attention core (softmax(q k^T) v)"
            )
        self._causal(target)

    def apply(self, target: StyleTarget) -> nn.Module:
        return RingAttentionCore(
            group=target.mesh.group(target.axis),
            causal=self._causal(target),
            scale=getattr(target.module, "scale", None),
            layout=self.layout,
            backend=self.backend,
        )

    def __repr__(self) -> str:
        return f"RingAttention(causal={self.causal}, layout={self.layout!r})"
