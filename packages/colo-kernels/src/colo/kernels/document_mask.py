"""Document masking for attention: packed rows of several documents, padded rows, per-row KV offsets.

A row of ``seq`` tokens may hold several documents back to back (sequence packing) and padding. Attention is told
which is which by **document ids**, a ``(batch, seq)`` integer tensor, non-decreasing within each row: query ``i``
may attend key ``j`` only when both carry the same id (and, with ``causal``, ``j`` is not after ``i``). Padding is
simply a document of its own (any id that no real token uses, e.g. ``-1`` for left padding or ``last + 1`` for
right padding): it never attends to a real token and no real token attends to it. This is what FlashAttention's
varlen interface expresses with ``cu_seqlens``, and what flex attention's document masking expresses with a
``mask_mod``; here it is plain ids, so a row keeps its fixed shape.

**KV offsets** place the queries within the keys: query ``i`` of row ``b`` sits at key position
``kv_offsets[b] + i``. The default, ``seq_k - seq_q`` for every row, is the bottom-right alignment of
`colo.kernels.flash_attention`'s causal mask (the new tokens of KV-cache decoding follow the cached ones). Per-row
offsets serve padded rows in a KV cache whose rows hold different numbers of tokens. With causal attention query
``i`` sees key ``j <= kv_offsets[b] + i``; its document id is that of key ``kv_offsets[b] + i`` unless query ids
are given separately (as ring attention's block step does: its queries and keys are different chunks of a row).

A query that sees no key at all (a fully masked row) gets an output of 0, a logsumexp of ``-inf`` and zero
gradients, never NaN.

Because ids are non-decreasing, the keys a block of queries can see are one contiguous range (from the first key
of the block's first document to the last key of its last one, cut by the causal mask); the Triton kernels loop
over that range only, so fully masked blocks are never loaded. `count_attention_blocks` counts the blocks the
kernels did compute (a test hook: counting stores one integer per program).

**One mask per forward.** Checking the ids reads them on the host (a device sync), and the block ranges are a few
``searchsorted`` launches: per attention call, that is once per layer. A model builds the mask once per forward with
`build_document_mask` and passes the `DocumentMask` as every layer's ``document_ids``: the ids are checked once, and
the ranges are computed once per ``(causal, seq_q, seq_k, block_m, block_n)`` and cached on the mask. The attention
operators take tensors only: they find the cache on the mask's ``kv_offsets`` tensor, which the autograd graph keeps
for the backward (under ``torch.compile`` too, for a mask built outside the compiled region).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class DocumentMask:
    """Validated document-mask inputs of attention (see the module docstring), with the Triton kernels' block
    ranges cached on it: build one with `build_document_mask` and pass it as ``document_ids`` to every layer.

    Its tensors must not change in place while it is in use (the cached ranges follow from their values).

    Attributes:
        query_ids: ``(batch, seq_q)`` int64 document ids of the queries.
        key_ids: ``(batch, seq_k)`` int64 document ids of the keys (None: no document mask, offsets only).
        kv_offsets: ``(batch,)`` int64 position of each row's first query among its keys.
    """

    def __init__(self, query_ids: torch.Tensor | None, key_ids: torch.Tensor | None, kv_offsets: torch.Tensor):
        self.query_ids, self.key_ids, self.kv_offsets = query_ids, key_ids, kv_offsets
        self.block_ranges: dict[tuple, torch.Tensor] = {}
        """``query_block_ranges`` / ``key_block_ranges`` results by ``(kind, causal, seq_q, seq_k, block_m,
        block_n)``."""

    def check_fits(self, op: str, q: torch.Tensor, k: torch.Tensor) -> None:
        """Raise a `ValueError` unless this mask is shaped for queries ``q`` and keys ``k`` (no device sync)."""
        batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
        key_shape = None if self.key_ids is None else tuple(self.key_ids.shape)
        if tuple(self.kv_offsets.shape) != (batch,) or key_shape not in (None, (batch, seq_k)):
            raise ValueError(
                f"{op}: the DocumentMask is for keys of shape (batch, seq_k) = {key_shape}, but k has batch {batch} "
                f"and seq_k {seq_k}; build the mask for this attention's keys"
            )
        if self.query_ids is not None and tuple(self.query_ids.shape) != (batch, seq_q):
            raise ValueError(
                f"{op}: the DocumentMask is for {self.query_ids.shape[1]} queries per row, but q has {seq_q}; build it "
                f"with seq_q={seq_q}"
            )
        if self.kv_offsets.device != q.device:
            raise ValueError(f"{op}: the DocumentMask is on {self.kv_offsets.device}, q/k/v on {q.device}")


_SHARED_RANGES = "_colo_document_mask"
"""The attribute of a built mask's ``kv_offsets`` tensor that holds ``(query_ids, key_ids, block_ranges)``: the
operators get the tensors, and the saved ``kv_offsets`` keeps the cache alive until the backward (the tensors do not
point back at the mask: no reference cycle)."""


def shared_document_mask(
    query_ids: torch.Tensor | None, key_ids: torch.Tensor | None, kv_offsets: torch.Tensor | None
) -> DocumentMask | None:
    """The mask `build_document_mask` built from these very tensors, with its cached block ranges; ``None`` for
    tensors of no built mask (how the attention operators, which take tensors, find the cache)."""
    shared = getattr(kv_offsets, _SHARED_RANGES, None)
    if shared is None or shared[0] is not query_ids or shared[1] is not key_ids:
        return None
    mask = DocumentMask(query_ids, key_ids, kv_offsets)
    mask.block_ranges = shared[2]
    return mask


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids of packed rows from their positions: a document starts wherever ``position_ids`` do not go up
    by one (the rule transformers uses to detect packed sequences), so ``[0, 1, 2, 0, 1, 0, 0]`` gives
    ``[0, 0, 0, 1, 1, 2, 3]``.

    Args:
        position_ids (torch.Tensor): ``(batch, seq)`` (or ``(seq,)``) positions, restarting per document.

    Returns:
        torch.Tensor: int64 ids of the same shape, 0 for each row's first token, non-decreasing.
    """
    if position_ids.dim() not in (1, 2) or position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(
            f"document_ids_from_position_ids: position_ids must be an integer (batch, seq) or (seq,) tensor, got "
            f"{position_ids.dtype} of shape {tuple(position_ids.shape)}"
        )
    position_ids = position_ids.long()
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[..., :1] - 1)
    return (step != 1).cumsum(-1)


