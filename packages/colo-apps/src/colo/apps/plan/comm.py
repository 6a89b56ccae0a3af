"""Communication of one training step per rank, by collective and mesh axis, in `colo.comm.CommTracker`'s units.

Each entry is the formula volume ("bus bytes") colo's tracker records for the logical collective: all-reduce
``2 (n - 1) / n * S``, all-gather ``(n - 1) / n * S`` of the output, reduce-scatter ``(n - 1) / n * S`` of the input,
all-to-all ``(n - 1) / n * S`` of the input, send / recv / broadcast ``S``. The calls are the ones colo makes:

- data axes (``dp``, or ``dp+sp`` where Ulysses / ring attention replicate the weights): one collective per chunk
  of this rank's chunks (`colo.zero.plan_chunks`'s sizes): stage 0 all-reduces each gradient chunk, stages 1-3
  reduce-scatter it (stage 1 once per step, after accumulating; stages 0/2/3 every microbatch unless a pipeline
  drives the sync once per step), stages 1/2 all-gather the updated parameters after the step, stage 3 gathers every
  chunk before forward and all but the last-used one again in backward (Gemini: all of them) in every microbatch,
  under a pipeline once per step (held until the step's reduction);
- ``tp`` (Megatron 1D): per microbatch, forward all-reduces after ``o_proj`` / ``down_proj`` and the vocabulary-
  parallel embedding, backward all-reduces of the inputs of q/k/v, gate, up and ``lm_head``, and the two fp32
  all-reduces of the vocabulary-parallel cross-entropy; with Megatron-SP the all-reduces become all-gathers /
  reduce-scatters of the sequence shards and the norms' weight gradients are all-reduced;
- ``sp``: Ulysses' four all-to-alls per layer each way; ring attention's k/v blocks passed round the ring (forward
  ``n - 1`` blocks; backward ``n - 1`` blocks and ``n`` fp32 dK/dV accumulators);
- ``ep`` (mixture of experts, the ``expert`` plugin): per MoE layer and microbatch the int64 token counts, then the
  routed rows to the experts' ranks and back (uneven all-to-alls: the rows sent to other ranks), again in backward;
  the volumes follow the routing (even routing unless a run's own is given); dense chunks sync over ``dp+ep``,
  expert chunks over ``dp``; with Ulysses or ring sp (HybridParallel's ep x sp) the sp ranks join both (``dp+ep+sp``,
  ``dp+sp``), each block routes the rank's piece of the sequences and its load-balancing loss all-reduces its fp32
  assignment counts (``E`` per sequence, or per microbatch) over ``sp`` in every forward;
- full and selective activation checkpointing rerun each layer's forward collectives in backward up to the last
  saved tensor (selective keeps matmul and attention outputs only, so collectives are recomputed too): tp the
  o_proj all-reduce (Megatron-SP: the layer's three input gathers and o_proj's reduce-scatter), Ulysses its four
  all-to-alls, ring attention its ``n - 1`` forward blocks, expert parallelism its three forward all-to-alls;
- ``pp``: activations sent forward and gradients back per microbatch, the loss broadcast from the last stage;
- scalars: the loss mean over the data ranks and the gradient norm (fp64) over the data and model-parallel axes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..models.llama import LlamaConfig
from .layout import Layout
from .memory import expected_routing_kept, expert_parallel, is_moe, moe_layers, stage_layers, static_memory

MESH_ORDER = ("pp", "dp", "ep", "sp", "tp")


def axis_name(layout: Layout, *axes: str) -> str:
    """The tracker's name of a group over ``axes``: one axis, or the axes in mesh order joined by ``+``."""
    kept = [a for a in MESH_ORDER if a in axes]
    return "+".join(kept)


def group_size(layout: Layout, *axes: str) -> int:
    size = 1
    for axis in axes:
        size *= getattr(layout, axis)
    return size


def expected_routing(config: LlamaConfig, layout: Layout, tokens: int) -> tuple[float, float, float]:
    """``(assignments kept, rows sent to the other ep ranks, rows received from them)`` of one MoE block's dispatch
    on one rank, when the router spreads the ``tokens * k`` assignments evenly over the experts (the load-balancing
    loss's target): each expert keeps ``tokens * k / E`` of them, or the capacity
    ``ceil(capacity_factor * tokens * k / E)`` when that is smaller (`colo.tensor.moe.permute`), and
    ``(ep - 1) / ep`` of the experts live on other ranks."""
    kept = expected_routing_kept(config, tokens)
    others = kept * (layout.ep - 1) / layout.ep
    return kept, others, others


