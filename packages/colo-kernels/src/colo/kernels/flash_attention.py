"""Attention with online softmax (FlashAttention-2, Dao, 2023), grouped-query heads, and its ring-attention block step.

Layout is ``(batch, seq, heads, head_dim)`` for q, k, v and the output. ``heads_q`` must be a multiple of
``heads_kv``: query head ``h`` reads kv head ``h // (heads_q // heads_kv)`` (the ``repeat_interleave``
convention of grouped-query attention). Causal masking is bottom-right aligned: query ``i`` sees key ``j`` when
``j <= i + seq_k - seq_q``, so with ``seq_q > seq_k`` the first rows see no key at all; such rows give an output of 0
and a logsumexp of ``-inf``.

Triton kernels: the forward gives a program one block of queries of one head, streams key/value blocks with an
online softmax and saves the output and the row logsumexp (LSE). The backward recomputes the probabilities from the
LSE: a small kernel computes ``delta = rowsum(dout * out)``, one kernel accumulates dk/dv per key block (looping
over the query heads that share the kv head, so grouped-query sums need no atomics), another accumulates dq per
query block. Tiles are loaded in the input dtype and computed in fp32; on a GPU, 16-bit inputs feed ``tl.dot`` in
their own dtype with fp32 accumulation, as FlashAttention does. Each kernel visits first the interior blocks (every
query of the block sees every key: no mask is built or applied) and then the edge blocks (the causal diagonal, the
end of the sequence, documents), masked. Block sizes, warps and pipeline stages are chosen per kernel
(`_launch_config`), from `colo.kernels.tuning`'s measured table on GPUs that have entries.

Document masking (`colo.kernels.document_mask`): every op takes ``document_ids`` (non-decreasing per row, padding an
id of its own), optional ``query_document_ids`` and per-row ``kv_offsets``; a query attends only to keys of its own
document (causally, with ``causal``). The Triton kernels then visit, per block, only the key (or query) range the
documents and the causal mask leave visible, precomputed on the host with ``searchsorted``.

Both backends run as two operators: ``torch.ops.colo.flash_attention`` returns ``(out, lse)`` and
``torch.ops.colo.flash_attention_backward`` the gradients from them; `flash_attention` registers the second as the
first's backward, and the ring-attention block step below calls them directly.

`attention_block_forward` / `attention_block_backward` expose one block of a ring-attention step: the forward
returns the block's ``(out, lse)`` for the caller to merge across blocks, and the backward takes the *merged*
``out`` and global ``lse``, so summing its per-block results gives the gradients of the full attention.
"""

from __future__ import annotations

import math
import os

import torch

from .dispatch import (
    UnsupportedKernelInput,
    check_triton_dtypes,
    interpreter_enabled,
    op_backend,
    requested_backend,
    resolve_backend,
)
from .document_mask import (
    DocumentMask,
    block_counter,
    dense_mask,
    document_mask_inputs,
    key_block_ranges,
    query_block_ranges,
    record_blocks,
    shared_document_mask,
)
from .tuning import tuned_config

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency; the reference still works without it
    triton = None

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------


def _check_shapes(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate the (batch, seq, heads, head_dim) layout and grouped-query heads; return heads_q // heads_kv."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{op}: q, k and v must be 4-D (batch, seq, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3)"
        )
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"{op}: heads_q={heads_q} is not a multiple of heads_kv={heads_kv}; grouped-query attention needs "
            "each kv head shared by the same number of query heads"
        )
    return heads_q // heads_kv


def _check_triton_inputs(op: str, **tensors: torch.Tensor) -> None:
    """Raise `UnsupportedKernelInput` for dtypes or head sizes the Triton kernels do not take."""
    dtypes = {t.dtype for t in tensors.values()}
    check_triton_dtypes(op, **tensors)
    if len(dtypes) > 1:
        raise UnsupportedKernelInput(
            f"{op}: the Triton kernel needs one dtype for {', '.join(tensors)}; got "
            + ", ".join(f"{name}={t.dtype}" for name, t in tensors.items())
        )
    head_dim = next(iter(tensors.values())).shape[-1]
    if head_dim not in (16, 32, 64, 128):
        raise UnsupportedKernelInput(
            f"{op}: the Triton kernel supports head_dim 16, 32, 64 or 128; got head_dim={head_dim} "
            "(pad the heads, or use backend='torch')"
        )


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# ----------------------------------------------------------------------------------------------------------------
# Torch implementations
# ----------------------------------------------------------------------------------------------------------------


def _causal_mask(seq_q: int, seq_k: int, device: torch.device) -> torch.Tensor:
    """``(seq_q, seq_k)`` bool mask, True where query i may attend key j (bottom-right aligned)."""
    rows = torch.arange(seq_q, device=device).unsqueeze(1)
    cols = torch.arange(seq_k, device=device).unsqueeze(0)
    return cols <= rows + (seq_k - seq_q)


