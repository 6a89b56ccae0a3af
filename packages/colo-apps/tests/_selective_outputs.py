"""What an op returned, seen from a selective-checkpointing policy, on every torch colo supports (shared by the
activation-memory tests)."""

from __future__ import annotations


def policy_outputs(ctx, op, args, kwargs, keep: list) -> tuple:
    """torch 2.12+ calls the policy after the op (``ctx.op_output``); older releases call it before (and again while
    recomputing, with ``ctx.is_recompute``), so the op runs once more on the same inputs, its results kept alive in
    ``keep`` so their storages stay distinct while they are counted."""
    if hasattr(ctx, "op_output"):
        output = ctx.op_output
    else:
        keep.append(op(*args, **kwargs))
        output = keep[-1]
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)