@dataclass(frozen=True)
class DispatchBounds:
    """What one MoE block's dispatch can move on one rank for ``tokens`` tokens (`dispatch_bounds`), in rows (one
    row is ``hidden_size`` elements in the compute dtype; the combine moves the same rows back)."""

    even_sent: float
    """Rows sent to the other ep ranks under even routing (`expected_routing`; received alike)."""
    max_sent: int
    """At most: every kept assignment to an expert on another rank (``tokens * min(k, E - E / ep)``)."""
    max_received: int
    """At most: every other rank's tokens choosing this rank's experts (``(ep - 1) * tokens * min(k, E / ep)``),
    or the capacity of this rank's experts when that is smaller."""
    max_ranks_per_token: int
    """Ranks one token's rows reach: ``min(k, ep)``, or ``topk_group`` with group-limited routing whose groups are
    the ep ranks (``n_group == ep``: DeepSeek-V3's node-limited routing). colo sends one row per assignment (not one
    per destination rank), so the limit bounds the ranks, not the rows."""


def dispatch_bounds(config: LlamaConfig, layout: Layout, tokens: int) -> DispatchBounds:
    """Bounds of one MoE block's dispatch on one rank (`DispatchBounds`), for ``tokens`` tokens per ep rank."""
    from colo.tensor.moe import expert_capacity

    experts, top_k, ep = config.num_local_experts, config.num_experts_per_tok, layout.ep
    local = experts // ep
    even = expected_routing(config, layout, tokens)[1]
    max_sent = tokens * min(top_k, experts - local)
    max_received = (ep - 1) * tokens * min(top_k, local)
    if config.capacity_factor is not None:
        capacity = expert_capacity(tokens, top_k=top_k, num_experts=experts, capacity_factor=config.capacity_factor)
        max_sent = min(max_sent, capacity * (experts - local))
        max_received = min(max_received, capacity * local * (ep - 1))
    ranks = min(top_k, ep)
    if config.topk_group is not None and config.n_group == ep:
        ranks = min(ranks, config.topk_group)
    return DispatchBounds(even, max_sent, max_received, ranks)