def _is_integer_tensor(x: object) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def check_document_ids(
    op: str, name: str, ids: object, shape: tuple[int, int], device: torch.device, *, check_values: bool = True
) -> torch.Tensor:
    """Validate document ids: an integer tensor of ``shape`` on ``device``, non-decreasing within each row (the
    values are checked only with ``check_values``: reading them synchronizes with the device).

    Returns the ids as a contiguous int64 tensor; raises a `ValueError` naming ``op``, ``name`` and the fix.
    """
    if not _is_integer_tensor(ids):
        kind = f"{ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{op}: {name} must be an integer tensor of shape (batch, seq) = {shape}, got a {kind}")
    if tuple(ids.shape) != shape:
        raise ValueError(
            f"{op}: {name} has shape {tuple(ids.shape)}, but q/k/v need (batch, seq) = {shape}; give one id per "
            "token of each row"
        )
    if ids.device != device:
        raise ValueError(f"{op}: {name} is on {ids.device}, q/k/v on {device}; move it to {device}")
    ids = ids.long()
    if check_values and ids.shape[1] > 1:
        decreasing = ids[:, 1:] < ids[:, :-1]
        if bool(decreasing.any()):
            row, col = (int(x) for x in decreasing.nonzero()[0])
            raise ValueError(
                f"{op}: {name} must be non-decreasing within each row (documents back to back, padding an id of its "
                f"own), but row {row} goes from {int(ids[row, col])} to {int(ids[row, col + 1])} at position "
                f"{col + 1}; number the documents of a row in order"
            )
    return ids.contiguous()


