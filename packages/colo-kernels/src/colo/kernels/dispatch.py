"""Which implementation of a kernel runs: Triton on CUDA, the torch reference elsewhere, or what the user forces.

``COLO_KERNELS=triton|torch|auto`` (default ``auto``) sets the choice for the process; `use_backend` sets it for
a block (tests use it to run the Triton kernels through Triton's interpreter on CPU); every public op also takes
``backend=`` for one call. Triton on a CPU tensor needs ``TRITON_INTERPRET=1`` set before triton is imported.

Every op is a torch operator in the ``colo`` namespace (``torch.ops.colo.rms_norm``, ...; see `colo.kernels.library`)
whose last argument is the backend. The public functions resolve the choice above in Python, so ``torch.compile``
traces it (and guards on it), and pass ``"triton"`` or ``"torch"``; an operator called directly may also get
``"auto"``, which it resolves by device alone (`op_backend`).

In plain eager code the per-layer ops (`rms_norm`, `rotary`, `swiglu`) skip the operator's dispatch and run the
same implementation and the same registered backward as a `torch.autograd.Function` (`eager_fast_path`): the
operator's dispatch, schema checks and autograd wrapper cost tens of microseconds of host time per call, most of a
small op's time and what kept RMSNorm host-bound on the GPU. Wherever something must see the operator (under
``torch.compile``, a dispatch or torch-function mode such as selective activation checkpointing, fake tensors or a
device context, the autograd profiler, a tensor subclass) the operator runs. ``COLO_KERNELS_EAGER_FAST_PATH=0``
turns the fast path off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "torch")

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes every Triton kernel here loads (and computes on in fp32)."""

_override: list[str] = []


class UnsupportedKernelInput(ValueError):
    """The chosen backend cannot run this op on these inputs (shape, dtype or device); the message says which."""


def check_triton_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    """Raise `UnsupportedKernelInput` unless every given tensor (``None`` skipped) is fp32, bf16 or fp16."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.dtype not in TRITON_DTYPES:
            raise UnsupportedKernelInput(
                f"{op}: the Triton kernel takes float32, bfloat16 or float16; {name} is {tensor.dtype} "
                "(cast it, or use backend='torch')"
            )


try:  # once, at import (the kernel modules import triton at their top too)
    import triton  # noqa: F401

    _TRITON_IMPORTS = True
except ImportError:
    _TRITON_IMPORTS = False


def triton_available() -> bool:
    """Whether triton imports (it is a Linux-only dependency of colo-kernels). A module constant, not a
    ``functools.cache``: compiled code calls this, and dynamo traces through a cache wrapper (re-running the import
    check at every trace) and warns about it."""
    return _TRITON_IMPORTS


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), i.e. on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _requested(backend: str | None) -> str:
    if backend is None:
        backend = _override[-1] if _override else os.environ.get("COLO_KERNELS", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is unknown; use one of {BACKENDS} (COLO_KERNELS or backend=)")
    return backend


def requested_backend(backend: str | None = None) -> str:
    """The backend asked for before resolution: ``backend`` if given, else `use_backend`'s, else ``COLO_KERNELS``."""
    return _requested(backend)


def resolve_backend(op: str, *tensors: torch.Tensor, backend: str | None = None) -> str:
    """The backend (``"triton"`` or ``"torch"``) that runs ``op`` on ``tensors``.

    ``auto`` picks Triton when every tensor is on a CUDA device and triton is installed, the reference otherwise.
    Forcing ``triton`` where it cannot run raises `UnsupportedKernelInput` naming the op and the reason.
    """
    requested = _requested(backend)
    on_cuda = len(tensors) > 0 and all(t.is_cuda for t in tensors)  # not bool(tuple): torch 2.11's dynamo breaks on it
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if not triton_available():
        raise UnsupportedKernelInput(
            f"{op}: backend 'triton' was forced but triton is not installed; pip install triton"
        )
    if not on_cuda and not interpreter_enabled():
        raise UnsupportedKernelInput(
            f"{op}: backend 'triton' was forced for CPU tensors; set TRITON_INTERPRET=1 before importing colo.kernels "
            "to run Triton's interpreter, or use backend='torch'"
        )
    return "triton"


def op_backend(backend: str, *tensors: torch.Tensor) -> str:
    """The implementation a ``torch.ops.colo`` operator runs for its ``backend`` argument: ``"triton"`` or
    ``"torch"`` as given; ``"auto"`` picks Triton when every tensor is on CUDA and triton imports (the device alone,
    not `use_backend` or ``COLO_KERNELS``, so an op and its backward, run later, pick the same)."""
    if backend == "auto":
        on_cuda = len(tensors) > 0 and all(t.is_cuda for t in tensors)  # see resolve_backend
        return "triton" if on_cuda and triton_available() else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"kernel backend {backend!r} is unknown; use one of {BACKENDS}")
    return backend


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Force a kernel backend (``"triton"``, ``"torch"`` or ``"auto"``) inside the block."""
    _requested(backend)
    _override.append(backend)
    try:
        yield
    finally:
        _override.pop()


_FAST_PATH = os.environ.get("COLO_KERNELS_EAGER_FAST_PATH", "1") != "0"


def eager_fast_path(*tensors: torch.Tensor | None) -> bool:
    """Whether an op may run its implementation as a plain `torch.autograd.Function` instead of through its
    ``torch.ops.colo`` operator (module docstring): eager (not traced by ``torch.compile``), no dispatch or
    torch-function mode active, the autograd profiler off (its traces name the operator), plain tensors."""
    return (
        _FAST_PATH
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._len_torch_function_stack() == 0
        and not torch.autograd.profiler._is_profiler_enabled
        and all(tensor is None or type(tensor) is torch.Tensor for tensor in tensors)
    )


def eager_function(name: str, implementation, setup_context, backward) -> type[torch.autograd.Function]:
    """The `torch.autograd.Function` of an operator's fast path: ``implementation`` (the operator's own body) as
    the forward, the operator's registered ``setup_context`` and ``backward``; its ``call(*args)`` runs it (the
    implementation alone when no gradient can flow: no autograd node to build). The forward takes ``ctx`` and calls
    ``setup_context`` itself: a Function with a separate ``setup_context`` binds its arguments through
    ``inspect.signature`` on every call (measured: twice the operator's own dispatch time)."""

    def forward(ctx, *args):
        output = implementation(*args)
        setup_context(ctx, args, output)
        return output

    def call(*args):
        """The op on ``args``: through the Function when a gradient may flow, else the implementation alone."""
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function.apply(*args)
        return implementation(*args)

    function = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward), "call": staticmethod(call)},
    )
    return function