def step_communication(
    config: LlamaConfig,
    layout: Layout,
    seq_len: int,
    *,
    pp_rank: int = 0,
    no_decay_vectors: bool = False,
    routing: list[tuple[float, float, float]] | None = None,
) -> dict:
    """Bytes per rank of one step, ``{(op, axis): bytes}`` (groups of one rank move nothing and are left out).

    Args:
        config: the model.
        layout: the layout (``micro_batch_size`` sequences of ``seq_len`` tokens per microbatch and data rank).
        seq_len: tokens per sequence.
        pp_rank: the pipeline rank whose traffic is counted.
        no_decay_vectors: the optimizer's param groups (`colo.apps.plan.memory.rank_parameters`), which the chunks
            follow.
        routing: mixture of experts under ``ep > 1``: ``(assignments kept, rows sent to other ranks, rows received
            from them)`` of each MoE block's dispatch in each microbatch (``num_microbatches`` x MoE layers, any
            order), as a run routed them; ``None``: `expected_routing` (even routing). The all-to-all volumes
            depend on the routing, so only a run's own routing reproduces CommTracker's bytes exactly.
    """
    volumes: dict[tuple[str, str], float] = defaultdict(float)

    def add(op: str, axes: tuple[str, ...], nbytes: float, calls: int = 1) -> None:
        n = group_size(layout, *axes)
        if n == 1 or calls == 0:
            return
        factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 1.0, "broadcast": 1.0}.get(op, (n - 1) / n)
        volumes[(op, axis_name(layout, *axes))] += factor * nbytes * calls

    microbatches = layout.num_microbatches
    ec = layout.compute_bytes
    er = ec  # gradients are reduced in the compute dtype
    sequence_axes = ("sp",) if layout.sp > 1 else ()
    data_axes = ("dp", *sequence_axes)
    expert = expert_parallel(layout)
    if expert:  # the data ranks (dp, ep, sp): dense chunks over all, expert chunks over dp (and sp)
        data_axes = ("dp", "ep", *sequence_axes)
    expert_axes = ("dp", *sequence_axes)
    tokens = layout.micro_batch_size * seq_len
    routed = tokens // layout.sp  # the tokens an MoE block routes: under Ulysses the rank's piece of the sequences
    h = config.hidden_size
    chunks = stage_layers(config, layout, pp_rank)
    num_layers = sum(len(layers) for layers, _, _ in chunks)
    first = any(f for _, f, _ in chunks)
    last = any(la for _, _, la in chunks)

    # --- data-parallel gradient and parameter sync over the chunks -------------------------------------------
    if layout.plugin != "ddp":
        static = static_memory(config, layout, pp_rank=pp_rank, no_decay_vectors=no_decay_vectors)
        stage = layout.stage
        syncs = 1 if (stage == 1 or layout.pp > 1) else microbatches
        dense_chunks = static.num_chunks - static.expert_chunks
        for index, numel in enumerate(static.chunk_numels):
            axes = data_axes if index < dense_chunks else expert_axes
            if stage == 0:
                add("all_reduce", axes, numel * er, syncs)
                continue
            add("reduce_scatter", axes, numel * er, syncs)
            if stage in (1, 2):
                add("all_gather", axes, numel * ec)
        # stage 3: each part (dense chunks, then expert chunks) gathers its own chunks over its own axes; a pipeline
        # gathers each chunk once per step (held until the step's reduction); otherwise every chunk before forward
        # and all but the part's last-used one again in backward (Gemini: all of them), every microbatch
        parts = [(static.chunk_numels[:dense_chunks], data_axes), (static.chunk_numels[dense_chunks:], expert_axes)]
        for numels, axes in parts if stage == 3 else ():
            if layout.pp > 1:
                for numel in numels:
                    add("all_gather", axes, numel * ec)
                continue
            backward = len(numels) if layout.plugin == "gemini" else len(numels) - 1
            for numel in numels:
                add("all_gather", axes, numel * ec, microbatches)
            for numel in numels[:backward]:
                add("all_gather", axes, numel * ec, microbatches)

    # layers whose forward full / selective activation checkpointing reruns in backward, with its collectives
    recomputed = num_layers if layout.activation_checkpointing in ("full", "selective") else 0

    # --- tensor parallelism ---------------------------------------------------------------------------------
    if layout.tp > 1:
        act = tokens * h * ec
        if layout.sp_mode == "megatron":
            gathers = 3 * num_layers + (1 if last else 0)  # q/k/v, gate, up, lm_head inputs
            scatters = 2 * num_layers + (1 if first else 0)  # o_proj, down_proj outputs, embedding
            # forward, re-gather, grads; checkpointing's recomputed forward gathers a layer's three inputs again and
            # reduce-scatters o_proj's output (it stops before down_proj, as in plain tp)
            add("all_gather", ("tp",), act, microbatches * (2 * gathers + scatters + 3 * recomputed))
            add("reduce_scatter", ("tp",), act, microbatches * (scatters + gathers - (1 if last else 0) + recomputed))
            norms = 2 * num_layers + (1 if last else 0)
            add("all_reduce", ("tp",), h * ec, microbatches * norms)  # sequence-sharded norms' weight gradients
            if last:
                add("all_reduce", ("tp",), act, microbatches)  # lm_head's input gradient
        else:
            # per dense layer: o_proj and down_proj's outputs forward, the q/k/v and gate/up inputs backward; an MoE
            # layer's block reads its input replicated over tp (the router, the shared experts and whole experts need
            # nothing; split experts sum their rows below): o_proj forward and q/k/v backward only
            num_moe = moe_layers(config, [i for layers, _, _ in chunks for i in layers])
            calls = 5 * num_layers - 3 * num_moe + (1 if first else 0) + (1 if last else 0)
            # full checkpointing reruns each layer's forward in backward: its o_proj all-reduce again, not down_proj's
            # (torch's checkpoint stops recomputing once the saved tensors are back, before the layer's last op)
            calls += recomputed
            if is_moe(config) and config.latent_attention:
                # multi-head latent attention: its q/k/v input gradient is not all-reduced; its query latent's
                # (q_b_proj's input; q_proj's: the tokens), its key/value latent's (kv_b_proj's input) and its rotary
                # key's are
                calls -= num_layers
                query = config.q_lora_rank or h
                latents = query + config.kv_lora_rank + config.qk_rope_head_dim
                add("all_reduce", ("tp",), tokens * latents * ec, microbatches * num_layers)
            add("all_reduce", ("tp",), act, microbatches * calls)
        if last and layout.pp == 1:  # vocabulary-parallel cross-entropy: max, then (sum of exp, target logit)
            add("all_reduce", ("tp",), tokens * 4, microbatches)
            add("all_reduce", ("tp",), 2 * tokens * 4, microbatches)

    # --- sequence parallelism -------------------------------------------------------------------------------
    if layout.sp > 1:
        local = tokens // layout.sp
        hd = config.head_dim
        heads, kv = config.num_attention_heads // layout.tp, config.num_key_value_heads
        if layout.sp_mode == "ulysses":
            q = local * heads * hd * ec
            kvb = local * kv * hd * ec
            # forward q, k, v in and the output back; backward the same four in reverse; full checkpointing reruns
            # the forward four
            add("all_to_all", ("sp",), 2 * (2 * q + 2 * kvb), microbatches * num_layers)
            add("all_to_all", ("sp",), 2 * q + 2 * kvb, microbatches * recomputed)
        elif layout.sp_mode == "ring":
            block = 2 * local * kv * hd * ec  # k and v of one sequence shard
            steps = layout.sp - 1
            # forward: n - 1 k/v blocks; backward: n - 1 blocks and n fp32 dK/dV accumulators (4 / ec times a
            # block); full / selective checkpointing reruns the forward's n - 1
            per_layer = steps + steps + layout.sp * 4 / ec
            add("send", ("sp",), block, microbatches * (num_layers * per_layer + recomputed * steps))
            add("recv", ("sp",), block, microbatches * (num_layers * per_layer + recomputed * steps))

    # --- expert parallelism: per MoE block and microbatch, the (ep, E / ep) int64 counts, then the rows to the
    # experts' ranks (dispatch) and back (combine); backward moves both again the other way; full checkpointing
    # reruns the forward's three
    layers = moe_layers(config, [i for layers, _, _ in chunks for i in layers])
    if layout.ep > 1 and layers:
        if routing is None:
            routing = [expected_routing(config, layout, routed)] * (microbatches * layers)
        elif len(routing) != microbatches * layers:
            raise ValueError(
                f"routing has {len(routing)} entries; give one (kept, sent, received) per microbatch and MoE layer "
                f"({microbatches} x {layers})"
            )
        row = h * ec
        # forward, backward, and recomputed in backward under full and selective checkpointing (the selective
        # policy keeps matmul outputs only: collectives are recomputed)
        passes = 2 + (1 if layout.activation_checkpointing in ("full", "selective") else 0)
        counts = layout.ep * (config.num_local_experts // layout.ep) * 8
        add("all_to_all", ("ep",), counts, len(routing) * (passes - 1))
        for _, sent, received in routing:
            volumes[("all_to_all", "ep")] += (sent + received) * row * passes
    # expert tensor parallelism: the rows reaching this rank's experts enter through a copy / all-reduce (their
    # input gradient all-reduced in backward) and leave summed over tp (forward), in the compute dtype
    if layout.expert_tensor_parallel and layers:
        if routing is None:
            routing = [expected_routing(config, layout, routed)] * (microbatches * layers)
        rows = sum(kept - sent + received for kept, sent, received in routing)
        forwards = 1 + (1 if layout.activation_checkpointing in ("full", "selective") else 0)
        add("all_reduce", ("tp",), rows * h * ec, forwards + 1)

    # Ulysses under expert parallelism: each MoE block's load-balancing loss sums its fp32 assignment counts (one row
    # of E per sequence, or one for the microbatch) over sp, in every forward (a checkpoint's recomputation too)
    if layout.sp > 1 and layers:
        groups = layout.micro_batch_size if config.aux_loss_type == "sequence" else 1
        forwards = 1 + (1 if layout.activation_checkpointing in ("full", "selective") else 0)
        add("all_reduce", ("sp",), groups * config.num_local_experts * 4, microbatches * layers * forwards)

    # --- pipeline -------------------------------------------------------------------------------------------
    if layout.pp > 1:
        act = tokens * h * ec
        for _, is_first, is_last in chunks:
            if not is_last:
                add("send", ("pp",), act, microbatches)  # forward activations
                add("recv", ("pp",), act, microbatches)  # their gradients
            if not is_first:
                add("recv", ("pp",), act, microbatches)
                add("send", ("pp",), act, microbatches)
        add("broadcast", ("pp",), 4)  # the loss, from the last stage

    # --- scalars --------------------------------------------------------------------------------------------
    add("all_reduce", data_axes, 8)  # the step's mean loss over the data ranks (fp64)
    if expert:  # the expert part of the squared norm within the stage (dp when sharded, tp), then over ep (and pp)
        within = (expert_axes if layout.stage != 0 else ()) + (("tp",) if layout.tp > 1 else ())
        if within and layers:
            add("all_reduce", within, 8)
        add("all_reduce", ("ep", "pp") if layout.pp > 1 else ("ep",), 8)
        if config.expert_bias:  # the tokens per expert of the stage's blocks, over the data ranks
            add("all_reduce", data_axes, 4 * config.num_local_experts, layers)
    norm_axes = (data_axes if layout.stage not in (0, -1) else ()) + (("tp",) if layout.tp > 1 else ())
    norm_axes += ("pp",) if layout.pp > 1 else ()
    if norm_axes and layout.plugin != "ddp":
        add("all_reduce", norm_axes, 8)  # the global gradient norm (fp64)
    return dict(volumes)


def bytes_by_axis(volumes: dict) -> dict[str, float]:
    """Sum of `step_communication` per axis name."""
    totals: dict[str, float] = defaultdict(float)
    for (_, axis), nbytes in volumes.items():
        totals[axis] += nbytes
    return dict(totals)