def document_mask_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    document_ids: torch.Tensor | DocumentMask | None,
    query_document_ids: torch.Tensor | None = None,
    kv_offsets: torch.Tensor | int | None = None,
    check_values: bool = True,
) -> DocumentMask | None:
    """Validate the document-mask arguments of an attention call; ``None`` when there are none (plain attention).

    The shapes, dtypes and devices are always checked. The values (ids non-decreasing in each row, offsets that
    keep the queries within the keys) only with ``check_values``: reading them is data-dependent, so the attention
    ops skip it under ``torch.compile`` / ``torch.export`` (a graph break otherwise) and check in eager mode. A
    `DocumentMask` (from `build_document_mask`, already checked) is returned as it is once its shapes fit q and k.

    Args:
        op (str): the calling function, for error messages.
        q (torch.Tensor): ``(batch, seq_q, heads_q, head_dim)`` queries.
        k (torch.Tensor): ``(batch, seq_k, heads_kv, head_dim)`` keys.
        document_ids (torch.Tensor | DocumentMask | None): ``(batch, seq_k)`` ids of the keys, or a built mask.
        query_document_ids (torch.Tensor | None): ``(batch, seq_q)`` ids of the queries; ``None``: key
            ``kv_offsets[b] + i``'s id for query ``i``.
        kv_offsets (torch.Tensor | int | None): ``(batch,)`` or one int: position of each row's first query among
            the keys; ``None``: ``seq_k - seq_q``.
        check_values (bool): check the ids' and offsets' values too. Default: ``True``.

    Raises:
        ValueError: ids that are not integer, not shaped ``(batch, seq)`` like q/k, not non-decreasing in a row, or
            offsets that put queries outside the keys when their ids are read from ``document_ids``; a
            `DocumentMask` of other shapes, or with ``query_document_ids`` / ``kv_offsets`` beside it.
    """
    if isinstance(document_ids, DocumentMask):
        if query_document_ids is not None or kv_offsets is not None:
            raise ValueError(
                f"{op}: a DocumentMask holds the query ids and offsets; pass them to build_document_mask, not "
                "beside the mask"
            )
        document_ids.check_fits(op, q, k)
        return document_ids
    return _mask_of_shape(
        op, q.shape[0], q.shape[1], k.shape[1], q.device, document_ids, query_document_ids, kv_offsets, check_values
    )


def _mask_of_shape(op, batch, seq_q, seq_k, device, document_ids, query_document_ids, kv_offsets, check_values):
    """`document_mask_inputs` for ``batch`` rows of ``seq_q`` queries over ``seq_k`` keys on ``device``."""
    if document_ids is None and query_document_ids is None and kv_offsets is None:
        return None
    if query_document_ids is not None and document_ids is None:
        raise ValueError(f"{op}: query_document_ids needs document_ids (the keys' ids) as well")
    if kv_offsets is None:
        offsets = torch.full((batch,), seq_k - seq_q, dtype=torch.long, device=device)
    elif isinstance(kv_offsets, int) and not isinstance(kv_offsets, bool):
        offsets = torch.full((batch,), kv_offsets, dtype=torch.long, device=device)
    else:
        if not _is_integer_tensor(kv_offsets) or tuple(kv_offsets.shape) != (batch,):
            got = kv_offsets
            if isinstance(kv_offsets, torch.Tensor):
                got = f"{kv_offsets.dtype} {tuple(kv_offsets.shape)}"
            raise ValueError(
                f"{op}: kv_offsets must be an int or an integer tensor of shape (batch,) = ({batch},), got {got}"
            )
        offsets = kv_offsets.to(device=device, dtype=torch.long).contiguous()
    if document_ids is None:
        return DocumentMask(None, None, offsets)
    key_ids = check_document_ids(op, "document_ids", document_ids, (batch, seq_k), device, check_values=check_values)
    if query_document_ids is not None:
        query_ids = check_document_ids(
            op, "query_document_ids", query_document_ids, (batch, seq_q), device, check_values=check_values
        )
        return DocumentMask(query_ids, key_ids, offsets)
    if check_values and seq_q and bool(((offsets < 0) | (offsets + seq_q > seq_k)).any()):
        raise ValueError(
            f"{op}: kv_offsets {offsets.tolist()} put the {seq_q} queries of a row outside its {seq_k} keys (query i "
            f"sits at key kv_offsets[b] + i, which must be in [0, {seq_k})); fix the offsets, or pass "
            "query_document_ids"
        )
    positions = offsets.unsqueeze(1) + torch.arange(seq_q, device=device)
    return DocumentMask(key_ids.gather(1, positions).contiguous(), key_ids, offsets)


