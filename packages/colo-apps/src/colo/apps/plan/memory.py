"""Memory of one training step per rank, term by term, for a Llama config and a `Layout`.

Static memory (model states) is not re-derived from a formula: the planner builds this rank's parameter list (the
shapes the tensor-parallel plan and the pipeline cut leave it, in registration order), packs it with colo.zero's
own `plan_chunks` (the padding search included), and counts the buffers `ZeroOptimizer` / `GeminiOptimizer` keep
per chunk, as their `memory_report()` counts them (storages counted once, fp32 masters aliased without mixed
precision, stage 1's gradient shard inside its full buffer, AdamW's ``step`` scalar per master).

Activations are counted per decoder layer from what the layer saves for backward (the saved tensors of colo's
Llama, read off `torch.autograd.graph.saved_tensors_hooks`: the layer's input, both norms' outputs and fp32
``rstd``, the fused q/k/v output, the rotated q and k, the attention output and its fp32 log-sum-exp, the residual,
the SwiGLU inputs and output), scaled by what tensor and sequence parallelism shard and what checkpointing keeps.
The same counts hold on GPU: colo's flash attention saves ``(out, lse)``, never the ``S x S`` scores.
Selective checkpointing keeps what `colo.apps.checkpointing.selective_policy` caches (every ``mm`` output and the
attention's ``(out, lse)``) plus the block's input; a pipeline's first stage holds the microbatches in flight that
colo.pipeline's simulator counts, its last stage the logits its cross-entropy saves.

Mixture of experts (`colo.apps.models.moe_llama`): the router, the routed experts (split over ``ep`` by the
``expert`` plugin or `HybridParallel`'s ``ep``, and over ``tp`` with expert tensor parallelism) and the shared experts
in registration order, dense first-k layers, multi-head latent attention (its heads split over ``tp``, its latents
whole); `colo.zero.ExpertParallelZero` packs the dense parameters (sharded over ``dp x ep``) and the experts (sharded
over ``dp``) into separate chunks, per pipeline stage; an MoE layer's saved tensors are `moe_saved_bytes`'s, MLA's
`_latent_attention_saved_elements`'. Under ep x Ulysses / ring sp the sp ranks are data ranks of both parts (dense over
``dp x ep x sp``, experts over ``dp x sp``) and each MoE block routes the rank's piece of the sequences.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..models.llama import LlamaConfig
from .layout import Layout


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as this rank holds it."""

    name: str
    numel: int
    group: int = 0
    expert: bool = False
    """An expert weight of an MoE block (``...mlp.experts.w1`` / ``w2`` / ``w3``): under the ``expert`` plugin it is
    packed into chunks of its own, sharded over ``dp`` only (`colo.zero.ExpertParallelZero`)."""


def is_moe(config: LlamaConfig) -> bool:
    """Whether ``config`` is a mixture-of-experts Llama (`colo.apps.models.moe_llama.MoELlamaConfig`)."""
    from ..models.moe_llama import MoELlamaConfig

    return isinstance(config, MoELlamaConfig)


def moe_layers(config: LlamaConfig, layers) -> int:
    """How many of ``layers`` (layer ids) have an MoE MLP."""
    return sum(1 for i in layers if is_moe(config) and config.is_moe_layer(i))


def expert_parallel(layout: Layout) -> bool:
    """Whether the layout's optimizer is `colo.zero.ExpertParallelZero` (dense and expert chunks apart): the
    ``expert`` plugin at any ``ep``, ``hybrid`` with ``ep > 1``."""
    return layout.plugin == "expert" or layout.ep > 1


def check_layout(config: LlamaConfig, layout: Layout) -> None:
    """Raise a `ValueError` naming the field and the fix when ``layout`` cannot run ``config``, by the rules the
    plugins apply with the model (`colo.apps.booster.moe_plan.MoELlamaPlan.check`): ``ep`` needs a mixture-of-experts
    model and must divide its experts; an MoE model takes Ulysses or ring sequence parallelism with ``ep > 1`` only,
    dropless (multi-head latent attention under sp is not modelled); tp must divide multi-head latent attention's
    heads, and with expert tensor parallelism the experts' width."""
    if layout.ep > 1 and not is_moe(config):
        raise ValueError(
            f"Layout.ep={layout.ep} splits the experts of a mixture-of-experts model and this model is a dense Llama; "
            "set ep=1"
        )
    if layout.plugin == "expert" and not is_moe(config):
        raise ValueError(
            "Layout.plugin='expert' splits the experts of a mixture-of-experts model and this model is a dense Llama; "
            "use plugin 'zero' or 'hybrid'"
        )
    if not is_moe(config):
        return
    experts = config.num_local_experts
    if experts % layout.ep:
        choices = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(f"Layout.ep={layout.ep} does not divide num_local_experts={experts}; choose ep in {choices}")
    if (layout.sp > 1 or layout.sp_mode is not None) and not (layout.sp_mode in ("ulysses", "ring") and layout.ep > 1):
        raise ValueError(
            f"Layout.sp={layout.sp} (sp_mode={layout.sp_mode!r}) with ep={layout.ep}: a mixture-of-experts model runs "
            "Ulysses or ring sequence parallelism under expert parallelism only (`MoELlamaPlan`); set "
            "sp_mode='ulysses' or 'ring' with ep > 1, or sp=1 and sp_mode=None"
        )
    if layout.sp > 1 and config.capacity_factor is not None:
        raise ValueError(
            f"Layout.sp={layout.sp} with capacity_factor={config.capacity_factor}: each sequence-parallel rank would "
            "drop assignments by its own piece's count, and HybridParallel refuses it; use capacity_factor=None "
            "(dropless) with sp"
        )
    if layout.sp > 1 and config.latent_attention:
        raise ValueError(
            f"Layout.sp={layout.sp}: colo plan does not model multi-head latent attention under sequence "
            "parallelism (its saved tensors and all-to-alls after the heads are padded); plan it with sp=1, or a "
            "model with Llama's attention (kv_lora_rank=None)"
        )
    if layout.sp_mode == "ulysses":  # `LlamaPlan.check`: each rank attends with num_heads / (tp * sp) heads
        from colo.tensor.ulysses import check_ulysses_heads

        heads, kv_heads = config.num_attention_heads // layout.tp, max(1, config.num_key_value_heads // layout.tp)
        check_ulysses_heads(layout.sp, heads, kv_heads, f"Layout.sp={layout.sp} (Ulysses, tp={layout.tp})")
    if layout.tp > 1 and config.latent_attention:
        from ..models.moe_llama.parallelize import check_latent_attention_tp

        check_latent_attention_tp(config.num_attention_heads, layout.tp)
        if layout.sp_mode is not None:
            raise ValueError("Layout.sp_mode: Megatron-SP is not implemented for multi-head latent attention")
    width = config.expert_intermediate_size
    if layout.expert_tensor_parallel and width % layout.tp:
        raise ValueError(
            f"Layout.tp={layout.tp} with expert_tensor_parallel=True does not divide the experts' width {width} "
            "(moe_intermediate_size); choose tp dividing it, or expert_tensor_parallel=False"
        )


