"""`PagedKVCache`: a block-allocated key/value cache with a fixed budget, for continuous batching (Kwon et al.,
2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention").

Every decoder layer owns one key pool and one value pool of ``num_blocks * block_size`` token slots
(``(slots, num_kv_heads, head_dim)``, the model's dtype and device), allocated once. A sequence owns a *block table*:
the ids of the blocks holding its tokens in order, so token ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``. Blocks come from a free list and go back to it when the
sequence finishes or is preempted; nothing is ever copied between blocks.

Automatic prefix caching (vLLM's, Kwon et al.; on unless ``enable_prefix_caching=False``): a *full* block is named by
a hash of its parent block's hash and its own token ids (SHA-256, so the name covers the whole prefix before it and a
collision would need a SHA-256 one), and a hash -> block table finds it again. `match_prefix` returns the blocks
already holding a new sequence's leading full blocks, `allocate` with ``prefix=`` shares them (a reference count per
block), and `cache_full_blocks` names a sequence's full blocks once their keys and values are (being) written. A
freed block whose reference count drops to zero stays cached: it is reused by a later `match_prefix`, and it is only
evicted, least recently freed first (a sequence's tail blocks before its head), when an allocation finds no block
that holds nothing. A block is only ever written while it is its sequence's partial last block, never once full, so
sharing full blocks is read-only.

A forward over several sequences (each continuing its own cached tokens with its own number of new ones) goes
through a `PagedBatch`: it is what `colo.apps.models.llama.Llama.hidden_states` takes as ``kv_cache``, with per-row
``position_ids``. Each layer's attention (`PagedLayer.attend`) writes the new keys (after RoPE) and values into
their slots, gathers each row's slots into a contiguous ``(rows, longest context, kv_heads, head_dim)`` view, and
runs ``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask per row: a query sees only its own
sequence's keys at or before its own position, so rows of different lengths never see each other's tokens nor the
padding of the gather. The gather is a copy of the rows' context per layer: the reference path (on CPU, and the
fallback on CUDA); a fused paged-attention kernel reading the pools in place is left for later.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama.kv_cache import check_positive_ints


def _cache_shape(model: nn.Module) -> tuple[int, int, int, torch.dtype, torch.device]:
    """``(num_layers, num_kv_heads, head_dim, dtype, device)`` of a native Llama (this rank's kv heads under tp)."""
    layers = list(model.layers.values())
    if not layers:
        raise ValueError("PagedKVCache: the model has no decoder layers to cache")
    attention = layers[0].self_attn
    weight = next(attention.qkv_proj.parameters(), None)  # Linear, or a tp QKVParallelLinear's q_weight
    if weight is None:  # a weight-only quantized projection (colo.apps.quant) holds buffers: the norm's dtype
        weight = layers[0].input_layernorm.weight
    return len(layers), attention.num_kv_heads, attention.head_dim, weight.dtype, weight.device


class PagedKVCache:
    """Key and value pools of fixed-size blocks, a free list, and one block table per sequence.

    Args:
        num_layers (int): decoder layers of the model.
        num_blocks (int): blocks in the pool (the budget).
        block_size (int): tokens per block.
        num_kv_heads (int): key/value heads of one layer (this rank's count in a tensor-parallel model).
        head_dim (int): size of one head.
        dtype (torch.dtype): dtype of the pools (the model's). Default: ``torch.float32``.
        device (torch.device | str | None): where the pools live. Default: ``None`` (the current default device).
        enable_prefix_caching (bool): keep full blocks named by their tokens for later sequences with the same
            prefix (see the module docstring). Default: ``True``.

    Attributes:
        keys (list[torch.Tensor]): per layer, ``(num_blocks * block_size, num_kv_heads, head_dim)`` key slots.
        values (list[torch.Tensor]): per layer, the value slots, shaped like ``keys``.
        block_tables (dict[str, list[int]]): each sequence's blocks, in token order.
        num_prefix_hit_blocks (int): blocks handed to sequences by `allocate` with ``prefix=`` (reused, not
            recomputed) so far.
        num_evicted_blocks (int): cached blocks evicted so far to make room.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        enable_prefix_caching: bool = True,
    ):
        check_positive_ints(
            "PagedKVCache",
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))  # unreferenced blocks holding nothing; pop() = lowest id
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._refs = [0] * num_blocks  # sequences holding each block
        self._block_hash: dict[int, bytes] = {}  # cached block -> its hash
        self._cached: dict[bytes, int] = {}  # hash -> cached block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence holds, oldest first
        self._seq_hashes: dict[str, list[bytes]] = {}  # each sequence's full-block hashes, in order
        self.num_prefix_hit_blocks = 0
        self.num_evicted_blocks = 0

    @classmethod
    def for_model(
        cls, model: nn.Module, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> PagedKVCache:
        """A cache shaped for a native `Llama` (its layers, this rank's kv heads, its dtype and device)."""
        num_layers, num_kv_heads, head_dim, dtype, device = _cache_shape(model)
        return cls(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            enable_prefix_caching=enable_prefix_caching,
        )

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int) -> int:
        """Bytes one block takes over all layers, keys and values (this rank's share under tp)."""
        num_layers, num_kv_heads, head_dim, dtype, _ = _cache_shape(model)
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: empty ones and cached ones that can be evicted."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks named by their prefix (held by a sequence or evictable)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        """Sequences holding ``block``."""
        return self._refs[block]

    def nbytes(self) -> int:
        """Bytes of the key and value pools."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return math.ceil(num_tokens / self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks holding ``token_ids``' leading full blocks, longest match first to last (``[]`` with
        prefix caching off). The block holding the last token is never matched, so a sequence always computes at
        least its last token (its logits) and never writes into a shared block. Nothing is taken: pass the result
        to `allocate` as ``prefix``."""
        if not self.enable_prefix_caching:
            return []
        blocks, parent = [], b""
        for index in range((len(token_ids) - 1) // self.block_size):
            digest = self._hash(parent, token_ids, index)
            block = self._cached.get(digest)
            if block is None:
                break
            blocks.append(block)
            parent = digest
        return blocks

    def allocate(self, seq_id: str, num_tokens: int, *, prefix: Sequence[int] = ()) -> bool:
        """Grow ``seq_id``'s block table to hold ``num_tokens`` tokens; ``False`` (and nothing taken) when too few
        blocks are free.

        Args:
            seq_id (str): the sequence.
            num_tokens (int): tokens its table must cover.
            prefix (Sequence[int]): for a sequence without blocks, `match_prefix`'s cached blocks to start its table
                with (shared, their tokens already computed); the rest are fresh blocks, evicting cached ones no
                sequence holds, least recently freed first, once no empty block is left. Default: ``()``.
        """
        table = self.block_tables.get(seq_id, [])
        if prefix and table:
            raise ValueError(f"PagedKVCache.allocate: {seq_id!r} already holds blocks; a prefix starts a new table")
        reclaimed = sum(self._refs[block] == 0 for block in prefix)  # evictable blocks the prefix takes back
        missing = max(self.blocks_for(num_tokens) - len(table) - len(prefix), 0)
        if missing > self.num_free_blocks - reclaimed:
            return False
        for block in prefix:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            table.append(block)
        if prefix:
            self._seq_hashes[seq_id] = [self._block_hash[block] for block in prefix]
            self.num_prefix_hit_blocks += len(prefix)
        for _ in range(missing):
            block = self._take_block()
            self._refs[block] = 1
            table.append(block)
        self.block_tables[seq_id] = table
        return True

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Name ``seq_id``'s full blocks among its first ``num_tokens`` tokens (``token_ids`` holds at least those)
        so later sequences can share them; call it once their keys and values are written, or in the forward that
        writes them before any row that reads them (a layer writes every row's keys before it reads any). A block
        whose hash already names another block stays private."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq_id, [])
        table = self.block_tables[seq_id]
        for index in range(len(hashes), num_tokens // self.block_size):
            digest = self._hash(hashes[-1] if hashes else b"", token_ids, index)
            hashes.append(digest)
            block = table[index]
            if digest not in self._cached and block not in self._block_hash:
                self._cached[digest] = block
                self._block_hash[block] = digest

    def free(self, seq_id: str) -> None:
        """Release ``seq_id``'s blocks (nothing if it holds none): a block no other sequence holds goes back to the
        free list, or, when cached, to the evictable ones (its tail blocks first, so they are evicted first)."""
        self._seq_hashes.pop(seq_id, None)
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._block_hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after the model's weights change, the cached keys and values are stale);
        blocks sequences hold stay theirs, unnamed."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._cached.clear()
        self._block_hash.clear()
        self._seq_hashes.clear()

    def _take_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash.pop(block)]
        self.num_evicted_blocks += 1
        return block

    def _hash(self, parent: bytes, token_ids: Sequence[int], index: int) -> bytes:
        """The hash of full block ``index`` of ``token_ids`` after the block hashed ``parent``."""
        size = self.block_size
        tokens = array("q", token_ids[index * size : (index + 1) * size])
        return hashlib.sha256(parent + tokens.tobytes()).digest()

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """The slots of ``seq_id``'s tokens ``start .. end - 1`` (its table must already cover them)."""
        table, size = self.block_tables[seq_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def batch(
        self, seq_ids: Sequence[str], starts: Sequence[int], num_new: Sequence[int], *, packed: bool = False
    ) -> PagedBatch:
        """The view of one forward: row ``i`` feeds ``num_new[i]`` tokens after ``starts[i]`` cached ones."""
        return PagedBatch(self, seq_ids, starts, num_new, packed=packed)

    def __repr__(self) -> str:
        k = self.keys[0]
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={k.shape[1]}, head_dim={k.shape[2]}, dtype={k.dtype}, free={self.num_free_blocks}, "
            f"cached={self.num_cached_blocks})"
        )