def build_document_mask(
    document_ids: torch.Tensor,
    *,
    seq_q: int | None = None,
    query_document_ids: torch.Tensor | None = None,
    kv_offsets: torch.Tensor | int | None = None,
) -> DocumentMask:
    """Validate a document mask once, for every attention call of a forward to share (see the module docstring).

    Pass the result as ``document_ids`` to `colo.kernels.flash_attention` (or the block steps) in every layer:
    the ids are not read again, and the Triton kernels' block ranges are computed once per
    ``(causal, seq_q, seq_k, block_m, block_n)`` and cached on the mask. Under ``torch.compile`` the values are
    not checked (reading them would break the graph).

    Args:
        document_ids (torch.Tensor): ``(batch, seq_k)`` integer document ids of the keys, non-decreasing per row.
        seq_q (int | None): queries per row; ``None``: those of ``query_document_ids``, else ``seq_k`` (self
            attention). Default: ``None``.
        query_document_ids (torch.Tensor | None): ``(batch, seq_q)`` ids of the queries; ``None``: query ``i`` of
            row ``b`` has the id of key ``kv_offsets[b] + i``. Default: ``None``.
        kv_offsets (torch.Tensor | int | None): ``(batch,)`` or one int: query ``i`` of row ``b`` sits at key
            ``kv_offsets[b] + i``; ``None``: ``seq_k - seq_q``. Default: ``None``.

    Returns:
        DocumentMask: the checked mask, found again by the attention operators from its tensors while it lives.

    Raises:
        ValueError: as `colo.kernels.flash_attention` does for bad ids or offsets.
    """
    op = "build_document_mask"
    if not _is_integer_tensor(document_ids) or document_ids.dim() != 2:
        got = f"{document_ids.dtype} {tuple(document_ids.shape)}" if isinstance(document_ids, torch.Tensor) else ""
        raise ValueError(
            f"{op}: document_ids must be a (batch, seq) integer tensor, got {got or type(document_ids).__name__}"
        )
    batch, seq_k = document_ids.shape
    if seq_q is None:
        seq_q = query_document_ids.shape[-1] if isinstance(query_document_ids, torch.Tensor) else seq_k
    eager = not torch.compiler.is_compiling()
    if eager and isinstance(kv_offsets, torch.Tensor):
        kv_offsets = kv_offsets.clone()  # the cache goes on the mask's own offsets, not on the caller's tensor
    mask = _mask_of_shape(
        op, batch, seq_q, seq_k, document_ids.device, document_ids, query_document_ids, kv_offsets, eager
    )
    if eager:  # a traced mask's tensors are not the ones the operators will get
        setattr(mask.kv_offsets, _SHARED_RANGES, (mask.query_ids, mask.key_ids, mask.block_ranges))
    return mask


def dense_mask(mask: DocumentMask, causal: bool, seq_q: int, seq_k: int) -> torch.Tensor:
    """``(batch, 1, seq_q, seq_k)`` bool: True where query i may attend key j (for the torch implementations)."""
    device = mask.kv_offsets.device
    batch = mask.kv_offsets.shape[0]
    visible = torch.ones(batch, seq_q, seq_k, dtype=torch.bool, device=device)
    if mask.key_ids is not None:
        visible = mask.query_ids.unsqueeze(2) == mask.key_ids.unsqueeze(1)
    if causal:
        rows = torch.arange(seq_q, device=device).view(1, seq_q, 1)
        cols = torch.arange(seq_k, device=device).view(1, 1, seq_k)
        visible = visible & (cols <= rows + mask.kv_offsets.view(batch, 1, 1))
    return visible.unsqueeze(1)


def query_block_ranges(mask: DocumentMask, causal: bool, seq_q: int, seq_k: int, block_m: int, block_n: int):
    """``(batch, blocks of queries, 2)`` int32 ``[begin, end)`` key positions each query block must visit.

    ``begin`` is rounded down to a multiple of ``block_n``; ``end <= begin`` means nothing to visit. Computed once
    per mask and arguments (cached in ``mask.block_ranges``).
    """
    return _cached_ranges(_query_block_ranges, "query", mask, causal, seq_q, seq_k, block_m, block_n)


