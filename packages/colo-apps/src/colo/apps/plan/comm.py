"""Communication of one training step per rank, by collective and mesh axis, in `colo.comm.CommTracker`'s units.

Each entry is the formula volume ("bus bytes") colo's tracker records for the logical collective: all-reduce
``2 (n - 1) / n * S``, all-gather ``(n - 1) / n * S`` of the output, reduce-scatter ``(n - 1) / n * S`` of the input,
all-to-all ``(n - 1) / n * S`` of the input, send / recv / broadcast ``S``. The calls are the ones colo makes:

- data axes (``dp``, or ``dp+sp`` where Ulysses / ring attention replicate the weights): one collective per chunk
  of this rank's chunks (`colo.zero.plan_chunks`'s sizes): stage 0 all-reduces each gradient chunk, stages 1-3
  reduce-scatter it (stage 1 once per step, after accumulating; stages 0/2/3 every microbatch unless a pipeline
  drives the sync once per step), stages 1/2 all-gather the updated parameters after the step, stage 3 gathers every
  chunk before forward and all but the last-used one again in backward (Gemini: all of them);
- ``tp`` (Megatron 1D): per microbatch, forward all-reduces after ``o_proj`` / ``down_proj`` and the vocabulary-
  parallel embedding, backward all-reduces of the inputs of q/k/v, gate, up and ``lm_head``, and the two fp32
  all-reduces of the vocabulary-parallel cross-entropy; with Megatron-SP the all-reduces become all-gathers /
  reduce-scatters of the sequence shards and the norms' weight gradients are all-reduced;
- ``sp``: Ulysses' four all-to-alls per layer each way; ring attention's k/v blocks passed round the ring;
- full activation checkpointing reruns each layer's forward collectives in backward up to the last saved tensor
  (tp: the o_proj all-reduce; Ulysses: its four all-to-alls); not modelled for Megatron-SP and ring attention,
  whose recomputed traffic is not checked (ring's measured extra is 3 k/v blocks per layer at sp=2, unexplained);
- ``pp``: activations sent forward and gradients back per microbatch, the loss broadcast from the last stage;
- scalars: the loss mean over the data ranks and the gradient norm (fp64) over the data and model-parallel axes.
"""

from __future__ import annotations

from collections import defaultdict

from ..models.llama import LlamaConfig
from .layout import Layout
from .memory import stage_layers, static_memory

MESH_ORDER = ("pp", "dp", "sp", "tp")


def axis_name(layout: Layout, *axes: str) -> str:
    """The tracker's name of a group over ``axes``: one axis, or the axes in mesh order joined by ``+``."""
    kept = [a for a in MESH_ORDER if a in axes]
    return "+".join(kept)


def group_size(layout: Layout, *axes: str) -> int:
    size = 1
    for axis in axes:
        size *= getattr(layout, axis)
    return size


def step_communication(
    config: LlamaConfig, layout: Layout, seq_len: int, *, pp_rank: int = 0, no_decay_vectors: bool = False
) -> dict:
    """Bytes per rank of one step, ``{(op, axis): bytes}`` (groups of one rank move nothing and are left out).

    Args:
        config: the model.
        layout: the layout (``micro_batch_size`` sequences of ``seq_len`` tokens per microbatch and data rank).
        seq_len: tokens per sequence.
        pp_rank: the pipeline rank whose traffic is counted.
        no_decay_vectors: the optimizer's param groups (`colo.apps.plan.memory.rank_parameters`), which the chunks
            follow.
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
    data_axes = ("dp", "sp") if layout.sp > 1 else ("dp",)
    tokens = layout.micro_batch_size * seq_len
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
        for numel in static.chunk_numels:
            if stage == 0:
                add("all_reduce", data_axes, numel * er, syncs)
                continue
            add("reduce_scatter", data_axes, numel * er, syncs)
            if stage in (1, 2):
                add("all_gather", data_axes, numel * ec)
        if stage == 3:
            backward = static.num_chunks if layout.plugin == "gemini" else static.num_chunks - 1
            for numel in static.chunk_numels:
                add("all_gather", data_axes, numel * ec, microbatches)
            for numel in static.chunk_numels[:backward]:
                add("all_gather", data_axes, numel * ec, microbatches)

    # layers whose forward full activation checkpointing reruns in backward, with its collectives (tp plain and
    # Ulysses are checked against CommTracker; Megatron-SP and ring attention under it are not modelled)
    recomputed = num_layers if layout.activation_checkpointing == "full" else 0

    # --- tensor parallelism ---------------------------------------------------------------------------------
    if layout.tp > 1:
        act = tokens * h * ec
        if layout.sp_mode == "megatron":
            gathers = 3 * num_layers + (1 if last else 0)  # q/k/v, gate, up, lm_head inputs
            scatters = 2 * num_layers + (1 if first else 0)  # o_proj, down_proj outputs, embedding
            add("all_gather", ("tp",), act, microbatches * (2 * gathers + scatters))  # forward, re-gather, grads
            add("reduce_scatter", ("tp",), act, microbatches * (scatters + gathers - (1 if last else 0)))
            norms = 2 * num_layers + (1 if last else 0)
            add("all_reduce", ("tp",), h * 4, microbatches * norms)  # sequence-sharded norms' weight gradients
            if last:
                add("all_reduce", ("tp",), act, microbatches)  # lm_head's input gradient
        else:
            calls = 5 * num_layers + (1 if first else 0) + (1 if last else 0)
            # full checkpointing reruns each layer's forward in backward: its o_proj all-reduce again, not down_proj's
            # (torch's checkpoint stops recomputing once the saved tensors are back, before the layer's last op)
            calls += recomputed
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
            per_layer = steps + steps + 2 * steps  # forward k/v, backward k/v and their gradients
            add("send", ("sp",), block, microbatches * num_layers * per_layer)
            add("recv", ("sp",), block, microbatches * num_layers * per_layer)

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
