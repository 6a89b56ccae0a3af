"""Communication cost of 1D, 2D, 2.5D and 3D tensor parallelism, per layer, forward + backward, per rank.

Each function returns a `Cost`: the bytes one rank moves (the `colo.comm.CommTracker` formula volume: an all-reduce
of S bytes over n ranks moves 2 (n - 1) / n S, a reduce-scatter or all-gather (n - 1) / n S of the full tensor, a
broadcast S) and the number of collective calls, so ``Cost.time(alpha, beta) = messages * alpha + bytes / beta``
is the usual latency-bandwidth model. The 2D / 2.5D / 3D formulas are those of `colo.tensor.tp2d` / `tp3d` exactly
(`tests/test_tp_cost.py` checks them against the tracker); 1D is Megatron-LM's `ColumnParallelLinear` /
`RowParallelLinear` pair.

Shapes: ``tokens`` is the number of rows (batch x sequence) of the whole activation the tensor-parallel group
works on, ``e`` the element size in bytes. 2D / 2.5D: P = d q^2 ranks, each holding ``tokens / (d q)`` rows of
``hidden / q`` features. So a 2D linear moves O(tokens * hidden / q) per rank where 1D's all-reduce moves
2 (P - 1) / P * tokens * hidden: the published comparison (Xu et al., 2021; Wang et al., 2021).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """Bytes moved by one rank and collective calls it makes.

    Attributes:
        bytes: formula volume per rank.
        messages: collective calls (the latency term counts each once).
    """

    bytes: float
    messages: int

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.messages + other.messages)

    def __mul__(self, times: int) -> Cost:
        return Cost(self.bytes * times, self.messages * times)

    def time(self, alpha: float, beta: float) -> float:
        """Seconds at ``alpha`` seconds per message and ``beta`` bytes per second."""
        return self.messages * alpha + self.bytes / beta


NONE = Cost(0.0, 0)


def all_reduce(n: int, numel: float, e: int) -> Cost:
    """An all-reduce of ``numel`` elements over ``n`` ranks (nothing when ``n`` is 1)."""
    return Cost(2 * (n - 1) / n * numel * e, 1) if n > 1 else NONE


def reduce_scatter(n: int, numel: float, e: int) -> Cost:
    """A reduce-scatter of a full tensor of ``numel`` elements over ``n`` ranks."""
    return Cost((n - 1) / n * numel * e, 1) if n > 1 else NONE


def all_gather(n: int, numel: float, e: int) -> Cost:
    """An all-gather whose output holds ``numel`` elements, over ``n`` ranks."""
    return Cost((n - 1) / n * numel * e, 1) if n > 1 else NONE


def broadcast(n: int, numel: float, e: int) -> Cost:
    """A broadcast of ``numel`` elements over ``n`` ranks."""
    return Cost(numel * e, 1) if n > 1 else NONE


# --- 1D (Megatron-LM) ------------------------------------------------------------------------------------------


def linear_1d(tokens: int, in_features: int, out_features: int, p: int, *, kind: str, e: int = 4) -> Cost:
    """A 1D linear over ``p`` ranks, forward + backward: ``kind="column"`` all-reduces the input gradient
    (``tokens x in``) in backward, ``"row"`` the output (``tokens x out``) in forward."""
    if kind == "column":
        return all_reduce(p, tokens * in_features, e)
    if kind == "row":
        return all_reduce(p, tokens * out_features, e)
    raise ValueError(f"linear_1d: kind={kind!r}; use 'column' or 'row'")


def vocab_cross_entropy_1d(tokens: int, p: int) -> Cost:
    """Vocabulary-parallel cross-entropy over ``p`` ranks: an all-reduce (max) of one float32 per row and one
    (sum) of two."""
    return all_reduce(p, tokens, 4) + all_reduce(p, 2 * tokens, 4)


def vocab_embedding_1d(tokens: int, hidden: int, p: int, e: int = 4) -> Cost:
    """Vocabulary-parallel embedding over ``p`` ranks: an all-reduce of the output in forward."""
    return all_reduce(p, tokens * hidden, e)


# --- 2D / 2.5D (colo.tensor.tp2d) ------------------------------------------------------------------------------


def _rows(tokens: int, q: int, d: int) -> float:
    return tokens / (d * q)


def linear_2d(
    tokens: int, in_features: int, out_features: int, q: int, d: int = 1, *, bias: bool = True, e: int = 4
) -> Cost:
    """`Linear2D`, forward + backward: 2q broadcasts each way (``x`` blocks along the row, ``W`` blocks along the
    column), a reduce-scatter of the input gradient along the row and of the weight gradient along the column,
    an all-reduce of the weight gradient over ``tp_dep`` (2.5D) and of the bias gradient over the batch axes."""
    m = _rows(tokens, q, d)
    steps = broadcast(q, m * in_features / q, e) + broadcast(q, out_features * in_features / q**2, e)
    cost = steps * (2 * q)
    cost = cost + reduce_scatter(q, m * in_features, e) + reduce_scatter(q, out_features / q * in_features, e)
    cost = cost + all_reduce(d, out_features * in_features / q**2, e)
    if bias:
        cost = cost + all_reduce(d * q, out_features / q, e)
    return cost


def norm_2d(tokens: int, hidden: int, q: int, d: int = 1, *, kind: str, e: int = 4) -> Cost:
    """`LayerNorm2D` (``kind="layernorm"``: two all-reduces of one value per row each way, statistics in ``e``)
    or `RMSNorm2D` (``"rmsnorm"``: one each way, in float32), plus the scale's (and shift's) gradient all-reduce
    over the batch axes."""
    m = _rows(tokens, q, d)
    if kind == "layernorm":
        stats = all_reduce(q, m, e) * 4
        params = all_reduce(d * q, hidden / q, e) * 2
    elif kind == "rmsnorm":
        stats = all_reduce(q, m, 4) * 2
        params = all_reduce(d * q, hidden / q, e)
    else:
        raise ValueError(f"norm_2d: kind={kind!r}; use 'layernorm' or 'rmsnorm'")
    return stats + params


def embedding_2d(vocab: int, hidden: int, q: int, d: int = 1, e: int = 4) -> Cost:
    """`Embedding2D`: the weight gradient (``vocab x hidden / q``) all-reduced over the batch axes."""
    return all_reduce(d * q, vocab * hidden / q, e)


def vocab_embedding_2d(tokens: int, hidden: int, q: int, d: int = 1, e: int = 4) -> Cost:
    """`VocabParallelEmbedding2D`: a reduce-scatter of the ``tokens x hidden / q`` partial lookups over the batch
    axes in forward, an all-gather of its gradient in backward."""
    return reduce_scatter(d * q, tokens * hidden / q, e) + all_gather(d * q, tokens * hidden / q, e)


def cross_entropy_2d(tokens: int, q: int, d: int = 1) -> Cost:
    """`cross_entropy_2d`: the vocabulary-parallel cross-entropy over the grid row (float32), then the loss sum
    and the target count all-reduced over the batch axes (one float32 each)."""
    m = _rows(tokens, q, d)
    return all_reduce(q, m, 4) + all_reduce(q, 2 * m, 4) + all_reduce(d * q, 1, 4) * 2


# --- 3D (colo.tensor.tp3d) ------------------------------------------------------------------------------------


def linear_3d(tokens: int, in_features: int, out_features: int, q: int, *, bias: bool = True, e: int = 4) -> Cost:
    """`Linear3D`, forward + backward: all-gathers of the input's sequence (``tokens x in / q^2`` gathered) and of
    the weight block over ``tp_col`` (``out x in / q^2``), a reduce-scatter of the partial output (``tokens x
    out / q^2``), and their adjoints in backward; the bias gradient all-reduced over q^2 ranks."""
    act_in, act_out, weight = (
        tokens * in_features / q**2,
        tokens * out_features / q**2,
        out_features * in_features / q**2,
    )
    cost = (all_gather(q, act_in, e) + all_gather(q, weight, e) + reduce_scatter(q, act_out, e)) * 2
    if bias:
        cost = cost + all_reduce(q * q, out_features / q, e)
    return cost


def norm_3d(tokens: int, hidden: int, q: int, *, kind: str, e: int = 4) -> Cost:
    """`LayerNorm3D`: per-row statistics all-reduced over the hidden axis (LayerNorm: two each way in ``e``; RMS:
    one each way in float32), the scale's (and shift's) gradient over the q^2 other ranks."""
    rows = tokens / q**2
    if kind == "layernorm":
        return all_reduce(q, rows, e) * 4 + all_reduce(q * q, hidden / q, e) * 2
    if kind == "rmsnorm":
        return all_reduce(q, rows, 4) * 2 + all_reduce(q * q, hidden / q, e)
    raise ValueError(f"norm_3d: kind={kind!r}; use 'layernorm' or 'rmsnorm'")


def embedding_3d(vocab: int, hidden: int, q: int, e: int = 4) -> Cost:
    """`Embedding3D`: the weight gradient (``vocab x hidden / q``) all-reduced over the q^2 ranks of
    ``tp_row`` and ``tp_col``."""
    return all_reduce(q * q, vocab * hidden / q, e)


def vocab_embedding_3d(tokens: int, hidden: int, q: int, e: int = 4) -> Cost:
    """`VocabParallelEmbedding3D`: a reduce-scatter of the ``tokens x hidden / q`` partial lookups over the q^2 ranks
    of ``tp_row`` x ``tp_col`` in forward, an all-gather of its gradient in backward."""
    return reduce_scatter(q * q, tokens * hidden / q, e) + all_gather(q * q, tokens * hidden / q, e)


def cross_entropy_3d(tokens: int, q: int) -> Cost:
    """`cross_entropy_3d`: the vocabulary-parallel cross-entropy over ``tp_row`` (float32, ``tokens / q^2`` rows),
    then the loss sum and the target count over the q^2 ranks of ``tp_dep`` and ``tp_col``."""
    rows = tokens / q**2
    return all_reduce(q, rows, 4) + all_reduce(q, 2 * rows, 4) + all_reduce(q * q, 1, 4) * 2


# --- a Llama block ---------------------------------------------------------------------------------------------


def llama_block(
    scheme: str, tokens: int, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, p: int, **kw
) -> Cost:
    """One Llama decoder layer (q, k, v, o, gate, up, down projections, two RMSNorms; no biases), forward +
    backward, under ``scheme`` on ``p`` ranks (``depth=d`` for 2.5D; element size ``e``, default 2)."""
    e = kw.get("e", 2)
    kv = hidden // num_heads * num_kv_heads
    if scheme == "1d":
        # Megatron: the q/k/v and gate/up column linears share one input-gradient all-reduce each; o and down
        # all-reduce their outputs.
        return (
            linear_1d(tokens, hidden, 0, p, kind="column", e=e) * 2
            + linear_1d(tokens, 0, hidden, p, kind="row", e=e) * 2
        )
    linears = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]
    linears += [(hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    cost = NONE
    if scheme == "3d":
        q = round(p ** (1 / 3))
        if q**3 != p:
            raise ValueError(f"llama_block: p={p} is not a cube for scheme '3d'")
        for n_in, n_out in linears:
            cost = cost + linear_3d(tokens, n_in, n_out, q, bias=False, e=e)
        # plus the keys and values all-gathered over the sequence axis (reduce-scattered in backward)
        kv_bytes = all_gather(q, tokens * kv / q**2, e) + reduce_scatter(q, tokens * kv / q**2, e)
        return cost + kv_bytes * 2 + norm_3d(tokens, hidden, q, kind="rmsnorm", e=e) * 2
    d = kw.get("depth", 1) if scheme == "2.5d" else 1
    q = round((p // d) ** 0.5)
    if d * q * q != p:
        raise ValueError(f"llama_block: p={p} is not {d} x q^2 for scheme {scheme!r}")
    for n_in, n_out in linears:
        cost = cost + linear_2d(tokens, n_in, n_out, q, d, bias=False, e=e)
    return cost + norm_2d(tokens, hidden, q, d, kind="rmsnorm", e=e) * 2