class PagedBatch:
    """One forward's rows over a `PagedKVCache`: the ``kv_cache`` argument of `Llama.hidden_states`.

    Row ``i`` holds ``starts[i]`` cached tokens and feeds ``num_new[i]`` new ones at positions
    ``starts[i] .. starts[i] + num_new[i] - 1``; the input is right-padded to the longest ``num_new``
    (`position_ids` gives the positions, 0 on padding; the padded queries' outputs are garbage to be dropped).
    With ``packed=True`` the input is instead one row of every row's new tokens back to back, ``(1, sum(num_new))``,
    as vLLM flattens a batch: the projections and the MLP run on real tokens only (with prompts of mixed lengths
    the padding is most of a prefill), and each layer's `PagedLayer.attend` scatters the queries into the padded
    rows for attention and gathers the outputs back. The rows' block tables must already cover their new tokens
    (`PagedKVCache.allocate`).

    Attributes:
        position_ids (torch.Tensor): ``(rows, max(num_new))`` (packed: ``(1, sum(num_new))``) RoPE positions of the
            input.
        length (int): ``0``: `Llama.hidden_states` offsets positions by it only when none are given.
    """

    paged = True

    def __init__(
        self,
        cache: PagedKVCache,
        seq_ids: Sequence[str],
        starts: Sequence[int],
        num_new: Sequence[int],
        *,
        packed: bool = False,
    ):
        if not (len(seq_ids) == len(starts) == len(num_new)) or not seq_ids:
            raise ValueError("PagedBatch: seq_ids, starts and num_new must be non-empty and of one length")
        if min(num_new) < 1 or min(starts) < 0:
            raise ValueError(f"PagedBatch: every row needs >= 1 new token and >= 0 cached ones: {num_new}, {starts}")
        self.cache = cache
        device = cache.device
        width = max(num_new)
        contexts = [s + n for s, n in zip(starts, num_new, strict=True)]
        longest = max(contexts)
        write_slots, write_index, read_slots = [], [], []
        for row, (seq_id, start, new, context) in enumerate(zip(seq_ids, starts, num_new, contexts, strict=True)):
            write_slots += cache.slots(seq_id, start, context)
            write_index += range(row * width, row * width + new)
            read_slots.append(cache.slots(seq_id, 0, context) + [0] * (longest - context))
        self.write_slots = torch.tensor(write_slots, dtype=torch.long, device=device)
        self.write_index = torch.tensor(write_index, dtype=torch.long, device=device)
        self.read_slots = torch.tensor(read_slots, dtype=torch.long, device=device)
        self.flat_read_slots = self.read_slots.view(-1)
        starts_t = torch.tensor(starts, dtype=torch.long, device=device)[:, None]
        new_t = torch.tensor(num_new, dtype=torch.long, device=device)[:, None]
        query = torch.arange(width, device=device)[None, :]
        valid = query < new_t  # (rows, width)
        self.position_ids = torch.where(valid, starts_t + query, 0)
        # a query sees keys at or before its position; padded queries see their row's whole context (never empty)
        last = torch.where(valid, starts_t + query, starts_t + new_t - 1)  # (rows, width)
        keys = torch.arange(longest, device=device)[None, None, :]
        self.mask = (keys <= last[:, :, None])[:, None]  # (rows, 1, width, longest)
        self.num_new = list(num_new)
        self.length = 0
        self.rows, self.width = len(num_new), width
        self.packed = packed
        if packed:  # the packed input's token j is the padded layout's token write_index[j]
            self.position_ids = self.position_ids.reshape(-1).index_select(0, self.write_index)[None]

    def check_input(self, batch: int, seq: int, *, num_layers: int, device: torch.device) -> None:
        """Raise a `ValueError` when the input is not this batch's ``(rows, max(num_new))`` on the cache's device."""
        rows, width = self.position_ids.shape
        if (batch, seq) != (rows, width):
            layout = "packed " if self.packed else ""
            raise ValueError(
                f"PagedBatch: the input is {(batch, seq)} but the {layout}batch was built for {(rows, width)}"
            )
        if num_layers != self.cache.num_layers:
            raise ValueError(
                f"PagedKVCache: built for {self.cache.num_layers} layers but the model has {num_layers}; build it "
                "with PagedKVCache.for_model(model, ...)"
            )
        if device != self.cache.device:
            raise ValueError(f"PagedKVCache: the cache is on {self.cache.device} but the input is on {device}")

    def layer(self, index: int) -> PagedLayer:
        """Layer ``index``'s view, which `LlamaAttention` attends through."""
        return PagedLayer(self, index)

    def advance(self, num_tokens: int) -> None:
        """Nothing: each row's cached length is kept by its owner (the serving engine)."""


