"""Fused multi-tensor AdamW (Loshchilov & Hutter, 2019), in place, with the semantics of `torch.optim.AdamW`.

`fused_adamw` updates a list of parameters and their fp32 moments; `adamw_reference` is the same update in torch
ops; `FusedAdamW` is a `torch.optim.Optimizer` built on `fused_adamw`.

Multi-tensor launch: the tensors are grouped by (param dtype, grad dtype), and each group is one kernel launch.
The launch gets a table of the tensors' addresses (param, grad, exp_avg, exp_avg_sq) and numels, and a table of
chunks (tensor index, chunk index within the tensor) built on the device; program ``i`` updates ``BLOCK``
elements of chunk ``i``, casting its tensor's addresses to typed pointers. So a model with hundreds of
parameters costs one launch per dtype pair, not one per tensor, and nothing is copied into a flat buffer. Either
backend runs as the operator ``torch.ops.colo.fused_adamw``, which mutates its params and moments in place.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from .dispatch import TRITON_DTYPES, UnsupportedKernelInput, op_backend, resolve_backend
from .tuning import tuned_config

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency; the reference still works without it
    triton = None

if triton is not None:

    @triton.jit
    def _adamw_update(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, numel, beta1, beta2, eps, decay_factor, step_size,
        bias_correction2_sqrt, MASKED: tl.constexpr,
    ):  # fmt: skip
        """The AdamW update of ``offsets`` of one tensor; without MASKED every offset is inside the tensor."""
        if MASKED:
            mask = offsets < numel
            param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
            exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
        else:
            param = tl.load(param_ptr + offsets).to(tl.float32)
            grad = tl.load(grad_ptr + offsets).to(tl.float32)
            exp_avg = tl.load(exp_avg_ptr + offsets)
            exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets)

        param = param * decay_factor  # decoupled weight decay: p *= 1 - lr * weight_decay
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denominator = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = (param - step_size * exp_avg / denominator).to(param_ptr.dtype.element_ty)

        if MASKED:
            tl.store(param_ptr + offsets, param, mask=mask)
            tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
            tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        else:
            tl.store(param_ptr + offsets, param)
            tl.store(exp_avg_ptr + offsets, exp_avg)
            tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq)

    @triton.jit
    def _adamw_kernel(
        param_addrs_ptr,
        grad_addrs_ptr,
        exp_avg_addrs_ptr,
        exp_avg_sq_addrs_ptr,
        numels_ptr,
        chunk_tensor_ptr,
        chunk_index_ptr,
        param_like_ptr,
        grad_like_ptr,
        state_like_ptr,
        beta1,
        beta2,
        eps,
        decay_factor,
        step_size,
        bias_correction2_sqrt,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        """Program ``i`` updates chunk ``i``: BLOCK elements of one tensor. A chunk wholly inside its tensor runs
        without masks; ALIGNED (every address 16-byte aligned, checked on the host) lets loads be vectorized."""
        chunk = tl.program_id(0)
        tensor = tl.load(chunk_tensor_ptr + chunk)
        start = tl.load(chunk_index_ptr + chunk).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        numel = tl.load(numels_ptr + tensor)
        # the *_like pointers are first tensors of the group: they only give the element types to cast to
        param_ptr = tl.load(param_addrs_ptr + tensor).to(param_like_ptr.dtype)
        grad_ptr = tl.load(grad_addrs_ptr + tensor).to(grad_like_ptr.dtype)
        exp_avg_ptr = tl.load(exp_avg_addrs_ptr + tensor).to(state_like_ptr.dtype)
        exp_avg_sq_ptr = tl.load(exp_avg_sq_addrs_ptr + tensor).to(state_like_ptr.dtype)
        if ALIGNED:
            param_ptr = tl.multiple_of(param_ptr, 16)
            grad_ptr = tl.multiple_of(grad_ptr, 16)
            exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
            exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)
        if start + BLOCK <= numel:
            _adamw_update(
                param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, numel, beta1, beta2, eps, decay_factor,
                step_size, bias_correction2_sqrt, False,
            )  # fmt: skip
        else:
            _adamw_update(
                param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, numel, beta1, beta2, eps, decay_factor,
                step_size, bias_correction2_sqrt, True,
            )  # fmt: skip


def _launch_group(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    scalars: dict[str, float],
) -> None:
    """One launch of `_adamw_kernel` over tensors that share a device, a param dtype and a grad dtype.

    The kernel reads the tensors' addresses from a table, so the compiler cannot know their alignment: when every
    address is 16-byte aligned (checked here) it is told so, and the loads and stores of full chunks become 128-bit
    (scalar 32-bit otherwise: PTX for sm_90 shows 0 vs 16 ``ld.global.v4`` per program at BLOCK 4096). On a GPU
    the chunk size and warps are 4096 and 8 unless `colo.kernels.tuning` has a measured ``adamw`` entry for the
    architecture (``BLOCK``, ``num_warps``, ``aligned_hint``)."""
    device = params[0].device
    numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
    aligned_hint = True
    if device.type == "cuda":
        block, num_warps = 4096, 8
        tuned = tuned_config("adamw", device) or {}
        block, num_warps = int(tuned.get("BLOCK", block)), int(tuned.get("num_warps", num_warps))
        aligned_hint = bool(tuned.get("aligned_hint", True))
    else:  # interpreter: one numpy call per tile operation, so fewer, larger programs run faster
        block, num_warps = min(65536, triton.next_power_of_2(int(numels.max()))), 4
    chunks_per_tensor = (numels + block - 1) // block
    num_chunks = int(chunks_per_tensor.sum())
    if num_chunks == 0:
        return
    pointers = [[t.data_ptr() for t in tensors] for tensors in (params, grads, exp_avgs, exp_avg_sqs)]
    aligned = aligned_hint and all(address % 16 == 0 for row in pointers for address in row)
    tables = torch.cat((torch.tensor(pointers, dtype=torch.int64), numels[None, :], chunks_per_tensor[None, :]))
    tables = tables.to(device, non_blocking=True)
    numels, chunks_per_tensor = tables[4], tables[5]
    chunk_tensor = torch.repeat_interleave(
        torch.arange(len(params), device=device), chunks_per_tensor, output_size=num_chunks
    )
    chunk_starts = torch.cumsum(chunks_per_tensor, 0) - chunks_per_tensor
    chunk_index = torch.arange(num_chunks, device=device) - chunk_starts[chunk_tensor]
    _adamw_kernel[(num_chunks,)](
        tables[0], tables[1], tables[2], tables[3], numels, chunk_tensor, chunk_index,
        params[0], grads[0], exp_avgs[0], **scalars, BLOCK=block, ALIGNED=aligned, num_warps=num_warps,
    )  # fmt: skip


def _check_lists(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
) -> None:
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(
            f"fused_adamw: got {len(params)} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs and "
            f"{len(exp_avg_sqs)} exp_avg_sqs; pass one of each per parameter"
        )
    for index, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not p.shape == g.shape == m.shape == v.shape:
            raise ValueError(
                f"fused_adamw: tensor {index}: param {tuple(p.shape)}, grad {tuple(g.shape)}, exp_avg "
                f"{tuple(m.shape)} and exp_avg_sq {tuple(v.shape)} must have the same shape"
            )


def _check_triton_inputs(params, grads, exp_avgs, exp_avg_sqs) -> None:
    for index, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if p.dtype not in TRITON_DTYPES or g.dtype not in TRITON_DTYPES:
            raise UnsupportedKernelInput(
                f"fused_adamw: tensor {index}: the Triton kernel takes fp32/bf16/fp16 params and grads, got "
                f"{p.dtype} and {g.dtype}; use backend='torch'"
            )
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            raise UnsupportedKernelInput(
                f"fused_adamw: tensor {index}: the Triton kernel keeps exp_avg and exp_avg_sq in float32, got "
                f"{m.dtype} and {v.dtype}"
            )
        if not all(t.is_contiguous() for t in (p, g, m, v)):
            raise UnsupportedKernelInput(
                f"fused_adamw: tensor {index}: the Triton kernel updates contiguous tensors in place; "
                "use backend='torch' for strided ones"
            )
        if not p.device == g.device == m.device == v.device:
            raise UnsupportedKernelInput(
                f"fused_adamw: tensor {index}: param, grad and states are on different devices"
            )


@torch.no_grad()
def adamw_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> None:
    """The AdamW update in torch ops (the reference for the Triton kernel); same arguments as `fused_adamw`."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        param32, grad32 = param.float(), grad.float()
        param32 = param32 * (1.0 - lr * weight_decay)
        exp_avg.mul_(beta1).add_(grad32, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad32, grad32, value=1.0 - beta2)
        denominator = (exp_avg_sq.float().sqrt() / bias_correction2_sqrt).add_(eps)
        param.copy_(param32.addcdiv_(exp_avg.float(), denominator, value=-lr / bias_correction1))