def _scores_fp32(q, k, group, causal, scale, documents=None):
    """fp32 ``(batch, heads_q, seq_q, seq_k)`` scaled scores and the visibility mask (or None): ``(seq_q, seq_k)``
    causal, or ``(batch, 1, seq_q, seq_k)`` with a `DocumentMask`."""
    k32 = k.float().repeat_interleave(group, dim=2) if group > 1 else k.float()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k32) * scale
    if documents is not None:
        mask = dense_mask(documents, causal, q.shape[1], k.shape[1])
    else:
        mask = _causal_mask(q.shape[1], k.shape[1], q.device) if causal else None
    return scores, mask


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    document_ids: torch.Tensor | DocumentMask | None = None,
    query_document_ids: torch.Tensor | None = None,
    kv_offsets: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Attention as an explicit ``softmax(q @ k.T * scale) @ v`` in fp32 (autograd-aware), cast back to q's dtype.

    Args:
        q (torch.Tensor): ``(batch, seq_q, heads_q, head_dim)`` queries.
        k (torch.Tensor): ``(batch, seq_k, heads_kv, head_dim)`` keys; ``heads_q`` a multiple of ``heads_kv``.
        v (torch.Tensor): values, shaped like ``k``.
        causal (bool): bottom-right aligned causal mask. Default: False.
        scale (float | None): score scale; None means ``1 / sqrt(head_dim)``. Default: None.
        document_ids, query_document_ids, kv_offsets: the document mask, as in `flash_attention` (a
            `DocumentMask` too). Default: None.

    Returns:
        torch.Tensor: ``(batch, seq_q, heads_q, head_dim)``; rows that see no key are 0.
    """
    group = _check_shapes("flash_attention_reference", q, k, v)
    documents = document_mask_inputs(
        "flash_attention_reference", q, k, document_ids=document_ids, query_document_ids=query_document_ids,
        kv_offsets=kv_offsets,
    )  # fmt: skip
    return _reference_attention(q, k, v, group, causal, _default_scale(q, scale), documents)


def _reference_attention(q, k, v, group, causal, scale, documents):
    """`flash_attention_reference` on validated inputs."""
    scores, mask = _scores_fp32(q, k, group, causal, scale, documents)
    if mask is not None:
        # finfo.min rather than -inf keeps fully masked rows finite (uniform, then zeroed by the mask), gradients too
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs * mask
    v32 = v.float().repeat_interleave(group, dim=2) if group > 1 else v.float()
    return torch.einsum("bhqk,bkhd->bqhd", probs, v32).to(q.dtype)


def _block_backward_torch(dout, q, k, v, out, lse, causal, scale, documents=None):
    """Torch ``(dq, dk, dv)`` of one attention block given the (merged) ``out`` and (global) ``lse``."""
    batch, seq_k, heads_kv, head_dim = k.shape
    group = q.shape[2] // heads_kv
    scores, mask = _scores_fp32(q, k, group, causal, scale, documents)
    # lse = -inf marks a row that sees no key anywhere: +inf makes its probabilities exactly 0
    lse = torch.where(lse == float("-inf"), float("inf"), lse.float())
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if mask is not None:
        probs = probs.masked_fill(~mask, 0.0)
    dout32, q32 = dout.float(), q.float()
    k32 = k.float().repeat_interleave(group, dim=2) if group > 1 else k.float()
    v32 = v.float().repeat_interleave(group, dim=2) if group > 1 else v.float()
    delta = (dout32 * out.float()).sum(-1).transpose(1, 2)  # (batch, heads_q, seq_q)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dout32, v32)
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, k32)
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q32)
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout32)
    dk = dk.view(batch, seq_k, heads_kv, group, head_dim).sum(3)
    dv = dv.view(batch, seq_k, heads_kv, group, head_dim).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _dot(a, b, NATIVE_DOT: tl.constexpr):
        """``a @ b`` with an fp32 result. ``b`` is always a tile loaded from memory (the input dtype).

        NATIVE_DOT (GPU, 16-bit inputs): ``a`` is cast to ``b``'s dtype and the dot runs on tensor cores with fp32
        accumulation. Otherwise both operands are fp32 and the dot is exact fp32 (the interpreter's 16-bit dot is
        inaccurate, and fp32 inputs should not silently drop to tf32).
        """
        if NATIVE_DOT:
            result = tl.dot(a.to(b.dtype), b)
        else:
            result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return result

    @triton.jit
    def _row_setup(
        ranges_ptr,
        offsets_ptr,
        batch,
        block,
        num_blocks,
        default_begin,
        default_end,
        default_diagonal,
        VARLEN: tl.constexpr,
    ):
        """``(begin, end, diagonal)`` of one program: the positions it visits and the causal offset of its row."""
        # one type on both branches (the compiler refuses int64 offsets beside the int32 defaults)
        if VARLEN:
            base = ranges_ptr + (batch * num_blocks + block) * 2
            return tl.load(base).to(tl.int32), tl.load(base + 1).to(tl.int32), tl.load(offsets_ptr + batch).to(tl.int32)
        return default_begin, default_end, default_diagonal

    @triton.jit
    def _visible(rows, cols, seq_q, seq_k, diagonal, q_docs, k_docs, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
        """``(BLOCK_M, BLOCK_N)`` bool: query ``rows[i]`` may attend key ``cols[j]``."""
        visible = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + diagonal)
        if VARLEN:
            visible = visible & (q_docs[:, None] == k_docs[None, :])
        return visible

    @triton.jit
    def _interior_key_end(
        begin_n, start_m, seq_k, diagonal, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """End of the key blocks from ``begin_n`` that every query of the block at ``start_m`` sees whole: no causal
        edge, no sequence end, no document mask (those blocks run without a mask); ``begin_n`` with documents."""
        if VARLEN:
            interior_end = begin_n
        else:
            full_end = seq_k
            if CAUSAL:  # query start_m sees keys up to start_m + diagonal, and every later query sees them too
                full_end = tl.minimum(tl.maximum(start_m + diagonal + 1, 0), seq_k)
            interior_end = (full_end // BLOCK_N) * BLOCK_N  # begin_n is 0 without documents
        return interior_end

    @triton.jit
    def _forward_step(
        acc,
        row_sum,
        row_max,
        q,
        k_base,
        v_base,
        k_docs_ptr,
        q_docs,
        rows,
        cols,
        offs_d,
        kv_row_stride,
        batch,
        seq_q,
        seq_k,
        diagonal,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        MASKED: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
    ):
        """One key block of the online softmax: ``(acc, row_sum, row_max)`` updated. Without MASKED every key of
        the block is in the sequence and visible to every query (an interior block)."""
        kv_offsets = cols[:, None] * kv_row_stride + offs_d[None, :]
        if MASKED:
            col_ok = cols < seq_k
            k = tl.load(k_base + kv_offsets, mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(k_base + kv_offsets)
        scores = _dot(q, tl.trans(k), NATIVE_DOT) * qk_scale_log2
        if MASKED:
            k_docs = cols
            if VARLEN:
                k_docs = tl.load(k_docs_ptr + batch * seq_k + cols, mask=col_ok, other=0)
            visible = _visible(rows, cols, seq_q, seq_k, diagonal, q_docs, k_docs, CAUSAL, VARLEN)
            scores = tl.where(visible, scores, -float("inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # rows that have seen no visible key yet keep max -inf: subtract 0 instead so exp2 gives 0, not NaN
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)
            v = tl.load(v_base + kv_offsets, mask=col_ok[:, None], other=0.0)
        else:
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            shift = new_max
            v = tl.load(v_base + kv_offsets)
        correction = tl.exp2(row_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + _dot(probs, v, NATIVE_DOT)
        return acc, row_sum, new_max

    @triton.jit
    def _attention_forward_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        lse_ptr,
        q_docs_ptr,
        k_docs_ptr,
        offsets_ptr,
        ranges_ptr,
        count_ptr,
        seq_q,
        seq_k,
        heads_q,
        heads_kv,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        COUNT: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
    ):
        """One block of BLOCK_M queries of one (batch, query head): online softmax over key blocks.

        VARLEN: the document mask and per-row offsets; the program visits only the key range ``ranges_ptr`` gives
        it (the keys its documents and the causal mask leave visible), so fully masked blocks are skipped.
        """
        block_m = tl.program_id(0)
        start_m = block_m * BLOCK_M
        batch_head = tl.program_id(1)
        batch = (batch_head // heads_q).to(tl.int64)
        head = batch_head % heads_q
        kv_head = head // (heads_q // heads_kv)
        # contiguous (batch, seq, heads, head_dim): a row of q is heads_q * HEAD_DIM apart from the next
        q_base = q_ptr + (batch * seq_q * heads_q + head) * HEAD_DIM
        out_base = out_ptr + (batch * seq_q * heads_q + head) * HEAD_DIM
        k_base = k_ptr + (batch * seq_k * heads_kv + kv_head) * HEAD_DIM
        v_base = v_ptr + (batch * seq_k * heads_kv + kv_head) * HEAD_DIM
        q_row_stride = heads_q * HEAD_DIM
        kv_row_stride = heads_kv * HEAD_DIM

        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_q
        q = tl.load(q_base + offs_m[:, None] * q_row_stride + offs_d[None, :], mask=row_ok[:, None], other=0.0)

        row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)  # running max of scores, in log2 units
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        diagonal = seq_k - seq_q  # causal: key j is visible to query i when j <= i + diagonal
        end_n = seq_k
        if CAUSAL:
            end_n = tl.maximum(tl.minimum(seq_k, start_m + BLOCK_M + diagonal), 0)
        begin_n, end_n, diagonal = _row_setup(
            ranges_ptr, offsets_ptr, batch, block_m, tl.num_programs(0), 0, end_n, diagonal, VARLEN
        )
        q_docs = offs_m
        if VARLEN:
            q_docs = tl.load(q_docs_ptr + batch * seq_q + offs_m, mask=row_ok, other=0)
        num_blocks = 0
        interior_end = _interior_key_end(begin_n, start_m, seq_k, diagonal, CAUSAL, VARLEN, BLOCK_N)
        for start_n in range(begin_n, interior_end, BLOCK_N):
            acc, row_sum, row_max = _forward_step(
                acc, row_sum, row_max, q, k_base, v_base, k_docs_ptr, q_docs, offs_m, start_n + offs_n, offs_d,
                kv_row_stride, batch, seq_q, seq_k, diagonal, qk_scale_log2, CAUSAL, VARLEN, False, NATIVE_DOT,
            )  # fmt: skip
            num_blocks += 1
        for start_n in range(interior_end, end_n, BLOCK_N):
            acc, row_sum, row_max = _forward_step(
                acc, row_sum, row_max, q, k_base, v_base, k_docs_ptr, q_docs, offs_m, start_n + offs_n, offs_d,
                kv_row_stride, batch, seq_q, seq_k, diagonal, qk_scale_log2, CAUSAL, VARLEN, True, NATIVE_DOT,
            )  # fmt: skip
            num_blocks += 1
        if COUNT:
            tl.store(count_ptr + batch_head * tl.num_programs(0) + block_m, num_blocks)

        has_keys = row_sum > 0.0
        safe_sum = tl.where(has_keys, row_sum, 1.0)
        out = acc / safe_sum[:, None]
        # back from log2 units to the natural log: lse = (max + log2(sum)) * ln(2)
        lse = tl.where(has_keys, (row_max + tl.log2(safe_sum)) * 0.6931471805599453, -float("inf"))
        tl.store(
            out_base + offs_m[:, None] * q_row_stride + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
        tl.store(lse_ptr + (batch * heads_q + head) * seq_q + offs_m, lse, mask=row_ok)

    @triton.jit
    def _attention_backward_delta_kernel(
        out_ptr, dout_ptr, delta_ptr, seq_q, heads_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr
    ):
        """``delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]`` in fp32."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        batch_head = tl.program_id(1)
        batch = (batch_head // heads_q).to(tl.int64)
        head = batch_head % heads_q
        offs_d = tl.arange(0, HEAD_DIM)
        offsets = (batch * seq_q * heads_q + head) * HEAD_DIM + offs_m[:, None] * heads_q * HEAD_DIM + offs_d[None, :]
        row_ok = offs_m < seq_q
        out = tl.load(out_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(delta_ptr + (batch * heads_q + head) * seq_q + offs_m, tl.sum(out * dout, axis=1), mask=row_ok)

    @triton.jit
    def _attention_probs(q, k, lse_log2, visible, qk_scale_log2, NATIVE_DOT):
        """Recomputed ``(BLOCK_M, BLOCK_N)`` fp32 probabilities ``exp(scores - lse)``, 0 where not visible."""
        scores = _dot(q, tl.trans(k), NATIVE_DOT) * qk_scale_log2
        return tl.where(visible, tl.exp2(scores - lse_log2[:, None]), 0.0)

    @triton.jit
    def _dkdv_step(
        dk,
        dv,
        k,
        v,
        k_docs,
        q_base,
        dout_base,
        lse_row_ptr,
        delta_row_ptr,
        q_docs_ptr,
        rows,
        cols,
        offs_d,
        q_row_stride,
        batch,
        seq_q,
        seq_k,
        diagonal,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        MASKED: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
    ):
        """One query block's contribution to a key block's ``(dk, dv)``; without MASKED every query of the block
        sees every key (an interior block)."""
        row_ok = rows < seq_q
        q_offsets = rows[:, None] * q_row_stride + offs_d[None, :]
        q = tl.load(q_base + q_offsets, mask=row_ok[:, None], other=0.0)
        dout = tl.load(dout_base + q_offsets, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_row_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_row_ptr + rows, mask=row_ok, other=0.0)
        if MASKED:
            # lse = -inf: the row sees no key anywhere; +inf makes its probabilities exactly 0
            lse_log2 = tl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634)
            q_docs = rows
            if VARLEN:
                q_docs = tl.load(q_docs_ptr + batch * seq_q + rows, mask=row_ok, other=0)
            visible = _visible(rows, cols, seq_q, seq_k, diagonal, q_docs, k_docs, CAUSAL, VARLEN)
            probs = _attention_probs(q, k, lse_log2, visible, qk_scale_log2, NATIVE_DOT)
        else:
            probs = tl.exp2(_dot(q, tl.trans(k), NATIVE_DOT) * qk_scale_log2 - (lse * 1.4426950408889634)[:, None])
        dv += _dot(tl.trans(probs), dout, NATIVE_DOT)
        dprobs = _dot(dout, tl.trans(v), NATIVE_DOT)
        dscores = probs * (dprobs - delta[:, None])
        dk += _dot(tl.trans(dscores), q, NATIVE_DOT)
        return dk, dv

    @triton.jit
    def _dq_step(
        dq,
        q,
        dout,
        lse_log2,
        delta,
        k_base,
        v_base,
        k_docs_ptr,
        q_docs,
        rows,
        cols,
        offs_d,
        kv_row_stride,
        batch,
        seq_q,
        seq_k,
        diagonal,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        MASKED: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
    ):
        """One key block's contribution to a query block's ``dq``; without MASKED an interior block."""
        kv_offsets = cols[:, None] * kv_row_stride + offs_d[None, :]
        if MASKED:
            col_ok = cols < seq_k
            k = tl.load(k_base + kv_offsets, mask=col_ok[:, None], other=0.0)
            v = tl.load(v_base + kv_offsets, mask=col_ok[:, None], other=0.0)
            k_docs = cols
            if VARLEN:
                k_docs = tl.load(k_docs_ptr + batch * seq_k + cols, mask=col_ok, other=0)
            visible = _visible(rows, cols, seq_q, seq_k, diagonal, q_docs, k_docs, CAUSAL, VARLEN)
            probs = _attention_probs(q, k, lse_log2, visible, qk_scale_log2, NATIVE_DOT)
        else:
            k = tl.load(k_base + kv_offsets)
            v = tl.load(v_base + kv_offsets)
            probs = tl.exp2(_dot(q, tl.trans(k), NATIVE_DOT) * qk_scale_log2 - lse_log2[:, None])
        dprobs = _dot(dout, tl.trans(v), NATIVE_DOT)
        dscores = probs * (dprobs - delta[:, None])
        dq += _dot(dscores, k, NATIVE_DOT)
        return dq

    @triton.jit
    def _attention_backward_dkdv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        dout_ptr,
        lse_ptr,
        delta_ptr,
        dk_ptr,
        dv_ptr,
        q_docs_ptr,
        k_docs_ptr,
        offsets_ptr,
        ranges_ptr,
        count_ptr,
        seq_q,
        seq_k,
        heads_q,
        heads_kv,
        scale,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        COUNT: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
    ):
        """dk, dv for one block of BLOCK_N keys of one (batch, kv head), summed over the query heads sharing it."""
        block_n = tl.program_id(0)
        start_n = block_n * BLOCK_N
        batch_head = tl.program_id(1)
        batch = (batch_head // heads_kv).to(tl.int64)
        kv_head = batch_head % heads_kv
        group = heads_q // heads_kv
        q_row_stride = heads_q * HEAD_DIM
        kv_row_stride = heads_kv * HEAD_DIM
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        col_ok = offs_n < seq_k
        kv_offsets = (batch * seq_k * heads_kv + kv_head) * HEAD_DIM + offs_n[:, None] * kv_row_stride + offs_d[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=col_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        diagonal = seq_k - seq_q
        begin_m = 0
        if CAUSAL:  # the first query that sees key start_n is start_n - diagonal
            begin_m = (tl.maximum(start_n - diagonal, 0) // BLOCK_M) * BLOCK_M
        begin_m, end_m, diagonal = _row_setup(
            ranges_ptr, offsets_ptr, batch, block_n, tl.num_programs(0), begin_m, seq_q, diagonal, VARLEN
        )
        k_docs = offs_n
        if VARLEN:
            k_docs = tl.load(k_docs_ptr + batch * seq_k + offs_n, mask=col_ok, other=0)
        num_blocks = 0
        # query blocks from interior_begin see every key of this block (rows past seq_q load zeros and add nothing;
        # keys past seq_k only reach dk/dv rows that are not stored), so they run without a mask
        interior_begin = end_m
        if not VARLEN:
            interior_begin = begin_m
            if CAUSAL:
                edge = start_n + BLOCK_N - 1 - diagonal - begin_m  # the first query that sees the block's last key
                interior_begin = tl.minimum(begin_m + tl.cdiv(tl.maximum(edge, 0), BLOCK_M) * BLOCK_M, end_m)
        for head in range(kv_head * group, kv_head * group + group):
            q_base = q_ptr + (batch * seq_q * heads_q + head) * HEAD_DIM
            dout_base = dout_ptr + (batch * seq_q * heads_q + head) * HEAD_DIM
            row_base = (batch * heads_q + head) * seq_q
            for start_m in range(begin_m, interior_begin, BLOCK_M):
                dk, dv = _dkdv_step(
                    dk, dv, k, v, k_docs, q_base, dout_base, lse_ptr + row_base, delta_ptr + row_base, q_docs_ptr,
                    start_m + offs_m, offs_n, offs_d, q_row_stride, batch, seq_q, seq_k, diagonal, qk_scale_log2,
                    CAUSAL, VARLEN, True, NATIVE_DOT,
                )  # fmt: skip
                num_blocks += 1
            for start_m in range(interior_begin, end_m, BLOCK_M):
                dk, dv = _dkdv_step(
                    dk, dv, k, v, k_docs, q_base, dout_base, lse_ptr + row_base, delta_ptr + row_base, q_docs_ptr,
                    start_m + offs_m, offs_n, offs_d, q_row_stride, batch, seq_q, seq_k, diagonal, qk_scale_log2,
                    CAUSAL, VARLEN, False, NATIVE_DOT,
                )  # fmt: skip
                num_blocks += 1
        if COUNT:
            tl.store(count_ptr + batch_head * tl.num_programs(0) + block_n, num_blocks)
        tl.store(dk_ptr + kv_offsets, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
        tl.store(dv_ptr + kv_offsets, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])

    @triton.jit
    def _attention_backward_dq_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        dout_ptr,
        lse_ptr,
        delta_ptr,
        dq_ptr,
        q_docs_ptr,
        k_docs_ptr,
        offsets_ptr,
        ranges_ptr,
        count_ptr,
        seq_q,
        seq_k,
        heads_q,
        heads_kv,
        scale,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        COUNT: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
    ):
        """dq for one block of BLOCK_M queries of one (batch, query head)."""
        block_m = tl.program_id(0)
        start_m = block_m * BLOCK_M
        batch_head = tl.program_id(1)
        batch = (batch_head // heads_q).to(tl.int64)
        head = batch_head % heads_q
        kv_head = head // (heads_q // heads_kv)
        q_row_stride = heads_q * HEAD_DIM
        kv_row_stride = heads_kv * HEAD_DIM
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_q
        q_offsets = (batch * seq_q * heads_q + head) * HEAD_DIM + offs_m[:, None] * q_row_stride + offs_d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
        dout = tl.load(dout_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
        row_base = (batch * heads_q + head) * seq_q
        lse = tl.load(lse_ptr + row_base + offs_m, mask=row_ok, other=0.0)
        lse_log2 = tl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(delta_ptr + row_base + offs_m, mask=row_ok, other=0.0)
        k_base = k_ptr + (batch * seq_k * heads_kv + kv_head) * HEAD_DIM
        v_base = v_ptr + (batch * seq_k * heads_kv + kv_head) * HEAD_DIM
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        diagonal = seq_k - seq_q
        end_n = seq_k
        if CAUSAL:
            end_n = tl.maximum(tl.minimum(seq_k, start_m + BLOCK_M + diagonal), 0)
        begin_n, end_n, diagonal = _row_setup(
            ranges_ptr, offsets_ptr, batch, block_m, tl.num_programs(0), 0, end_n, diagonal, VARLEN
        )
        q_docs = offs_m
        if VARLEN:
            q_docs = tl.load(q_docs_ptr + batch * seq_q + offs_m, mask=row_ok, other=0)
        num_blocks = 0
        interior_end = _interior_key_end(begin_n, start_m, seq_k, diagonal, CAUSAL, VARLEN, BLOCK_N)
        for start_n in range(begin_n, interior_end, BLOCK_N):
            dq = _dq_step(
                dq, q, dout, lse_log2, delta, k_base, v_base, k_docs_ptr, q_docs, offs_m, start_n + offs_n, offs_d,
                kv_row_stride, batch, seq_q, seq_k, diagonal, qk_scale_log2, CAUSAL, VARLEN, False, NATIVE_DOT,
            )  # fmt: skip
            num_blocks += 1
        for start_n in range(interior_end, end_n, BLOCK_N):
            dq = _dq_step(
                dq, q, dout, lse_log2, delta, k_base, v_base, k_docs_ptr, q_docs, offs_m, start_n + offs_n, offs_d,
                kv_row_stride, batch, seq_q, seq_k, diagonal, qk_scale_log2, CAUSAL, VARLEN, True, NATIVE_DOT,
            )  # fmt: skip
            num_blocks += 1
        if COUNT:
            tl.store(count_ptr + batch_head * tl.num_programs(0) + block_m, num_blocks)
        tl.store(dq_ptr + q_offsets, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


KERNELS = ("forward", "backward_dkdv", "backward_dq")
"""The Triton kernels whose launch configuration is chosen (and tuned) separately; the backward's small ``delta``
kernel follows ``backward_dq``'s query blocks."""

_CONFIG_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"})


def _launch_config(q: torch.Tensor, kernel: str, causal: bool) -> dict:
    """Block sizes, warps, pipeline stages and the dot flag for one of the Triton `KERNELS` on ``q``.

    In Triton's interpreter each tile operation is one numpy call, so blocks of 32 keep the number of programs
    and loop iterations small for test shapes while still covering several blocks per sequence. On a GPU, 16-bit
    inputs use tensor-core dots, with the configuration `colo.kernels.tuning` measured for the GPU's architecture,
    head size and mask where there is one (else 64 x 64 tiles); fp32 uses exact fp32 dots on 32 x 32 tiles.
    """
    head_dim = q.shape[-1]
    native = q.is_cuda and not interpreter_enabled() and q.dtype in (torch.bfloat16, torch.float16)
    block = 64 if native else 32
    config = {"BLOCK_M": block, "BLOCK_N": block, "num_warps": 8 if (native and head_dim >= 128) else 4}
    if native:
        dtype = str(q.dtype).removeprefix("torch.")
        tuned = tuned_config(f"flash_attention.{kernel}", q.device, dtype=dtype, head_dim=head_dim, causal=causal)
        if tuned is not None:
            unknown = set(tuned) - _CONFIG_KEYS
            if unknown:
                raise ValueError(f"tuning entry flash_attention.{kernel}: unknown keys {sorted(unknown)}")
            config.update(tuned)
    config["NATIVE_DOT"] = native
    return config


def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous() for t in tensors]


def _varlen_args(documents: DocumentMask | None, ranges, seq_q: int, seq_k: int, device: torch.device) -> tuple:
    """``(q_docs, k_docs, offsets, ranges)`` kernel arguments: the mask's tensors, or placeholders without one."""
    if documents is None:
        placeholder = torch.empty(1, dtype=torch.int64, device=device)
        return placeholder, placeholder, placeholder, placeholder
    q_docs, k_docs = documents.query_ids, documents.key_ids
    if k_docs is None:  # offsets only: every token of a row in one document
        batch = documents.kv_offsets.shape[0]
        q_docs = torch.zeros(batch, seq_q, dtype=torch.int64, device=device)
        k_docs = torch.zeros(batch, seq_k, dtype=torch.int64, device=device)
    return q_docs, k_docs, documents.kv_offsets, ranges


def _block_forward_triton(q, k, v, causal, scale, documents=None):
    q, k, v = _contiguous(q, k, v)
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads_q, seq_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    if seq_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    config = _launch_config(q, "forward", causal)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (triton.cdiv(seq_q, block_m), batch * heads_q)
    ranges = None
    if documents is not None:
        ranges = query_block_ranges(documents, causal, seq_q, seq_k, block_m, block_n)
    counter = block_counter(grid[0] * grid[1], q.device)
    _attention_forward_kernel[grid](
        q, k, v, out, lse, *_varlen_args(documents, ranges, seq_q, seq_k, q.device),
        counter if counter is not None else lse, seq_q, seq_k, heads_q, heads_kv, scale * _LOG2E,
        CAUSAL=causal, VARLEN=documents is not None, COUNT=counter is not None, HEAD_DIM=head_dim, **config,
    )  # fmt: skip
    record_blocks("forward", counter)
    return out, lse


def _block_backward_triton(dout, q, k, v, out, lse, causal, scale, documents=None):
    dout, q, k, v, out = _contiguous(dout, q, k, v, out)
    lse = lse.float().contiguous()
    batch, seq_q, heads_q, head_dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dkdv_config = _launch_config(q, "backward_dkdv", causal)
    dq_config = _launch_config(q, "backward_dq", causal)
    delta = torch.empty(batch, heads_q, seq_q, dtype=torch.float32, device=q.device)
    _attention_backward_delta_kernel[(triton.cdiv(seq_q, dq_config["BLOCK_M"]), batch * heads_q)](
        out, dout, delta, seq_q, heads_q, HEAD_DIM=head_dim, BLOCK_M=dq_config["BLOCK_M"]
    )
    varlen = documents is not None
    key_ranges = query_ranges = None
    if varlen:
        key_ranges = key_block_ranges(documents, causal, seq_q, seq_k, dkdv_config["BLOCK_M"], dkdv_config["BLOCK_N"])
        query_ranges = query_block_ranges(documents, causal, seq_q, seq_k, dq_config["BLOCK_M"], dq_config["BLOCK_N"])
    config = dkdv_config
    grid = (triton.cdiv(seq_k, config["BLOCK_N"]), batch * heads_kv)
    counter = block_counter(grid[0] * grid[1], q.device)
    _attention_backward_dkdv_kernel[grid](
        q, k, v, dout, lse, delta, dk, dv, *_varlen_args(documents, key_ranges, seq_q, seq_k, q.device),
        counter if counter is not None else delta, seq_q, seq_k, heads_q, heads_kv, scale, scale * _LOG2E,
        CAUSAL=causal, VARLEN=varlen, COUNT=counter is not None, HEAD_DIM=head_dim, **config,
    )  # fmt: skip
    record_blocks("backward_dkdv", counter)
    config = dq_config
    grid = (triton.cdiv(seq_q, config["BLOCK_M"]), batch * heads_q)
    counter = block_counter(grid[0] * grid[1], q.device)
    _attention_backward_dq_kernel[grid](
        q, k, v, dout, lse, delta, dq, *_varlen_args(documents, query_ranges, seq_q, seq_k, q.device),
        counter if counter is not None else delta, seq_q, seq_k, heads_q, heads_kv, scale, scale * _LOG2E,
        CAUSAL=causal, VARLEN=varlen, COUNT=counter is not None, HEAD_DIM=head_dim, **config,
    )  # fmt: skip
    record_blocks("backward_dq", counter)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# The operators torch.ops.colo.flash_attention and torch.ops.colo.flash_attention_backward
# ----------------------------------------------------------------------------------------------------------------


def _forward_torch(q, k, v, causal, scale, documents):
    """Torch ``(out, lse)``: the output exactly as `flash_attention_reference` computes it, and the row logsumexp
    (``-inf`` for a row that sees no key)."""
    group = q.shape[2] // k.shape[2]
    scores, mask = _scores_fp32(q, k, group, causal, scale, documents)
    if mask is not None:
        lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
        # finfo.min rather than -inf keeps fully masked rows finite (uniform, then zeroed by the mask)
        probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(torch.float32).min), dim=-1) * mask
    else:
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1)
    v32 = v.float().repeat_interleave(group, dim=2) if group > 1 else v.float()
    return torch.einsum("bhqk,bkhd->bqhd", probs, v32).to(q.dtype).contiguous(), lse.contiguous()


def _op_documents(op, q, k, query_document_ids, document_ids, kv_offsets):
    """The `DocumentMask` of an operator call: the caller's `build_document_mask` mask when these are its tensors
    (its block ranges cached across layers), else one built here (values checked by the public functions, in eager
    mode)."""
    shared = shared_document_mask(query_document_ids, document_ids, kv_offsets)
    if shared is not None:
        shared.check_fits(op, q, k)
        return shared
    return document_mask_inputs(
        op, q, k, document_ids=document_ids, query_document_ids=query_document_ids, kv_offsets=kv_offsets,
        check_values=False,
    )  # fmt: skip


@torch.library.custom_op(
    "colo::flash_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale, Tensor? query_document_ids, "
    "Tensor? document_ids, Tensor? kv_offsets, str backend) -> (Tensor, Tensor)",
)
def _flash_attention_op(q, k, v, causal, scale, query_document_ids, document_ids, kv_offsets, backend):
    """``(out, lse)`` of attention with the document mask of `colo.kernels.document_mask` (query ids default to
    the ids of their key positions, offsets to ``seq_k - seq_q``); ``lse`` is ``(batch, heads_q, seq_q)`` fp32."""
    documents = _op_documents("colo::flash_attention", q, k, query_document_ids, document_ids, kv_offsets)
    if op_backend(backend, q, k, v) == "triton":
        return _block_forward_triton(q, k, v, causal, scale, documents)
    return _forward_torch(q, k, v, causal, scale, documents)


@_flash_attention_op.register_fake
def _(q, k, v, causal, scale, query_document_ids, document_ids, kv_offsets, backend):
    batch, seq_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seq_q), dtype=torch.float32)


