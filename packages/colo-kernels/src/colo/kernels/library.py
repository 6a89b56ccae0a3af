"""The torch operators colo.kernels registers, all in the ``colo`` namespace (``torch.ops.colo.<name>``).

Every op is a `torch.library.custom_op` with a fake (meta) implementation and, where it has a gradient, a
registered autograd formula that calls the op's ``*_backward`` operator. So ``torch.compile`` sees one opaque node
per op (no graph break, nothing traced into the Triton launch), ``torch.export`` keeps ``torch.ops.colo.*`` nodes,
and selective activation checkpointing can name them (`colo.apps.checkpointing` keeps ``flash_attention``'s
outputs). The torch reference backend runs through the same operators, so a CPU graph has the same nodes as a GPU
one; each operator's last argument is the backend (``"triton"``, ``"torch"`` or ``"auto"``, see
`colo.kernels.dispatch.op_backend`).

``custom_op`` rather than ``torch.library.triton_op``: each operator holds both backends, and the Triton path
does host-side work between launches (document-mask block ranges, optional block counters, tile sizes chosen from
the device), which ``triton_op``'s traced implementations do not allow; inductor calls the operators as opaque
kernels.
"""

from __future__ import annotations

import torch

NAMESPACE = "colo"

OPERATORS = (
    "rms_norm",
    "rms_norm_backward",
    "layer_norm",
    "layer_norm_backward",
    "rotary",
    "swiglu",
    "swiglu_backward",
    "softmax",
    "softmax_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "fused_linear_cross_entropy",
    "flash_attention",
    "flash_attention_backward",
    "fused_adamw",
)
"""The names of every operator under ``torch.ops.colo``; ``rotary``'s backward is ``rotary`` with ``inverse``."""


def operators() -> dict[str, torch._ops.OpOverload]:
    """``{name: torch.ops.colo.<name>.default}`` for every operator in `OPERATORS` (they are registered when
    `colo.kernels` is imported)."""
    import colo.kernels  # noqa: F401  (importing the op modules registers the operators)

    return {name: getattr(getattr(torch.ops, NAMESPACE), name).default for name in OPERATORS}