def fused_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    backend: str | None = None,
) -> None:
    """One AdamW step over many tensors, in place, as `torch.optim.AdamW` computes it.

    For each parameter ``p`` with gradient ``g``: ``p *= 1 - lr * weight_decay`` (decoupled weight decay);
    ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g**2``;
    ``p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)``. Math is in fp32; parameters
    (fp32, bf16 or fp16) are stored back in their own dtype, moments stay fp32. On the Triton path all tensors
    sharing a (param dtype, grad dtype) pair are updated by one kernel launch (see the module docstring).

    Paper: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019.

    Args:
        params (Sequence[torch.Tensor]): parameters, updated in place.
        grads (Sequence[torch.Tensor]): their gradients, one per parameter, same shape.
        exp_avgs (Sequence[torch.Tensor]): first moments (fp32 on the Triton path), updated in place.
        exp_avg_sqs (Sequence[torch.Tensor]): second moments (fp32 on the Triton path), updated in place.
        step (int): the step number after this update, starting at 1 (for bias correction).
        lr (float): learning rate.
        beta1 (float): first-moment decay. Default: ``0.9``.
        beta2 (float): second-moment decay. Default: ``0.999``.
        eps (float): added to the bias-corrected ``sqrt(v)``. Default: ``1e-8``.
        weight_decay (float): decoupled weight decay coefficient. Default: ``0.0``.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; ``None`` follows `use_backend` and
            ``COLO_KERNELS``. Default: ``None``.

    Raises:
        ValueError: on lists of different lengths, mismatched shapes or ``step < 1``.
        UnsupportedKernelInput: on the Triton path, for non-fp32 moments, other param dtypes, strided tensors or
            tensors of one parameter on different devices.
    """
    _check_lists(params, grads, exp_avgs, exp_avg_sqs)
    if step < 1:
        raise ValueError(f"fused_adamw: step={step}; it counts updates and starts at 1")
    if not params:
        return
    backend = resolve_backend("fused_adamw", *params, *grads, *exp_avgs, *exp_avg_sqs, backend=backend)
    if backend == "triton":
        _check_triton_inputs(params, grads, exp_avgs, exp_avg_sqs)
    torch.ops.colo.fused_adamw(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), int(step), float(lr), float(beta1),
        float(beta2), float(eps), float(weight_decay), backend,
    )  # fmt: skip