@torch.library.custom_op(
    "colo::flash_attention_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, float scale, "
    "Tensor? query_document_ids, Tensor? document_ids, Tensor? kv_offsets, str backend) -> (Tensor, Tensor, Tensor)",
)
def _flash_attention_backward_op(
    dout, q, k, v, out, lse, causal, scale, query_document_ids, document_ids, kv_offsets, backend
):
    """``(dq, dk, dv)`` from the output and logsumexp (merged over key blocks for ring attention)."""
    documents = _op_documents("colo::flash_attention_backward", q, k, query_document_ids, document_ids, kv_offsets)
    if op_backend(backend, dout, q, k, v, out) == "triton":
        return _block_backward_triton(dout, q, k, v, out, lse, causal, scale, documents)
    dq, dk, dv = _block_backward_torch(dout, q, k, v, out, lse, causal, scale, documents)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flash_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, scale, query_document_ids, document_ids, kv_offsets, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, query_document_ids, document_ids, kv_offsets, backend = inputs
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.save_for_backward(q, k, v, *output, query_document_ids, document_ids, kv_offsets)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, query_document_ids, document_ids, kv_offsets = ctx.saved_tensors
    dq, dk, dv = torch.ops.colo.flash_attention_backward(
        dout, q, k, v, out, lse, ctx.causal, ctx.scale, query_document_ids, document_ids, kv_offsets, ctx.backend
    )
    return dq, dk, dv, None, None, None, None, None, None


_flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _document_args(op, q, k, document_ids, query_document_ids, kv_offsets) -> tuple:
    """The operators' ``(query_document_ids, document_ids, kv_offsets)`` from a public call's arguments: validated
    (their values too, except under ``torch.compile``, where reading them would break the graph), the query ids
    gathered from the keys' and an int offset made a tensor."""
    documents = document_mask_inputs(
        op, q, k, document_ids=document_ids, query_document_ids=query_document_ids, kv_offsets=kv_offsets,
        check_values=not torch.compiler.is_compiling(),
    )  # fmt: skip
    if documents is None:
        return None, None, None
    return documents.query_ids, documents.key_ids, documents.kv_offsets


# ----------------------------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------------------------


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    document_ids: torch.Tensor | DocumentMask | None = None,
    query_document_ids: torch.Tensor | None = None,
    kv_offsets: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with online softmax (FlashAttention-2, Dao, 2023) and grouped-query heads.

    The Triton forward never materializes the ``(seq_q, seq_k)`` scores: it streams key blocks with an online
    softmax and saves the output and the row logsumexp; the backward recomputes the probabilities from the
    logsumexp. The torch backend is `flash_attention_reference` (explicit softmax in fp32).

    Args:
        q (torch.Tensor): ``(batch, seq_q, heads_q, head_dim)`` queries.
        k (torch.Tensor): ``(batch, seq_k, heads_kv, head_dim)`` keys; ``heads_q`` must be a multiple of
            ``heads_kv`` (query head ``h`` uses kv head ``h // (heads_q // heads_kv)``).
        v (torch.Tensor): values, shaped like ``k``.
        causal (bool): causal mask, bottom-right aligned: query ``i`` sees key ``j <= i + seq_k - seq_q``; a row
            that sees no key outputs 0. Default: False.
        scale (float | None): score scale; None means ``1 / sqrt(head_dim)``. Default: None.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; None follows `use_backend` and
            ``COLO_KERNELS``. Default: None.
        document_ids (torch.Tensor | DocumentMask | None): ``(batch, seq_k)`` integer document ids of the keys,
            non-decreasing within each row: query and key attend only within one document (padding is an id of its
            own; see `colo.kernels.document_mask`). With Triton, key blocks no query of a block can see are skipped.
            Or a `DocumentMask` from `colo.kernels.document_mask.build_document_mask` (then without
            ``query_document_ids`` and ``kv_offsets``): checked once, shared by every layer of a forward, its block
            ranges cached. Default: None (no document mask).
        query_document_ids (torch.Tensor | None): ``(batch, seq_q)`` ids of the queries; None: query ``i`` of row
            ``b`` has the id of key ``kv_offsets[b] + i``. Default: None.
        kv_offsets (torch.Tensor | int | None): ``(batch,)`` (or one int): query ``i`` of row ``b`` sits at key
            position ``kv_offsets[b] + i`` (the causal mask and the query ids follow it). Default: None
            (``seq_k - seq_q``, bottom-right alignment).

    Returns:
        torch.Tensor: ``(batch, seq_q, heads_q, head_dim)`` in q's dtype; a query that sees no key gives 0.

    Raises:
        ValueError: for mismatched shapes, ``heads_q`` not a multiple of ``heads_kv``, document ids that are not
            ``(batch, seq)`` integers non-decreasing within each row, or offsets outside the keys.
        UnsupportedKernelInput: on the Triton path, for dtypes other than fp32/bf16/fp16 (one for all three) or a
            head_dim other than 16, 32, 64 or 128.
    """
    _check_shapes("flash_attention", q, k, v)
    documents = _document_args("flash_attention", q, k, document_ids, query_document_ids, kv_offsets)
    requested = requested_backend(backend)
    backend = resolve_backend("flash_attention", q, k, v, backend=backend)
    if backend == "triton":
        _check_triton_inputs("flash_attention", q=q, k=k, v=v)
        plain = all(argument is None for argument in documents)
        if requested == "auto" and plain and _plain_attention_runs_sdpa(q, k, causal):
            return _sdpa_attention(q, k, v, bool(causal), _default_scale(q, scale))
    out, _ = torch.ops.colo.flash_attention(q, k, v, bool(causal), _default_scale(q, scale), *documents, backend)
    return out


PLAIN_ATTENTION_ENV = "COLO_PLAIN_ATTENTION"
"""Which kernel `flash_attention` runs on CUDA for 16-bit attention without documents or offsets when the backend is
``auto``: ``triton`` (colo's kernel), ``sdpa`` (``scaled_dot_product_attention``, FlashAttention-2 inside torch) or
``auto`` (the default: what `colo.kernels.tuning` measured faster on the GPU's architecture for the head size and
mask, else ``triton``). Masks with documents or offsets always run colo's kernel."""


def _assume_constant_result(fn):
    """`torch.compiler.assume_constant_result` without importing ``torch._dynamo`` (about 1.5 s of every process that
    imports colo.kernels, compiling or not): that decorator only marks the function with the attribute Dynamo reads
    when it traces a call (torch 2.11 to 2.13); ``test_flash_attention_dispatch`` checks the two mark alike."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _plain_attention_implementation(device_index: int, dtype: str, head_dim: int, causal: bool) -> str:
    """``"sdpa"`` or ``"triton"`` for plain attention with these properties (constant under ``torch.compile``)."""
    choice = os.environ.get(PLAIN_ATTENTION_ENV, "auto")
    if choice not in ("auto", "sdpa", "triton"):
        raise ValueError(f"{PLAIN_ATTENTION_ENV}={choice!r}: use auto, sdpa or triton")
    if choice == "auto":
        device = torch.device("cuda", device_index)
        tuned = tuned_config("flash_attention.plain", device, dtype=dtype, head_dim=head_dim, causal=causal)
        choice = (tuned or {}).get("implementation", "triton")
    return choice


def _plain_attention_runs_sdpa(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether plain attention on these CUDA inputs runs through SDPA (see `PLAIN_ATTENTION_ENV`): 16-bit, and for a
    causal mask equal query and key lengths (SDPA aligns the causal mask top-left, colo bottom-right)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or (causal and q.shape[1] != k.shape[1]):
        return False
    dtype = str(q.dtype).removeprefix("torch.")
    return _plain_attention_implementation(q.device.index, dtype, q.shape[-1], bool(causal)) == "sdpa"


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """``scaled_dot_product_attention`` on colo's ``(batch, seq, heads, head_dim)`` layout, grouped-query heads
    included, without copies (the transposes are views SDPA takes as they are)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def attention_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    document_ids: torch.Tensor | DocumentMask | None = None,
    query_document_ids: torch.Tensor | None = None,
    kv_offsets: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one block of keys, returning the output and the row logsumexp (no autograd).

    The block step of ring attention (Liu et al., 2023): a caller that sees the keys in several blocks merges
    the block results with ``lse = logsumexp_i(lse_i)`` and ``out = sum_i exp(lse_i - lse) * out_i``, then calls
    `attention_block_backward` for each block with the merged ``out`` and ``lse``. A row that sees no key of
    this block (possible with ``causal``) gets ``out = 0`` and ``lse = -inf``, which the merge weights by 0 (a row
    that sees no key in any block has a global ``lse = -inf``; the caller's merge must then keep its output 0
    rather than compute ``exp(-inf - -inf)``).

    Args:
        q (torch.Tensor): ``(batch, seq_q, heads_q, head_dim)`` queries.
        k (torch.Tensor): ``(batch, seq_k, heads_kv, head_dim)`` keys of this block.
        v (torch.Tensor): values of this block, shaped like ``k``.
        causal (bool): bottom-right aligned causal mask within the block (``j <= i + seq_k - seq_q``).
            Default: False.
        scale (float | None): score scale; None means ``1 / sqrt(head_dim)``. Default: None.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; None follows `use_backend` and
            ``COLO_KERNELS``. Default: None.
        document_ids, query_document_ids, kv_offsets: the document mask within this block, as in
            `flash_attention` (ring attention passes the ids of its query chunk and of the block's keys).

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``out`` ``(batch, seq_q, heads_q, head_dim)`` in q's dtype and
        ``lse`` ``(batch, heads_q, seq_q)`` fp32, natural log of the sum of ``exp(scale * q.k)`` over visible keys.
    """
    _check_shapes("attention_block_forward", q, k, v)
    documents = _document_args("attention_block_forward", q, k, document_ids, query_document_ids, kv_offsets)
    backend = resolve_backend("attention_block_forward", q, k, v, backend=backend)
    if backend == "triton":
        _check_triton_inputs("attention_block_forward", q=q, k=k, v=v)
    with torch.no_grad():
        return torch.ops.colo.flash_attention(q, k, v, bool(causal), _default_scale(q, scale), *documents, backend)


def attention_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    document_ids: torch.Tensor | DocumentMask | None = None,
    query_document_ids: torch.Tensor | None = None,
    kv_offsets: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention over one key block, given the attention output and logsumexp (no autograd).

    Probabilities are recomputed as ``exp(scale * q.k - lse)``, and ``delta = rowsum(dout * out)``. Passing the
    output and logsumexp *merged over all blocks* makes the results this block's share of the full attention's
    gradients: sum ``dq`` over blocks; ``dk``/``dv`` belong to this block's keys. Rows with ``lse = -inf`` (no
    visible key anywhere) get zero gradient.

    Args:
        dout (torch.Tensor): ``(batch, seq_q, heads_q, head_dim)`` gradient of the (merged) output.
        q (torch.Tensor): ``(batch, seq_q, heads_q, head_dim)`` queries.
        k (torch.Tensor): ``(batch, seq_k, heads_kv, head_dim)`` keys of this block.
        v (torch.Tensor): values of this block, shaped like ``k``.
        out (torch.Tensor): the attention output, shaped like ``q`` (merged over blocks for ring attention).
        lse (torch.Tensor): ``(batch, heads_q, seq_q)`` logsumexp matching ``out`` (global for ring attention).
        causal (bool): the mask used in the forward of this block. Default: False.
        scale (float | None): score scale; None means ``1 / sqrt(head_dim)``. Default: None.
        backend (str | None): ``"triton"``, ``"torch"`` or ``"auto"``; None follows `use_backend` and
            ``COLO_KERNELS``. Default: None.
        document_ids, query_document_ids, kv_offsets: the document mask used in the forward of this block.

    Returns:
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``dq``, ``dk``, ``dv`` in the dtypes of q, k, v; grouped
        query heads' contributions are summed into their kv head.
    """
    _check_shapes("attention_block_backward", q, k, v)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"attention_block_backward: dout {tuple(dout.shape)} and out {tuple(out.shape)} must be shaped like "
            f"q {tuple(q.shape)}"
        )
    expected_lse = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != expected_lse:
        raise ValueError(
            f"attention_block_backward: lse must be (batch, heads_q, seq_q) = {expected_lse}, got {tuple(lse.shape)}"
        )
    documents = _document_args("attention_block_backward", q, k, document_ids, query_document_ids, kv_offsets)
    backend = resolve_backend("attention_block_backward", dout, q, k, v, out, backend=backend)
    if backend == "triton":
        _check_triton_inputs("attention_block_backward", dout=dout, q=q, k=k, v=v, out=out)
    with torch.no_grad():
        return torch.ops.colo.flash_attention_backward(
            dout, q, k, v, out, lse, bool(causal), _default_scale(q, scale), *documents, backend
        )
