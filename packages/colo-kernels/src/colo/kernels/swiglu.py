"""SwiGLU activation (Shazeer, 2020): ``silu(gate) * up``, the gating in Llama's MLP.

`swiglu` is the public op; `swiglu_reference` is the same computation in torch ops. Either backend runs as the
operators ``torch.ops.colo.swiglu`` and ``torch.ops.colo.swiglu_backward`` (the torch backend's gradient is the
Triton kernel's closed form). The Triton kernels are
elementwise over the flattened tensors, one ``BLOCK`` per program, fp32 math; the backward recomputes
``sigmoid(gate)`` instead of saving it.
"""

from __future__ import annotations

import torch

from .dispatch import check_triton_dtypes, eager_fast_path, eager_function, op_backend, resolve_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency; the reference still works without it
    triton = None

if triton is not None:

    @triton.jit
    def _sigmoid(x):
        # exp of a non-positive number only, so no overflow for large |x|
        decay = tl.exp(-tl.abs(x))
        return tl.where(x >= 0, 1.0 / (1.0 + decay), decay / (1.0 + decay))

    @triton.jit
    def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        out = gate * _sigmoid(gate) * up
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        sigmoid = _sigmoid(gate)
        silu = gate * sigmoid
        # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
        dgate = dout * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
        tl.store(dgate_ptr + offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
        tl.store(dup_ptr + offsets, (dout * silu).to(dup_ptr.dtype.element_ty), mask=mask)


def _block(numel: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK, num_warps)``: 1k elements per program on a GPU, up to 64k in the interpreter (one numpy call per
    tile operation, so fewer, larger programs run faster)."""
    return (1024, 4) if device.type == "cuda" else (min(65536, triton.next_power_of_2(max(numel, 1))), 4)


def _forward_triton(gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    numel = gate.numel()
    block, num_warps = _block(numel, gate.device)
    _swiglu_forward_kernel[(triton.cdiv(numel, block) or 1,)](gate, up, out, numel, BLOCK=block, num_warps=num_warps)
    return out


def _backward_triton(dout, gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    numel = gate.numel()
    block, num_warps = _block(numel, gate.device)
    _swiglu_backward_kernel[(triton.cdiv(numel, block) or 1,)](
        dout.contiguous(), gate, up, dgate, dup, numel, BLOCK=block, num_warps=num_warps
    )
    return dgate, dup


def _backward_torch(dout, gate, up):
    """The Triton kernel's formulas in torch ops, fp32 math."""
    dout32, gate32, up32 = dout.float(), gate.float(), up.float()
    sigmoid = torch.sigmoid(gate32)
    # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    dgate = dout32 * up32 * sigmoid * (1.0 + gate32 * (1.0 - sigmoid))
    dup = dout32 * gate32 * sigmoid
    return dgate.to(gate.dtype).contiguous(), dup.to(up.dtype).contiguous()


@torch.library.custom_op("colo::swiglu", mutates_args=(), schema="(Tensor gate, Tensor up, str backend) -> Tensor")
def _swiglu_op(gate, up, backend):
    """``silu(gate) * up``."""
    return _swiglu_forward(gate, up, backend)


def _swiglu_forward(gate, up, backend):
    """The body of ``colo::swiglu`` (and of its eager fast path)."""
    if op_backend(backend, gate, up) == "triton":
        return _forward_triton(gate, up)
    return swiglu_reference(gate, up).contiguous()


@_swiglu_op.register_fake
def _(gate, up, backend):
    return gate.new_empty(gate.shape)


@torch.library.custom_op(
    "colo::swiglu_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor gate, Tensor up, str backend) -> (Tensor, Tensor)",
)
def _swiglu_backward_op(dout, gate, up, backend):
    """``(dgate, dup)``; the sigmoid is recomputed, not saved."""
    return _swiglu_backward(dout, gate, up, backend)


def _swiglu_backward(dout, gate, up, backend):
    """The body of ``colo::swiglu_backward`` (and of its eager fast path)."""
    if op_backend(backend, gate, up) == "triton":
        return _backward_triton(dout, gate, up)
    return _backward_torch(dout, gate, up)


@_swiglu_backward_op.register_fake
def _(dout, gate, up, backend):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    gate, up, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(gate, up)


def _backward(ctx, dout):
    gate, up = ctx.saved_tensors
    backward = _swiglu_backward if eager_fast_path(dout, gate) else torch.ops.colo.swiglu_backward
    dgate, dup = backward(dout, gate, up, ctx.backend)
    return dgate, dup, None


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)
_SwiGLUEager = eager_function("_SwiGLUEager", _swiglu_forward, _setup_context, _backward)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU in torch ops (the reference for the Triton kernel); same arguments and result as `swiglu`."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """The SwiGLU gate, ``silu(gate) * up`` with ``silu(g) = g * sigmoid(g)``, elementwise.

    ``gate`` and ``up`` are the two halves of the MLP's input projection (``w1 x`` and ``w3 x`` in Llama). Math is
    in fp32, rounded once to ``gate.dtype``.

    Paper: Shazeer, "GLU Variants Improve Transformer", 2020.

    Args:
        gate (torch.Tensor): the gate projection, any shape.
        up (torch.Tensor): the up projection, same shape and dtype as ``gate``.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; ``None`` follows `use_backend` and
            ``COLO_KERNELS``. Default: ``None``.

    Returns:
        torch.Tensor: ``silu(gate) * up``, shaped and typed like ``gate``.

    Raises:
        ValueError: if ``gate`` and ``up`` differ in shape or dtype.
        UnsupportedKernelInput: on the Triton path, for dtypes other than fp32/bf16/fp16.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match"
        )
    backend = resolve_backend("swiglu", gate, up, backend=backend)
    if backend == "triton":
        check_triton_dtypes("swiglu", gate=gate)
    if eager_fast_path(gate, up):
        return _SwiGLUEager.call(gate, up, backend)
    return torch.ops.colo.swiglu(gate, up, backend)