def _check_tp(config: LlamaConfig, tp: int) -> None:
    from ..models.llama.parallelize import check_tp_size

    check_tp_size(config, tp)


def stage_layers(config: LlamaConfig, layout: Layout, pp_rank: int) -> list[tuple[list[int], bool, bool]]:
    """The model chunks of pipeline rank ``pp_rank``: ``(layer ids, holds the embedding, holds the head)`` each
    (colo.pipeline's uniform split into ``pp * num_model_chunks`` stages; rank r holds stages r, r + pp, ...)."""
    from colo.pipeline import partition_uniform

    num_stages = layout.pp * layout.num_model_chunks
    ranges = partition_uniform(config.num_hidden_layers, num_stages)
    stages = range(pp_rank, num_stages, layout.pp)
    return [(list(ranges[s]), s == 0, s == num_stages - 1) for s in stages]


def rank_parameters(config: LlamaConfig, layout: Layout, *, pp_rank: int = 0, no_decay_vectors: bool = False):
    """This rank's parameters in registration order, with their tensor-parallel shapes.

    Args:
        config: the model's shape.
        layout: the layout (``tp`` shards heads, the MLP width and the vocabulary; ``pp`` cuts the layers).
        pp_rank: the pipeline rank.
        no_decay_vectors: the trainer's optimizer groups (`colo.apps.train.optim.param_groups`): 1-D parameters
            in group 0 (no decay), matrices in group 1; ``False``: one group.

    Returns:
        ``list[ParamEntry]``.
    """
    tp = layout.tp
    if tp > 1:
        _check_tp(config, tp)
    check_layout(config, layout)
    h, hd = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    vector = 0
    matrix = 1 if no_decay_vectors else 0
    entries: list[ParamEntry] = []
    for layers, first, last in stage_layers(config, layout, pp_rank):
        if first:
            entries.append(ParamEntry("embed_tokens.weight", config.vocab_size // tp * h, matrix))
        for i in layers:
            p = f"layers.{i}."
            entries.append(ParamEntry(p + "input_layernorm.weight", h, vector))
            if is_moe(config) and config.latent_attention:
                entries += _latent_attention_parameters(config, p + "self_attn.", vector, matrix, tp)
            elif tp == 1:
                entries.append(ParamEntry(p + "self_attn.qkv_proj.weight", (heads + 2 * kv) * hd * h, matrix))
            else:
                kv_rows = kv * hd if kv % tp else kv // tp * hd  # fewer kv heads than ranks: replicated
                entries.append(ParamEntry(p + "self_attn.qkv_proj.q_weight", heads // tp * hd * h, matrix))
                entries.append(ParamEntry(p + "self_attn.qkv_proj.k_weight", kv_rows * h, matrix))
                entries.append(ParamEntry(p + "self_attn.qkv_proj.v_weight", kv_rows * h, matrix))
            if not (is_moe(config) and config.latent_attention):
                entries.append(ParamEntry(p + "self_attn.o_proj.weight", heads // tp * hd * h, matrix))
            entries.append(ParamEntry(p + "post_attention_layernorm.weight", h, vector))
            if moe_layers(config, [i]):
                entries += _moe_block_parameters(config, layout, p + "mlp.", matrix)
                continue
            inter = config.intermediate_size // tp
            for name in ("gate_proj", "up_proj", "down_proj"):
                entries.append(ParamEntry(p + f"mlp.{name}.weight", inter * h, matrix))
        if last:
            entries.append(ParamEntry("norm.weight", h, vector))
            if not (config.tie_word_embeddings and first):
                entries.append(ParamEntry("lm_head.weight", config.vocab_size // tp * h, matrix))
    return entries


def _latent_attention_parameters(config, prefix: str, vector: int, matrix: int, tp: int) -> list[ParamEntry]:
    """Multi-head latent attention's parameters in registration order (`MultiHeadLatentAttention`): the queries
    (``q_proj``, or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), the compressed keys and values
    (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``), ``o_proj``; tp splits the heads (``q_proj`` /
    ``q_b_proj``, ``kv_b_proj``, ``o_proj``) and replicates the latents (`colo.apps.models.moe_llama.parallelize`)."""
    h, heads = config.hidden_size, config.num_attention_heads // tp
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    entries = []
    if config.q_lora_rank is None:
        entries.append(ParamEntry(prefix + "q_proj.weight", heads * qk * h, matrix))
    else:
        rank = config.q_lora_rank
        entries.append(ParamEntry(prefix + "q_a_proj.weight", rank * h, matrix))
        entries.append(ParamEntry(prefix + "q_a_layernorm.weight", rank, vector))
        entries.append(ParamEntry(prefix + "q_b_proj.weight", heads * qk * rank, matrix))
    latent = config.kv_lora_rank
    entries.append(ParamEntry(prefix + "kv_a_proj_with_mqa.weight", (latent + config.qk_rope_head_dim) * h, matrix))
    entries.append(ParamEntry(prefix + "kv_a_layernorm.weight", latent, vector))
    expand = heads * (config.qk_nope_head_dim + config.v_head_dim) * latent
    entries.append(ParamEntry(prefix + "kv_b_proj.weight", expand, matrix))
    entries.append(ParamEntry(prefix + "o_proj.weight", heads * config.v_head_dim * h, matrix))
    return entries


def _moe_block_parameters(config, layout: Layout, prefix: str, matrix: int) -> list[ParamEntry]:
    """An `MoEBlock`'s parameters in registration order: the router (whole on every rank), the routed experts
    (``w1``, ``w3``, ``w2`` of ``num_local_experts / ep`` experts, each of ``moe_intermediate_size``, split over tp
    with expert tensor parallelism), the shared experts (one SwiGLU MLP, whole on every tp rank)."""
    h, experts = config.hidden_size, config.num_local_experts
    width = config.expert_intermediate_size // (layout.tp if layout.expert_tensor_parallel else 1)
    local = experts // layout.ep
    entries = [ParamEntry(prefix + "gate.weight", experts * h, matrix)]
    for name in ("w1", "w3", "w2"):
        entries.append(ParamEntry(prefix + f"experts.{name}", local * width * h, matrix, expert=True))
    shared = config.n_shared_experts * config.expert_intermediate_size
    if shared:
        for name in ("gate_proj", "up_proj", "down_proj"):
            entries.append(ParamEntry(prefix + f"shared_experts.{name}.weight", shared * h, matrix))
    return entries


@dataclass(frozen=True)
class StaticMemory:
    """Model-state bytes on one rank, named as `colo.zero.MemoryReport` names them (``workspace``: an upper bound of
    the pooled full-chunk buffers; ``host``: the part of the others on the host)."""

    params: int
    grads: int
    masters: int
    optimizer_states: int
    padding: int
    host: int = 0
    workspace: int = 0
    step_gradients: int = 0
    """Under a pipeline at stages 0/2/3: the full gradients (compute dtype) the parameters' ``.grad`` hold from the
    first backward until the step's one reduction (``grad_reduction="step"``); 0 otherwise."""
    num_chunks: int = 0
    chunk_bytes: list[int] = field(default_factory=list, repr=False)
    """Full-chunk sizes in compute-dtype bytes (the units of the data-parallel collectives)."""
    chunk_numels: list[int] = field(default_factory=list, repr=False)
    expert_chunks: int = 0
    """The last ``expert_chunks`` of the chunks hold expert weights (``expert`` plugin: synced over ``dp`` only)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.masters + self.optimizer_states

    @property
    def device(self) -> int:
        """Model-state bytes on the device (everything but the host part), pooled buffers and a pipeline's step
        gradients included."""
        return self.total - self.host + self.workspace + self.step_gradients


@dataclass(frozen=True)
class ChunkShape:
    """One chunk of a packing: its capacity and the elements its parameters use."""

    capacity: int
    used: int


@functools.lru_cache(maxsize=512)
def _cached_plans(entries: tuple[ParamEntry, ...], num_shards: int, chunk_numel: int | None, gemini: bool):
    return plan_rank_chunks(list(entries), num_shards=num_shards, chunk_numel=chunk_numel, gemini=gemini)


def plan_rank_chunks(
    entries: list[ParamEntry], *, num_shards: int, chunk_numel: int | None, gemini: bool = False
) -> list[ChunkShape]:
    """The chunks `colo.zero.plan_chunks` packs these parameters into, with the largest capacity the optimizer's
    config searches to (`ZeroConfig`'s or `GeminiConfig`'s default).

    The same greedy packing and padding search as `plan_chunks` (test_plan_search checks they agree), on plain
    integers: a 70B model's packing search (256 candidate capacities) runs for every structure the planner
    considers, and there `plan_chunks`' per-parameter tensors dominate the search's time."""
    from colo.gemini.config import GeminiConfig
    from colo.zero.chunk import round_up
    from colo.zero.config import ZeroConfig

    if not entries:
        raise ValueError("the rank holds no parameters to pack into chunks")
    largest_capacity = (GeminiConfig if gemini else ZeroConfig)().max_chunk_numel
    items = [(e.group, e.numel) for e in entries]
    if chunk_numel is not None:
        return [ChunkShape(capacity, used) for capacity, used in _pack_shapes(items, num_shards, chunk_numel)]
    num_candidates, tolerance = 256, 0.01  # plan_chunks' defaults
    largest = round_up(max(n for _, n in items), num_shards)
    totals: dict[int, int] = {}
    for group, numel in items:
        totals[group] = totals.get(group, 0) + numel
    ceiling = max(round_up(largest_capacity, num_shards), 2 * largest)
    high = max(largest, min(round_up(max(totals.values()), num_shards), ceiling))
    step = max(num_shards, round_up((high - largest) // max(num_candidates, 1), num_shards))
    candidates = [_pack_shapes(items, num_shards, c) for c in list(range(largest, high, step)) + [high]]
    paddings = [sum(capacity - used for capacity, used in shapes) for shapes in candidates]
    allowed = min(paddings) + tolerance * sum(totals.values())
    chosen = next(shapes for shapes, padding in zip(candidates, paddings) if padding <= allowed)
    return [ChunkShape(capacity, used) for capacity, used in chosen]


def _pack_shapes(items: list[tuple[int, int]], num_shards: int, capacity: int) -> list[list[int]]:
    """`colo.zero.chunk._pack` on ``(group, numel)`` pairs (one dtype, all trainable): ``[capacity, used]`` per
    chunk."""
    capacity = -(-capacity // num_shards) * num_shards
    chunks: list[list[int]] = []  # [capacity, used] in packing order
    open_chunk: dict[int, list[int]] = {}
    for group, numel in items:
        if numel > capacity:  # an oversized parameter gets a chunk of its own
            chunks.append([-(-numel // num_shards) * num_shards, numel])
            continue
        chunk = open_chunk.get(group)
        if chunk is None or chunk[1] + numel > capacity:
            chunk = [capacity, 0]
            open_chunk[group] = chunk
            chunks.append(chunk)
        chunk[1] += numel
    return chunks


_STATIC_CACHE: dict[tuple, StaticMemory] = {}


def static_memory(
    config: LlamaConfig,
    layout: Layout,
    *,
    pp_rank: int = 0,
    data_rank: int = 0,
    no_decay_vectors: bool = False,
    max_reductions_in_flight: int = 2,
) -> StaticMemory:
    """Parameters, gradients, masters, optimizer state (AdamW), padding and pooled buffers of one rank after a step
    (see `_static_memory`); cached on what it depends on (not checkpointing or microbatches), since the chunk
    packing search is the planner's most expensive step."""
    key = (
        config,
        *(getattr(layout, f) for f in ("plugin", "dp", "ep", "tp", "pp", "sp", "stage", "precision", "chunk_numel")),
        layout.expert_tensor_parallel,
        layout.offload_optimizer,
        layout.num_model_chunks,
        pp_rank,
        data_rank,
        no_decay_vectors,
        max_reductions_in_flight,
    )
    if key not in _STATIC_CACHE:
        if len(_STATIC_CACHE) > 4096:
            _STATIC_CACHE.clear()
        _STATIC_CACHE[key] = _static_memory(
            config,
            layout,
            pp_rank=pp_rank,
            data_rank=data_rank,
            no_decay_vectors=no_decay_vectors,
            max_reductions_in_flight=max_reductions_in_flight,
        )
    return _STATIC_CACHE[key]


def _static_memory(
    config: LlamaConfig,
    layout: Layout,
    *,
    pp_rank: int,
    data_rank: int,
    no_decay_vectors: bool,
    max_reductions_in_flight: int,
) -> StaticMemory:
    """Parameters, gradients, masters, optimizer state (AdamW), padding and pooled buffers of one rank after a step.

    ``data_rank`` is the rank's index among the ZeRO shards (padding sits at the end of each chunk, so the last
    shards hold it). DDP (torch DDP, no chunks): parameters, gradients (DDP's buckets are views of them) and AdamW's
    moments and ``step``, all in the parameters' dtype (fp32; the run's autocast does not change them).
    """
    entries = rank_parameters(config, layout, pp_rank=pp_rank, no_decay_vectors=no_decay_vectors)
    if layout.plugin == "ddp":
        numel = sum(e.numel for e in entries)
        return StaticMemory(numel * 4, numel * 4, 0, 2 * numel * 4 + 4 * len(entries), 0)
    stage = layout.stage
    sharded = stage != 0
    gemini = layout.plugin == "gemini"
    # the parts colo packs apart (`colo.zero.ExpertParallelZero`: the expert plugin, HybridParallel with ep > 1):
    # dense parameters sharded over dp x ep (x sp under Ulysses) and experts over dp (x sp), this rank's place in each
    # (`expert_data_rank`); a pipeline stage without MoE layers has no expert part; otherwise one part over all the
    # data ranks
    if expert_parallel(layout):
        dense = [e for e in entries if not e.expert]
        experts = [e for e in entries if e.expert]
        parts = [(dense, layout.data_ranks, data_rank)]
        parts += [(experts, layout.dp * layout.sp, expert_data_rank(layout, data_rank))] if experts else []
    else:
        parts = [(entries, layout.data_ranks, data_rank)]
    totals = {"params": 0, "grads": 0, "masters": 0, "optimizer_states": 0}
    padding = host = pooled = step_gradients = 0
    pipelined = layout.plugin == "hybrid" and layout.pp > 1  # ZeRO reduces once per step, stage 3 holds its gathers
    chunk_numels: list[int] = []
    expert_chunks = 0
    for index, (part, ranks, part_rank) in enumerate(parts):
        shards = ranks if sharded else 1
        rank = part_rank if sharded else 0
        plans = _cached_plans(tuple(part), shards, layout.chunk_numel, gemini)  # ZeRO stages 1-3 pack alike
        part_totals, part_padding, part_host = _chunk_buffers(layout, plans, shards, rank)
        for kind, nbytes in part_totals.items():
            totals[kind] += nbytes
        padding += part_padding
        host += part_host
        numels = [plan.capacity for plan in plans]
        chunk_numels += numels
        expert_chunks += len(numels) if index == 1 else 0
        ec = layout.compute_bytes
        er = ec if layout.precision != "fp32" else 4
        pooled += _pooled_buffers(
            stage, [n * ec for n in numels], er / ec, max_reductions_in_flight, gemini, pipelined=pipelined
        )
        if pipelined and stage != 1:
            step_gradients += sum(plan.used for plan in plans) * ec
    return StaticMemory(
        step_gradients=step_gradients,
        padding=padding,
        host=host,
        workspace=pooled,
        num_chunks=len(chunk_numels),
        chunk_bytes=[n * layout.compute_bytes for n in chunk_numels],
        chunk_numels=chunk_numels,
        expert_chunks=expert_chunks,
        **totals,
    )


def expert_data_rank(layout: Layout, data_rank: int) -> int:
    """The rank among the experts' data ranks (``dp x sp``) of the rank ``data_rank`` among all data ranks
    (``dp x ep x sp`` in mesh order: sp fastest, then ep)."""
    sp, ep = layout.sp, layout.ep
    return data_rank // (ep * sp) * sp + data_rank % sp


def _chunk_buffers(layout: Layout, plans: list[ChunkShape], shards: int, rank: int) -> tuple[dict, int, int]:
    """Bytes by kind, padding bytes and host bytes of the buffers the chunk optimizer keeps for ``plans`` on the
    rank holding shard ``rank`` of ``shards``."""
    stage = layout.stage
    gemini = layout.plugin == "gemini"
    ec = layout.compute_bytes
    mixed = layout.precision != "fp32"
    er = ec if mixed else 4  # gradients are reduced in the compute dtype (fp32 without mixed precision)
    offload = layout.offload_optimizer and not gemini
    totals = {"params": 0, "grads": 0, "masters": 0, "optimizer_states": 0}
    padding = host = 0

    def block(numel: int, size: int) -> int:  # colo.gemini's DeviceArena.block_bytes
        from colo.gemini.tiers import ALIGNMENT

        return -(-max(numel, 1) * size // ALIGNMENT) * ALIGNMENT

    for plan in plans:
        numel, used = plan.capacity, plan.used
        shard = numel // shards
        start = rank * shard
        shard_pad = max(0, start + shard - max(start, used))
        full_pad = numel - used
        if gemini:  # every chunk homed on the device, in arena blocks (Gemini's own accounting)
            fp32 = block(shard, 4)
            buffers = [("params", block(shard, ec), 1, 0, False), ("masters", fp32, 1, 0, False)]
            buffers += [("grads", fp32, 1, 0, False), ("optimizer_states", 2 * fp32, 1, 0, False)]
        else:
            buffers = _zero_buffers(
                stage, numel, shard, full_pad, shard_pad, ec=ec, er=er, mixed=mixed, offload=offload
            )
        for kind, elements, size, pad, on_host in buffers:
            totals[kind] += elements * size
            padding += pad * size
            host += elements * size if on_host else 0
        totals["optimizer_states"] += 4  # AdamW's fp32 `step`
        host += 4 if offload else 0
    return totals, padding, host


def _zero_buffers(stage, numel, shard, full_pad, shard_pad, *, ec, er, mixed, offload) -> list[tuple]:
    """The buffers `ZeroOptimizer._build_buffers` gives a chunk, and AdamW's moments after a step:
    ``(kind, elements, bytes per element, padding elements, on the host)``."""
    buffers = []
    if stage == 3:  # the compute copy: this rank's shard (stage 3) or the full chunk
        buffers.append(("params", shard, ec, shard_pad, False))
    else:
        buffers.append(("params", numel, ec, full_pad, False))
    if mixed or offload:  # fp32 without offload: the master is the compute shard itself
        buffers.append(("masters", shard, 4, shard_pad, offload))
    if stage == 1:  # the persistent full gradient; the shard is its own region unless the dtypes differ
        buffers.append(("grads", numel, ec, full_pad, False))
        if not (ec == er and not offload):
            buffers.append(("grads", shard, er, shard_pad, offload))
    else:
        buffers.append(("grads", shard, er, shard_pad, offload))
    if shard > 1:  # registered only for more than one element
        buffers += [("optimizer_states", shard, 4, shard_pad, offload)] * 2  # exp_avg, exp_avg_sq
    return buffers


def _pooled_buffers(
    stage: int, chunk_bytes: list[int], reduce_ratio: float, in_flight: int, gemini: bool, *, pipelined: bool = False
) -> int:
    """An upper bound of `BufferPool`'s bytes: stages 0/2/3 keep up to ``in_flight + 1`` gradient buckets, stage 3
    also the gathered chunks in use at once (the chunk in use, the prefetched one and the root kept for backward;
    under a pipeline every chunk of the stage, held from its first gather to the step's reduction)."""
    if stage == 1 or gemini or not chunk_bytes:
        return 0
    largest = sorted(chunk_bytes, reverse=True)
    buckets = int(sum(largest[: in_flight + 1]) * max(reduce_ratio, 1.0) * 2)  # up to fp32 buckets
    gathers = (sum(largest) if pipelined else sum(largest[:3])) if stage == 3 else 0
    return buckets + gathers


# --- activations ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes saved for backward on one rank for one microbatch, and how many microbatches are alive at once."""

    per_layer: int
    """One decoder layer's saved bytes on the device."""
    head: int
    """Embedding ids, final norm and the output projection + loss."""
    num_layers: int
    """Decoder layers on this rank."""
    in_flight: int
    """Microbatches whose activations are alive at the peak (pipeline warm-up; 1 without a pipeline)."""
    host_per_layer: int = 0
    """Offloaded checkpointing: bytes per layer kept in host memory."""
    moe_layers: int = 0
    """How many of the layers have a mixture-of-experts MLP."""
    moe_extra: int = 0
    """Bytes an MoE layer saves beyond a dense one (`moe_saved_bytes` minus the dense MLP's; may be negative)."""

    @property
    def per_microbatch(self) -> int:
        return self.per_layer * self.num_layers + self.moe_extra * self.moe_layers + self.head

    @property
    def peak(self) -> int:
        return self.per_microbatch * self.in_flight


def _local_heads(config: LlamaConfig, tp: int) -> tuple[int, int]:
    """(query heads, kv heads) a tensor-parallel rank computes (kv replicated when tp does not divide them)."""
    kv = config.num_key_value_heads
    if tp == 1:
        return config.num_attention_heads, kv
    return config.num_attention_heads // tp, 1 if kv % tp else kv // tp


def layer_saved_bytes(config: LlamaConfig, layout: Layout, tokens: int, batch: int, seq: int) -> int:
    """Bytes one decoder layer saves for backward without checkpointing, on one rank.

    ``tokens = batch * seq`` are the microbatch's tokens on the rank before sequence sharding. The saved tensors
    (colo's Llama layer, read off ``saved_tensors_hooks``): the layer input and fp32 ``rstd`` of both norms, both
    norms' outputs (the q/k/v and gate/up matmul inputs), what attention saves (q and k after RoPE, v, which is a
    view of the fused q/k/v output and keeps all of it, the output and the fp32 log-sum-exp), the residual sum, the
    SwiGLU inputs and output. Tensor parallelism shards the heads and the MLP width and, through `FusedQKV`,
    saves the concatenated q/k/v weight shard of the matmul; Megatron-SP keeps the norms, residuals and matmul
    inputs as sequence shards (the inputs are gathered again in backward); Ulysses saves q, k, v and the output
    after the all-to-all (whole sequence, heads / sp) and the projections' tensors on the sequence shard; ring
    attention runs everything on the sequence shard.
    """
    ea = layout.compute_bytes
    h, hd = config.hidden_size, config.head_dim
    tp, sp = layout.tp, layout.sp
    heads, kv = _local_heads(config, tp)
    inter = config.intermediate_size // tp
    local = tokens // sp  # Ulysses / ring: the projections run on the sequence shard
    shard = tokens // tp if layout.sp_mode == "megatron" else local  # norms, residuals (and Megatron-SP's inputs)
    width = (heads + 2 * kv) * hd
    elements = 4 * shard * h  # layer input, residual sum, both norms' outputs
    elements += 3 * local * inter  # gate, up, SwiGLU output
    if tp > 1:
        elements += width * h  # FusedQKV's concatenated weight shard
    if is_moe(config) and config.latent_attention:  # sp = 1 (refused otherwise)
        elements += _latent_attention_saved_elements(config, tokens, tp) - (width * h if tp > 1 else 0)
        return elements * ea + (2 * shard + _latent_attention_fp32(config, tokens, batch, seq, tp)) * 4
    if layout.sp_mode == "ulysses":
        heads_sp, kv_sp = heads // sp, max(1, kv // sp)
        elements += tokens * (2 * heads_sp + 2 * kv_sp) * hd  # q, k, v, out after the all-to-all
        elements += local * heads * hd  # o_proj's input after the reverse all-to-all
        lse = batch * heads_sp * seq
    else:
        elements += local * width  # the fused q/k/v output (v is a view of it)
        elements += local * (heads + kv) * hd + local * heads * hd  # q, k after RoPE, the attention output
        lse = batch * heads * (seq // sp)
    return elements * ea + (2 * shard + lse) * 4


def _latent_attention_saved_elements(config, tokens: int, tp: int = 1) -> int:
    """Compute-dtype elements multi-head latent attention saves for backward beyond the layer's norm output
    (`MultiHeadLatentAttention`): the query path's ``q_a_proj`` output and normed latent (with ``q_lora_rank``), the
    ``kv_a_proj_with_mqa`` output and the normed key/value latent, the padded queries, keys and values and the
    attention output (colo's kernel, heads zero-padded to its width; wider heads: torch SDPA, modelled as a
    flash-style kernel keeping them unpadded), and ``o_proj``'s input (the output cut back to ``v_head_dim``). Under
    tp the latents are whole and the heads this rank's."""
    heads, rope, v_dim = config.num_attention_heads // tp, config.qk_rope_head_dim, config.v_head_dim
    qk = config.qk_nope_head_dim + rope
    width = max(qk, v_dim)
    padded = next((size for size in (16, 32, 64, 128) if size >= width), None)
    elements = 2 * tokens * (config.q_lora_rank or 0)
    elements += tokens * (config.kv_lora_rank + rope) + tokens * config.kv_lora_rank
    if padded is None:
        elements += tokens * heads * (2 * qk + 2 * v_dim)
    else:
        elements += 4 * tokens * heads * padded
    return elements + tokens * heads * v_dim


def _latent_attention_fp32(config, tokens: int, batch: int, seq: int, tp: int = 1) -> int:
    """fp32 elements multi-head latent attention saves: its latents' RMSNorm ``rstd`` and the log-sum-exp."""
    norms = 2 if config.q_lora_rank is not None else 1
    return norms * tokens + batch * config.num_attention_heads // tp * seq


def head_saved_bytes(config: LlamaConfig, layout: Layout, tokens: int, *, first: bool, last: bool) -> int:
    """Bytes saved outside the decoder layers: the token ids (embedding); the final norm's input, ``rstd`` and
    output; the loss: the fused output projection + cross-entropy computes ``lm_head``'s weight gradient in the
    forward and keeps it, the vocabulary-parallel loss (tp > 1) keeps the fp32 local logits, the targets and two
    masks; a pipeline's last stage computes the logits and `colo.kernels.cross_entropy` keeps them (compute dtype),
    the int64 targets and the fp32 log-sum-exp per token (checked at tp = 1); sequence parallelism's per-position
    rotary tables (one copy shared by the layers)."""
    ea = layout.compute_bytes
    h = config.hidden_size
    local = tokens // layout.sp
    total = local * 8 if first else 0
    if layout.sp > 1:
        total += 2 * (local // layout.micro_batch_size) * config.head_dim * 4
    if last:
        shard = tokens // layout.tp if layout.sp_mode == "megatron" else local
        total += 2 * shard * h * ea + shard * 4  # final norm's input and output, rstd
        if layout.pp > 1:
            total += local * (config.vocab_size // layout.tp) * ea + local * (8 + 4)
        elif layout.tp > 1:
            total += local * (config.vocab_size // layout.tp) * 4 + local * (8 + 2) + 8
        else:
            total += config.vocab_size * h * ea
    return total


def activation_memory(
    config: LlamaConfig,
    layout: Layout,
    seq_len: int,
    *,
    pp_rank: int = 0,
    routing: list[tuple[float, float, float]] | None = None,
) -> ActivationMemory:
    """Activation bytes of one microbatch on one rank, and the pipeline's microbatches in flight.

    ``routing``: mixture of experts, per MoE layer of the microbatch, ``(assignments kept, rows sent to other ep
    ranks, rows received from them)`` as a run routed them (`moe_saved_bytes`); ``None``: even routing.
    """
    batch = layout.micro_batch_size
    tokens = batch * seq_len
    chunks = stage_layers(config, layout, pp_rank)
    num_layers = sum(len(layers) for layers, _, _ in chunks)
    first = any(f for _, f, _ in chunks)
    last = any(la for _, _, la in chunks)
    full = layer_saved_bytes(config, layout, tokens, batch, seq_len)
    mode = layout.activation_checkpointing
    host = 0
    t_in = tokens // layout.tp if layout.sp_mode == "megatron" else tokens // layout.sp
    if mode == "full":
        per_layer = t_in * config.hidden_size * layout.compute_bytes  # the block's input
    elif mode == "selective":
        per_layer = _selective_bytes(config, layout, tokens, batch, seq_len)
    elif mode == "offload":
        per_layer, host = 0, full
    else:
        per_layer = full
    head = head_saved_bytes(config, layout, tokens, first=first, last=last)
    num_moe = moe_layers(config, [i for layers, _, _ in chunks for i in layers])
    extra = 0.0
    routed = tokens // layout.sp  # Ulysses: each rank routes its piece of every sequence
    if num_moe and mode in (None, "selective"):
        if routing is None or mode == "selective":
            extra = moe_saved_bytes(config, layout, routed, batch, selective=mode == "selective")
        else:  # the mean over the layers of each one's own bytes
            extra = sum(moe_saved_bytes(config, layout, routed, batch, routing=r) for r in routing) / len(routing)
    elif num_moe and mode == "offload":
        host += moe_saved_bytes(config, layout, routed, batch)
    return ActivationMemory(per_layer, head, num_layers, _in_flight(layout, pp_rank), host, num_moe, round(extra))


def moe_saved_bytes(
    config: LlamaConfig,
    layout: Layout,
    tokens: int,
    batch: int,
    *,
    selective: bool = False,
    routing: tuple[float, float, float] | None = None,
) -> float:
    """Bytes an MoE layer saves for backward beyond a dense layer (`colo.tensor.moe.MoEBlock`'s saved tensors, read
    off ``saved_tensors_hooks``), for the ``tokens`` this rank routes (under Ulysses sequence parallelism its piece
    of the ``batch`` sequences).

    Saved: the router's fp32 input and, below fp32, its fp32 weight copy (a bf16 model saves no other copy of the
    norm's output: the dense MLP's matmuls saved it); the fp32 scores, the top-k indices (int64), weights and their
    sum; the permutation's token and assignment indices (int64, one per kept assignment ``N``) and the weights'
    fp32 column; the experts' int32 offsets; for the ``R`` rows this rank's experts take: the rows, ``w1`` / ``w3``
    outputs, SwiGLU's ``silu`` and product (``R (H + 4 I)``); the expert outputs and the weighted rows
    ``index_add`` combines (``2 N H``); the loss terms: the z-loss's fp32 logits and log-sum-exp, the balance loss's
    fraction per expert (per sequence for ``aux_loss_type="sequence"``). Expert parallelism adds the regroup order
    of the received rows and its inverse (int64, ``R`` each). ``N`` is every assignment when dropless (at most the
    capacity per expert otherwise, spread evenly) and ``R = N`` when ``routing`` is ``None``; a run's
    ``routing = (N, rows sent to other ranks, rows received from them)`` gives ``R = N - sent + received``.

    ``selective``: the router's matmul output (fp32 logits) is kept and the experts' grouped matmuls are recomputed
    (`colo.apps.checkpointing.selective_policy` keeps ``mm`` / ``addmm`` outputs only) in place of the dense MLP's
    three matmul outputs.

    DeepSeek-style blocks: the routed experts have ``moe_intermediate_size`` (split over tp with expert tensor
    parallelism); the shared experts (one SwiGLU MLP on every token) save their gate and up outputs, the silu and the
    product, and their input (the norm output, which below fp32 is not the router's fp32 input).
    """
    ea = layout.compute_bytes
    h, dense = config.hidden_size, config.intermediate_size // layout.tp
    inter = config.expert_intermediate_size // (layout.tp if layout.expert_tensor_parallel else 1)
    shared = config.n_shared_experts * config.expert_intermediate_size
    experts, top_k = config.num_local_experts, config.num_experts_per_tok
    if selective:  # the router's logits and the shared experts' three matmul outputs in place of the dense MLP's
        return tokens * experts * 4 + tokens * (2 * shared + h) * ea * bool(shared) - tokens * (2 * dense + h) * ea
    n = expected_routing_kept(config, tokens) if routing is None else routing[0]
    rows = n if routing is None else n - routing[1] + routing[2]
    total = tokens * h * 4 - tokens * h * ea  # the router's fp32 input in place of the norm output
    if ea != 4:
        total += experts * h * 4
    total += tokens * experts * 4 + tokens * top_k * (8 + 4) + tokens * 4  # scores, indices, weights, their sum
    total += 2 * n * 8 + n * 4 + (experts // layout.ep) * 4  # token / assignment indices, weights' column, offsets
    total += rows * (h + 4 * inter) * ea + 2 * n * h * ea
    groups = batch if config.aux_loss_type == "sequence" else 1
    total += tokens * experts * 4 + tokens * 4 + groups * experts * 4  # z-loss logits and lse, balance fraction
    if layout.ep > 1:
        total += 2 * rows * 8
    if shared:  # the shared experts: gate and up outputs, silu, product; their input is the norm output below fp32
        total += 4 * tokens * shared * ea + (tokens * h * ea if ea != 4 else 0)
    return total - 3 * tokens * dense * ea  # the dense MLP's gate, up and SwiGLU output


def expected_routing_kept(config: LlamaConfig, tokens: int) -> float:
    """Assignments one rank keeps for ``tokens`` tokens with even routing (all of them when dropless; at most the
    capacity per expert otherwise)."""
    from colo.tensor.moe import expert_capacity

    experts, top_k = config.num_local_experts, config.num_experts_per_tok
    per_expert = tokens * top_k / experts
    if config.capacity_factor is not None:
        capacity = expert_capacity(tokens, top_k=top_k, num_experts=experts, capacity_factor=config.capacity_factor)
        per_expert = min(per_expert, capacity)
    return per_expert * experts


def _selective_bytes(config: LlamaConfig, layout: Layout, tokens: int, batch: int, seq: int) -> int:
    """Selective checkpointing keeps the matmul outputs and the attention's (out, lse), plus the block's input."""
    ea = layout.compute_bytes
    h, hd, tp = config.hidden_size, config.head_dim, layout.tp
    heads, kv = _local_heads(config, tp)
    t = tokens // layout.sp
    inter = config.intermediate_size // tp
    matmuls = t * ((heads + 2 * kv) * hd + h + 2 * inter + h)  # qkv, o_proj, gate, up, down outputs
    attention = t * heads * hd * ea + batch * heads * (seq // layout.sp) * 4
    return (t * h + matmuls) * ea + attention


def _in_flight(layout: Layout, pp_rank: int) -> int:
    """Microbatches alive at once on ``pp_rank``, from colo.pipeline's simulator (1 without a pipeline)."""
    if layout.pp == 1:
        return 1
    from .schedule import peak_live_activations

    live = peak_live_activations(layout, pp_rank)
    return -(-live // layout.num_model_chunks)  # (microbatch, chunk) pairs; a chunk holds 1/v of the layers


def kv_cache_bytes(config: LlamaConfig, layout: Layout, *, batch: int, max_len: int, dtype_bytes: int = 2) -> int:
    """KV cache of generation on one rank: keys and values of every layer on the rank, ``batch x max_len``."""
    _, kv_local = _local_heads(config, layout.tp)
    layers = config.num_hidden_layers // layout.pp
    return 2 * layers * batch * max_len * kv_local * config.head_dim * dtype_bytes


@dataclass(frozen=True)
class MemoryBreakdown:
    """Device bytes of one rank at the step's peak, by term."""

    static: StaticMemory
    activations: ActivationMemory

    @property
    def device_total(self) -> int:
        """Model states on the device, pooled buffers (buckets, ZeRO-3's gathered chunks) and peak activations."""
        return self.static.device + self.activations.peak

    def terms(self) -> dict[str, int]:
        s = self.static
        return {
            "params": s.params,
            "grads": s.grads,
            "masters": s.masters,
            "optimizer": s.optimizer_states,
            "host": s.host,
            "pooled buffers": s.workspace,
            "step gradients": s.step_gradients,
            "activations": self.activations.peak,
        }


def memory_breakdown(config: LlamaConfig, layout: Layout, seq_len: int, *, no_decay_vectors: bool = True):
    """The peak device memory of the most loaded rank (the first pipeline stage holds the most microbatches)."""
    worst = None
    for pp_rank in sorted({0, layout.pp - 1}):
        static = static_memory(
            config, layout, pp_rank=pp_rank, data_rank=layout.data_ranks - 1, no_decay_vectors=no_decay_vectors
        )
        activations = activation_memory(config, layout, seq_len, pp_rank=pp_rank)
        candidate = MemoryBreakdown(static, activations)
        if worst is None or candidate.device_total > worst.device_total:
            worst = candidate
    return worst
