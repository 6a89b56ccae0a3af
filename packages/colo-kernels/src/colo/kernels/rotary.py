"""Rotary position embedding (RoPE, Su et al. 2021) in the Llama / Hugging Face "rotate_half" convention.

A head vector ``x = [x1, x2]`` (two halves of ``head_dim / 2``) at position ``p`` becomes
``[x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2]`` where ``cos = [cos1, cos2]`` and ``sin = [sin1, sin2]`` are row
``p`` of the tables (Hugging Face builds them as ``cat(freqs, freqs)``, so the halves are equal and this is a
rotation of each pair ``(x1[i], x2[i])`` by ``theta_i * p``). The backward is the transpose: a rotation by
``-theta``.

The Triton kernel treats q (or k) as rows of ``head_dim`` elements, one row per (batch, position, head), and
rotates ``ROWS`` rows per program; q and k are two launches because GQA gives them different head counts. Either
backend runs as the operator ``torch.ops.colo.rotary``, whose backward is the same operator with ``inverse=True``.
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
    def _rotary_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        y_ptr,
        n_rows,
        n_heads,
        seq_len,
        position_offset,
        half_dim,
        INVERSE: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_HALF)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & (cols < half_dim)[None, :]
        head_dim = 2 * half_dim
        positions = (rows // n_heads) % seq_len + position_offset
        x_offsets = rows.to(tl.int64)[:, None] * head_dim + cols[None, :]
        table_offsets = positions.to(tl.int64)[:, None] * head_dim + cols[None, :]

        x1 = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_offsets + half_dim, mask=mask, other=0.0).to(tl.float32)
        cos1 = tl.load(cos_ptr + table_offsets, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + table_offsets + half_dim, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + table_offsets, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + table_offsets + half_dim, mask=mask, other=0.0).to(tl.float32)
        if INVERSE:
            # transpose of the forward map [x1*c1 - x2*s1, x2*c2 + x1*s2]: the gradient, a rotation by -theta
            y1 = x1 * cos1 + x2 * sin2
            y2 = x2 * cos2 - x1 * sin1
        else:
            y1 = x1 * cos1 - x2 * sin1
            y2 = x2 * cos2 + x1 * sin2
        tl.store(y_ptr + x_offsets, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + x_offsets + half_dim, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int, inverse: bool) -> torch.Tensor:
    """Launch `_rotary_kernel` on a contiguous ``(batch, seq, heads, head_dim)`` tensor."""
    batch, seq_len, n_heads, head_dim = x.shape
    n_rows = batch * seq_len * n_heads
    block_half = triton.next_power_of_2(head_dim // 2)
    if x.device.type == "cuda":
        rows, num_warps = max(1, 2048 // block_half), 4
    else:  # interpreter: one numpy call per tile operation, so take large tiles
        rows, num_warps = min(triton.next_power_of_2(max(n_rows, 1)), max(1, 16384 // block_half)), 4
    y = torch.empty_like(x)
    _rotary_kernel[(triton.cdiv(n_rows, rows) or 1,)](
        x, cos, sin, y, n_rows, n_heads, seq_len, position_offset, head_dim // 2,
        INVERSE=inverse, BLOCK_HALF=block_half, ROWS=rows, num_warps=num_warps,
    )  # fmt: skip
    return y


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_offset: int, inverse: bool):
    """`_rotary_kernel` in torch ops: ``[x1 c1 - x2 s1, x2 c2 + x1 s2]``, or its transpose with ``inverse``."""
    seq_len = x.shape[1]
    cos = cos[position_offset : position_offset + seq_len].float()[None, :, None, :]
    sin = sin[position_offset : position_offset + seq_len].float()[None, :, None, :]
    x32 = x.float()
    if not inverse:
        return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype).contiguous()
    x1, x2 = x32.chunk(2, dim=-1)
    cos1, cos2 = cos.chunk(2, dim=-1)
    sin1, sin2 = sin.chunk(2, dim=-1)
    return torch.cat((x1 * cos1 + x2 * sin2, x2 * cos2 - x1 * sin1), dim=-1).to(x.dtype)


@torch.library.custom_op(
    "colo::rotary",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor cos, Tensor sin, int position_offset, bool inverse, str backend) "
    "-> (Tensor, Tensor)",
)
def _rotary_op(q, k, cos, sin, position_offset, inverse, backend):
    """``(q_rot, k_rot)``; with ``inverse`` the transposed rotation (by ``-theta``), which is the backward."""
    return _rotary_forward(q, k, cos, sin, position_offset, inverse, backend)


def _rotary_forward(q, k, cos, sin, position_offset, inverse, backend):
    """The body of ``colo::rotary`` (and of its eager fast path)."""
    if op_backend(backend, q, k, cos, sin) == "triton":
        cos, sin = cos.contiguous(), sin.contiguous()
        return (
            _rotate(q.contiguous(), cos, sin, position_offset, inverse=inverse),
            _rotate(k.contiguous(), cos, sin, position_offset, inverse=inverse),
        )
    return _rotate_torch(q, cos, sin, position_offset, inverse), _rotate_torch(k, cos, sin, position_offset, inverse)


@_rotary_op.register_fake
def _(q, k, cos, sin, position_offset, inverse, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin, position_offset, inverse, backend = inputs
    ctx.position_offset, ctx.inverse, ctx.backend = position_offset, inverse, backend
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq_rot, dk_rot):
    cos, sin = ctx.saved_tensors
    rotate = _rotary_forward if eager_fast_path(dq_rot, dk_rot) else torch.ops.colo.rotary
    dq, dk = rotate(
        dq_rot, dk_rot, cos, sin, ctx.position_offset, not ctx.inverse, ctx.backend
    )  # the transposed rotation; autograd passes zeros for an output that got no gradient
    return dq, dk, None, None, None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)
_RotaryEager = eager_function("_RotaryEager", _rotary_forward, _setup_context, _backward)


def rotary_cos_sin(
    seq_len: int,
    head_dim: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cos`` and ``sin`` tables `rotary` reads, built as Hugging Face Llama builds them.

    Args:
        seq_len (int): number of positions (rows of the tables).
        head_dim (int): size of one attention head; must be even.
        base (float): RoPE base; frequency ``i`` is ``base ** (-2i / head_dim)``. Default: ``10000.0``.
        dtype (torch.dtype): dtype of the tables (computed in fp32 first). Default: ``torch.float32``.
        device (torch.device | str | None): where to build them. Default: ``None`` (the current default device).

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(cos, sin)``, each ``(seq_len, head_dim)`` with the two halves of
        every row equal (``cat(freqs, freqs)``).
    """
    if head_dim % 2:
        raise ValueError(f"rotary_cos_sin: head_dim={head_dim} must be even")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, position_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in torch ops (the reference for the Triton kernel); same arguments and results as `rotary`."""
    seq_len = q.shape[1]
    cos = cos[position_offset : position_offset + seq_len].float()[None, :, None, :]
    sin = sin[position_offset : position_offset + seq_len].float()[None, :, None, :]
    q32, k32 = q.float(), k.float()
    q_rot = q32 * cos + _rotate_half(q32) * sin
    k_rot = k32 * cos + _rotate_half(k32) * sin
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_offset: int = 0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embeddings to queries and keys (``rotate_half`` convention, as Llama).

    Position ``s`` of the sequence uses row ``position_offset + s`` of ``cos`` and ``sin``, so a decoding step or
    a sequence-parallel shard passes the absolute position of its first token. Math is in fp32, rounded once to
    the dtype of q (and k). Gradients flow to q and k; ``cos`` and ``sin`` are constant tables and get none.

    Paper: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.

    Args:
        q (torch.Tensor): queries ``(batch, seq, q_heads, head_dim)``; ``head_dim`` even.
        k (torch.Tensor): keys ``(batch, seq, kv_heads, head_dim)``; ``kv_heads`` may differ from ``q_heads`` (GQA).
        cos (torch.Tensor): ``(max_seq, head_dim)`` table, e.g. from `rotary_cos_sin`.
        sin (torch.Tensor): ``(max_seq, head_dim)`` table.
        position_offset (int): absolute position of the first token. Default: ``0``.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; ``None`` follows `use_backend` and
            ``COLO_KERNELS``. Default: ``None``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(q_rot, k_rot)``, shaped and typed like ``q`` and ``k``.

    Raises:
        ValueError: on mismatched shapes or positions past the end of the tables.
        UnsupportedKernelInput: on the Triton path, for dtypes other than fp32/bf16/fp16.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be (batch, seq, heads, head_dim) with equal "
            "batch, seq and head_dim"
        )
    head_dim, seq_len = q.shape[-1], q.shape[1]
    if head_dim % 2:
        raise ValueError(f"rotary: head_dim={head_dim} must be even")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[-1] != head_dim:
        raise ValueError(
            f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be (max_seq, {head_dim})"
        )
    if position_offset < 0 or position_offset + seq_len > cos.shape[0]:
        raise ValueError(
            f"rotary: positions [{position_offset}, {position_offset + seq_len}) fall outside the {cos.shape[0]} "
            "rows of cos/sin; build longer tables with rotary_cos_sin"
        )
    backend = resolve_backend("rotary", q, k, cos, sin, backend=backend)
    if backend == "triton":
        check_triton_dtypes("rotary", q=q, k=k, cos=cos, sin=sin)
    if eager_fast_path(q, k, cos, sin):
        return _RotaryEager.call(q, k, cos, sin, int(position_offset), False, backend)
    return torch.ops.colo.rotary(q, k, cos, sin, int(position_offset), False, backend)