@torch.library.custom_op(
    "colo::fused_adamw",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs"),
    schema="(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, int step, "
    "float lr, float beta1, float beta2, float eps, float weight_decay, str backend) -> ()",
)
def _fused_adamw_op(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, backend):
    """One AdamW step, in place on ``params``, ``exp_avgs`` and ``exp_avg_sqs``."""
    if not params:
        return
    if op_backend(backend, *params, *grads, *exp_avgs, *exp_avg_sqs) == "torch":
        adamw_reference(
            params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay,
        )  # fmt: skip
        return
    scalars = {
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(eps),
        "decay_factor": 1.0 - float(lr) * float(weight_decay),
        "step_size": float(lr) / (1.0 - beta1**step),
        "bias_correction2_sqrt": math.sqrt(1.0 - beta2**step),
    }
    groups: dict[tuple, tuple[list, list, list, list]] = defaultdict(lambda: ([], [], [], []))
    for tensors in zip(params, grads, exp_avgs, exp_avg_sqs):
        group = groups[(tensors[0].device, tensors[0].dtype, tensors[1].dtype)]
        for members, tensor in zip(group, tensors):
            members.append(tensor)
    with torch.no_grad():
        for group in groups.values():
            _launch_group(*group, scalars)


@_fused_adamw_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, backend):
    return None


class FusedAdamW(torch.optim.Optimizer):
    """AdamW whose step is one `fused_adamw` call per parameter group (Loshchilov & Hutter, 2019).

    Same hyperparameters and update as `torch.optim.AdamW` (no ``amsgrad``, ``maximize`` or ``capturable``);
    moments are kept in fp32 whatever the parameter dtype, under the same state keys as torch
    (``step``, ``exp_avg``, ``exp_avg_sq``).

    Args:
        params (Iterable): parameters or parameter groups, as for any optimizer.
        lr (float): learning rate. Default: ``1e-3``.
        betas (tuple[float, float]): ``(beta1, beta2)``. Default: ``(0.9, 0.999)``.
        eps (float): added to the bias-corrected ``sqrt(v)``. Default: ``1e-8``.
        weight_decay (float): decoupled weight decay coefficient. Default: ``1e-2`` (torch's default).
        backend (str | None): kernel backend for every step; ``None`` follows `use_backend` and ``COLO_KERNELS``.
            Default: ``None``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        backend: str | None = None,
    ):
        if lr < 0.0:
            raise ValueError(f"FusedAdamW: lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"FusedAdamW: betas={betas} must each be in [0, 1)")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"FusedAdamW: eps={eps} and weight_decay={weight_decay} must be >= 0")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.backend = backend

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that has a gradient; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_step: dict[int, tuple[list, list, list, list]] = defaultdict(lambda: ([], [], [], []))
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("FusedAdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(
                        param, dtype=torch.float32, memory_format=torch.contiguous_format
                    )
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, dtype=torch.float32, memory_format=torch.contiguous_format
                    )
                state["step"] += 1
                lists = by_step[int(state["step"].item())]  # parameters added to the group later lag behind
                for members, tensor in zip(lists, (param, param.grad, state["exp_avg"], state["exp_avg_sq"])):
                    members.append(tensor)
            beta1, beta2 = group["betas"]
            for step, (params, grads, exp_avgs, exp_avg_sqs) in by_step.items():
                fused_adamw(
                    params, grads, exp_avgs, exp_avg_sqs, step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], backend=self.backend,
                )  # fmt: skip
        return loss