def key_block_ranges(mask: DocumentMask, causal: bool, seq_q: int, seq_k: int, block_m: int, block_n: int):
    """``(batch, blocks of keys, 2)`` int32 ``[begin, end)`` query positions each key block must visit (cached
    like `query_block_ranges`)."""
    return _cached_ranges(_key_block_ranges, "key", mask, causal, seq_q, seq_k, block_m, block_n)


def _cached_ranges(compute, kind, mask, causal, seq_q, seq_k, block_m, block_n):
    key = (kind, bool(causal), seq_q, seq_k, block_m, block_n)
    ranges = mask.block_ranges.get(key)
    if ranges is None:
        ranges = mask.block_ranges[key] = compute(mask, causal, seq_q, seq_k, block_m, block_n)
    return ranges


def _query_block_ranges(mask, causal, seq_q, seq_k, block_m, block_n):
    """`query_block_ranges`, computed."""
    batch, device = mask.kv_offsets.shape[0], mask.kv_offsets.device
    starts = torch.arange(0, seq_q, block_m, device=device)
    ends = torch.clamp(starts + block_m, max=seq_q)
    begin = torch.zeros(batch, starts.numel(), dtype=torch.long, device=device)
    end = torch.full_like(begin, seq_k)
    if mask.key_ids is not None:
        begin = torch.searchsorted(mask.key_ids, mask.query_ids[:, starts].contiguous(), side="left")
        end = torch.searchsorted(mask.key_ids, mask.query_ids[:, ends - 1].contiguous(), side="right")
    if causal:  # the block's last query sees keys j <= offset + (end - 1)
        end = torch.minimum(end, mask.kv_offsets.unsqueeze(1) + ends.unsqueeze(0))
    begin = torch.div(begin.clamp(0, seq_k), block_n, rounding_mode="floor") * block_n
    return torch.stack([begin, end.clamp(0, seq_k)], dim=-1).to(torch.int32).contiguous()


def _key_block_ranges(mask, causal, seq_q, seq_k, block_m, block_n):
    """`key_block_ranges`, computed."""
    batch, device = mask.kv_offsets.shape[0], mask.kv_offsets.device
    starts = torch.arange(0, seq_k, block_n, device=device)
    ends = torch.clamp(starts + block_n, max=seq_k)
    begin = torch.zeros(batch, starts.numel(), dtype=torch.long, device=device)
    end = torch.full_like(begin, seq_q)
    if mask.key_ids is not None:
        begin = torch.searchsorted(mask.query_ids, mask.key_ids[:, starts].contiguous(), side="left")
        end = torch.searchsorted(mask.query_ids, mask.key_ids[:, ends - 1].contiguous(), side="right")
    if causal:  # key j is seen by queries i >= j - offset
        begin = torch.maximum(begin, starts.unsqueeze(0) - mask.kv_offsets.unsqueeze(1))
    begin = torch.div(begin.clamp(0, seq_q), block_m, rounding_mode="floor") * block_m
    return torch.stack([begin, end.clamp(0, seq_q)], dim=-1).to(torch.int32).contiguous()


_BLOCK_COUNTS: dict[str, int] | None = None


@contextlib.contextmanager
def count_attention_blocks() -> Iterator[dict[str, int]]:
    """Count the (query block, key block) tiles the Triton attention kernels compute inside the ``with`` block.

    Yields a dict that fills with ``"forward"``, ``"backward_dkdv"`` and ``"backward_dq"`` counts, summed over
    (batch, head) programs (the dk/dv kernel counts each query head of a kv head's group). A test hook: the
    kernels then store one count per program, which costs a little.
    """
    global _BLOCK_COUNTS
    previous, counts = _BLOCK_COUNTS, {"forward": 0, "backward_dkdv": 0, "backward_dq": 0}
    _BLOCK_COUNTS = counts
    try:
        yield counts
    finally:
        _BLOCK_COUNTS = previous


def block_counter(num_programs: int, device: torch.device) -> torch.Tensor | None:
    """A per-program counter tensor while `count_attention_blocks` is active, else ``None``."""
    return None if _BLOCK_COUNTS is None else torch.zeros(num_programs, dtype=torch.int32, device=device)


def record_blocks(kind: str, counter: torch.Tensor | None) -> None:
    """Add a kernel launch's per-program counts to the active `count_attention_blocks` dict."""
    if counter is not None and _BLOCK_COUNTS is not None:
        _BLOCK_COUNTS[kind] += int(counter.sum())