class PagedLayer:
    """One layer's view of a `PagedBatch` (``paged = True`` tells `LlamaAttention` to call `attend`)."""

    paged = True

    def __init__(self, batch: PagedBatch, index: int):
        self.batch, self.index = batch, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """Write the new ``k``, ``v`` into their slots and attend ``q`` over each row's own cached and new keys.

        Args:
            q (torch.Tensor): ``(rows, width, heads, head_dim)`` queries after RoPE (packed: ``(1, tokens, heads,
                head_dim)``).
            k (torch.Tensor): ``(rows, width, kv_heads, head_dim)`` new keys after RoPE (padding rows ignored;
                packed: ``(1, tokens, kv_heads, head_dim)``).
            v (torch.Tensor): the new values, shaped like ``k``.
            scale (float | None): score scale; ``None``: ``1 / sqrt(head_dim)``.

        Returns:
            torch.Tensor: shaped like ``q``; the padded queries' rows are not meaningful.
        """
        batch, cache = self.batch, self.batch.cache
        pool_k, pool_v = cache.keys[self.index], cache.values[self.index]
        rows, width, kv_heads, head_dim = k.shape
        if pool_k.shape[1:] != (kv_heads, head_dim):
            raise ValueError(
                f"PagedKVCache: layer {self.index} caches (kv_heads, head_dim)={tuple(pool_k.shape[1:])} but got keys "
                f"{tuple(k.shape)}; build the cache with PagedKVCache.for_model(model, ...) after any parallelize_llama"
            )
        if batch.packed:
            return self._attend_packed(q, k, v, scale)
        flat_k = k.reshape(rows * width, kv_heads, head_dim).index_select(0, batch.write_index)
        flat_v = v.reshape(rows * width, kv_heads, head_dim).index_select(0, batch.write_index)
        pool_k.index_copy_(0, batch.write_slots, flat_k.to(pool_k.dtype))
        pool_v.index_copy_(0, batch.write_slots, flat_v.to(pool_v.dtype))
        return self._attention(q, pool_k, pool_v, scale)

    def _attention(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, scale) -> torch.Tensor:
        """Padded ``(rows, width, heads, head_dim)`` queries over each row's keys and values gathered from the pool."""
        batch = self.batch
        # the gather, (rows, longest, kv_heads, head_dim); index_select on the flat slots is several times faster on
        # the CPU than advanced indexing with the (rows, longest) table
        shape = (*batch.read_slots.shape, *pool_k.shape[1:])
        keys = pool_k.index_select(0, batch.flat_read_slots).view(shape).to(q.dtype)
        values = pool_v.index_select(0, batch.flat_read_slots).view(shape).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=batch.mask,
            scale=scale,
            enable_gqa=q.shape[2] != keys.shape[2],
        )
        return out.transpose(1, 2)

    def _attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale) -> torch.Tensor:
        """`attend` on the packed layout: every token of ``k`` / ``v`` is real; the queries go to the padded rows
        for attention and their outputs come back."""
        batch, cache = self.batch, self.batch.cache
        pool_k, pool_v = cache.keys[self.index], cache.values[self.index]
        heads, head_dim = q.shape[2:]
        pool_k.index_copy_(0, batch.write_slots, k[0].to(pool_k.dtype))
        pool_v.index_copy_(0, batch.write_slots, v[0].to(pool_v.dtype))
        padded = q.new_zeros(batch.rows * batch.width, heads, head_dim).index_copy_(0, batch.write_index, q[0])
        out = self._attention(padded.view(batch.rows, batch.width, heads, head_dim), pool_k, pool_v, scale)
        return out.reshape(batch.rows * batch.width, heads, head_dim).index_select(0, batch.write_index)[None]
