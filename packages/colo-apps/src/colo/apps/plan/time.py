"""Step time of a layout on a cluster: compute from FLOPs and per-op-class efficiencies, communication from
`colo.apps.plan.comm`'s exact volumes over a link model, overlap as colo schedules it, and the pipeline from
colo.pipeline's simulator.

- Compute per microbatch and model chunk: the matmuls (``2 N T`` forward, ``4 N T`` backward for this rank's ``N``
  matmul weights and ``T`` tokens) at ``efficiency.matmul`` of the peak, causal flash attention (``2 S^2 H D`` per
  sequence and layer forward, 2.5x that backward) at ``efficiency.attention``, and the element-wise ops as memory
  traffic (four passes over the saved activations) at ``efficiency.memory`` of the memory bandwidth. Checkpointing
  adds the recomputed forward (``full``) or its element-wise part (``selective``).
- Tensor- and sequence-parallel collectives are on the critical path (colo runs them synchronously inside the
  layers): their bytes over the link of the group's span plus a latency per call.
- Data-parallel collectives overlap as colo issues them: gradient reductions run during backward (stage 1 only in
  the last microbatch's backward, stages 0/2/3 and Gemini in every one), stages 1/2's parameter all-gather during the
  next forward, stage 3's gathers are prefetched during compute; only what exceeds its window is exposed.
- With a pipeline, `colo.pipeline.simulate` runs the schedule on these per-chunk F / B times and the p2p time of one
  activation; its makespan includes the bubble.
- The optimizer step streams the masters, gradient shards and moments through memory (through the host with
  ZeRO-Offload).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.llama import LlamaConfig
from .cluster import Cluster
from .comm import MESH_ORDER, step_communication
from .layout import Layout
from .memory import (
    _latent_attention_parameters,
    expected_routing_kept,
    is_moe,
    layer_saved_bytes,
    moe_layers,
    moe_saved_bytes,
    stage_layers,
    static_memory,
)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the slowest rank, by term."""

    compute: float
    """Forward + backward compute of every microbatch (recomputation included), without the bubble."""
    model_parallel_comm: float
    """Tensor / sequence-parallel collectives (on the critical path)."""
    pipeline_bubble: float
    """Pipeline idle time (makespan minus this rank's busy time)."""
    data_parallel_exposed: float
    """Data-parallel communication not hidden behind compute."""
    optimizer: float
    """The optimizer step."""
    tokens_per_step: int
    world_size: int
    flops_per_token: float

    @property
    def total(self) -> float:
        return (
            self.compute + self.model_parallel_comm + self.pipeline_bubble + self.data_parallel_exposed + self.optimizer
        )

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_step / self.total / self.world_size

    def mfu(self, peak: float) -> float:
        """Model FLOPs utilization against ``peak`` FLOP/s per device."""
        return self.flops_per_token * self.tokens_per_second_per_device / peak


def _span(layout: Layout, *axes: str) -> int:
    """Consecutive ranks a group over ``axes`` spans in the mesh ``(pp, dp, sp, tp)`` (tp innermost)."""
    sizes = {axis: getattr(layout, axis) for axis in MESH_ORDER}
    outermost = min(MESH_ORDER.index(a) for a in axes)
    span = 1
    for axis in MESH_ORDER[outermost:]:
        span *= sizes[axis]
    return span


def _comm_seconds(volumes: dict, layout: Layout, cluster: Cluster, axes_filter) -> float:
    total = 0.0
    for (op, axis), nbytes in volumes.items():
        axes = tuple(axis.split("+"))
        if not axes_filter(axes):
            continue
        size = 1
        for name in axes:
            size *= getattr(layout, name)
        bandwidth, _ = cluster.link(_span(layout, *axes), 2 if op in ("send", "recv") else size)
        total += nbytes / bandwidth
    return total


def _chunk_compute(
    config: LlamaConfig, layout: Layout, cluster: Cluster, seq_len: int, layer_ids: list[int], last: bool
):
    """(forward, backward) seconds of one microbatch on a model chunk of the layers ``layer_ids``.

    An MoE layer's MLP costs its router (``E H`` weights per token) and ``k`` experts' SwiGLU per kept assignment
    (the even routing of `colo.apps.plan.comm.expected_routing`: under expert parallelism a rank's experts take as
    many rows as it routes)."""
    eff = cluster.efficiency
    peak = cluster.flops(layout.precision)
    h, hd = config.hidden_size, config.head_dim
    tp, sp = layout.tp, layout.sp
    layers = len(layer_ids)
    tokens = layout.micro_batch_size * seq_len // sp
    latent = is_moe(config) and config.latent_attention
    if latent:  # multi-head latent attention: its projections (the heads' split over tp, the latents' whole), not
        # its latents' RMSNorm weights (elementwise, as the MFU's FLOP count leaves them out)
        entries = _latent_attention_parameters(config, "", 0, 0, tp)
        layer_params = sum(entry.numel for entry in entries if "layernorm" not in entry.name)
    else:
        layer_params = (config.num_attention_heads + config.num_key_value_heads) * hd * h * 2 // tp
    layer_params += 3 * h * config.intermediate_size // tp
    matmul = layers * layer_params + (config.vocab_size * h // tp if last else 0)
    moe = moe_layers(config, layer_ids)
    if moe:  # per token: the router, the kept assignments' experts and the shared experts in place of the dense MLP
        kept = expected_routing_kept(config, tokens) / tokens
        width = config.expert_intermediate_size // (tp if layout.expert_tensor_parallel else 1)
        shared = config.n_shared_experts * config.expert_intermediate_size  # whole on every tp rank
        moe_params = config.num_local_experts * h + kept * 3 * h * width + 3 * h * shared
        matmul += moe * (moe_params - 3 * h * config.intermediate_size // tp)
    heads = config.num_attention_heads // tp
    qk_dim, v_dim = config.attention_head_dims if latent else (hd, hd)
    # causal half, forward: scores over the query/key dims, the weighted sum over the value dims
    attention = layers * layout.micro_batch_size * seq_len * seq_len * heads * (qk_dim + v_dim) / sp
    saved = layers * layer_saved_bytes(
        config, layout, layout.micro_batch_size * seq_len, layout.micro_batch_size, seq_len
    )
    if moe:
        saved += moe * moe_saved_bytes(config, layout, tokens, layout.micro_batch_size)
    elementwise = 2 * saved / (cluster.memory_bandwidth * eff.memory)
    f_matmul = 2 * matmul * tokens / (peak * eff.matmul)
    f_attention = attention / (peak * eff.attention)
    forward = f_matmul + f_attention + elementwise
    backward = 2 * f_matmul + 2.5 * f_attention + elementwise
    mode = layout.activation_checkpointing
    if mode == "full":
        backward += forward
    elif mode == "selective":
        backward += elementwise / 2
    elif mode == "offload":
        transfer = saved / cluster.host_bandwidth
        forward += max(0.0, transfer - forward)
        backward += max(0.0, transfer - backward)
    return forward, backward


def step_time(config: LlamaConfig, layout: Layout, cluster: Cluster, seq_len: int) -> StepTime:
    """The modelled time of one step (``dp * micro_batch_size * num_microbatches`` sequences of ``seq_len``)."""
    microbatches = layout.num_microbatches
    volumes = step_communication(config, layout, seq_len, pp_rank=0, no_decay_vectors=True)  # the trainer's groups
    model_axes = {"tp", "sp", "pp"}
    # the tp / sp / ep collectives of the rank's microbatches: critical path
    mp_comm = _comm_seconds(volumes, layout, cluster, lambda axes: set(axes) <= {"tp"} or axes in (("sp",), ("ep",)))
    latency_calls = 0
    chunks = stage_layers(config, layout, 0)
    num_layers = sum(len(layers) for layers, _, _ in chunks)
    if layout.tp > 1:  # five all-reduces per dense layer, two per MoE layer (its block reads replicated tokens)
        num_moe = moe_layers(config, [i for layers, _, _ in chunks for i in layers])
        latency_calls += microbatches * (num_layers * 5 - num_moe * 3)
    if layout.sp > 1:  # Ulysses' eight all-to-alls per layer; MoE layers' balance-loss counts (one all-reduce each)
        latency_calls += microbatches * (num_layers * 8 + moe_layers(config, [i for ls, _, _ in chunks for i in ls]))
    if layout.expert_tensor_parallel:  # per MoE layer: the split experts' forward and backward all-reduces
        latency_calls += microbatches * moe_layers(config, [i for layers, _, _ in chunks for i in layers]) * 2
    mp_comm += latency_calls * cluster.link(_span(layout, "tp"))[1]
    if layout.ep > 1:  # per MoE layer: counts, dispatch and combine forward, two backward (three more recomputed)
        calls = 5 + (3 if layout.activation_checkpointing == "full" else 0)
        moe = moe_layers(config, [i for layers, _, _ in chunks for i in layers])
        mp_comm += microbatches * moe * calls * cluster.link(_span(layout, "ep"), layout.ep)[1]
    # the slowest pipeline rank's chunks (the last stage also runs lm_head; the first only looks the embedding up)
    forward, backward = max(
        (
            sum(f for f, _ in per_chunk),
            sum(b for _, b in per_chunk),
        )
        for per_chunk in (
            [_chunk_compute(config, layout, cluster, seq_len, layers, last) for layers, _, last in rank_chunks]
            for rank_chunks in (stage_layers(config, layout, pp_rank) for pp_rank in range(layout.pp))
        )
    )
    compute = microbatches * (forward + backward)
    bubble = 0.0
    if layout.pp > 1:
        from .schedule import pipeline_makespan

        act = layout.micro_batch_size * seq_len * config.hidden_size * layout.compute_bytes
        bandwidth, latency = cluster.link(_span(layout, "pp"))
        v = layout.num_model_chunks
        mp_per_chunk = mp_comm / (microbatches * v) if microbatches else 0.0
        makespan = pipeline_makespan(
            layout,
            forward=forward / v + mp_per_chunk / 2,
            backward_input=backward / v / 2 + mp_per_chunk / 4,
            backward_weight=backward / v / 2 + mp_per_chunk / 4,
            p2p=act / bandwidth + latency,
        )
        bubble = max(0.0, makespan - compute - mp_comm)
    # data-parallel traffic and its overlap windows
    reduce_ops = {"reduce_scatter", "all_reduce"}
    dp_reduce = _comm_seconds(
        {k: v for k, v in volumes.items() if k[0] in reduce_ops and not set(k[1].split("+")) & model_axes},
        layout,
        cluster,
        lambda axes: True,
    )
    dp_gather = _comm_seconds(
        {k: v for k, v in volumes.items() if k[0] == "all_gather" and not set(k[1].split("+")) & model_axes},
        layout,
        cluster,
        lambda axes: True,
    )
    if layout.plugin == "ddp":  # torch DDP all-reduces fp32 gradient buckets during backward
        params = sum(static_memory(config, layout).chunk_numels) or _param_count(config, layout)
        bandwidth, _ = cluster.link(_span(layout, "dp"), layout.dp)
        n = layout.dp
        dp_reduce = 2 * (n - 1) / n * params * 4 / bandwidth if n > 1 else 0.0
    stage = layout.stage
    reduce_window = backward if (stage == 1 or layout.pp > 1) else microbatches * backward
    # stage 3 under a pipeline gathers each chunk once, during the first microbatch's forward
    gather_window = forward if stage in (1, 2) or layout.pp > 1 else microbatches * (forward + backward)
    exposed = max(0.0, dp_reduce - reduce_window) + max(0.0, dp_gather - gather_window)
    static = static_memory(config, layout, no_decay_vectors=True)
    state_bytes = static.masters + static.grads + static.optimizer_states
    if layout.precision == "fp32" and layout.plugin != "ddp":
        state_bytes += static.params  # the masters are the parameters
    optimizer = 2 * state_bytes / (cluster.memory_bandwidth * cluster.efficiency.memory)
    if static.host:
        optimizer = 2 * state_bytes / (20e9) + static.host / cluster.host_bandwidth
    from ..models.llama.flops import flops_per_token

    tokens = layout.dp * layout.ep * layout.micro_batch_size * microbatches * seq_len
    flops = flops_per_token(config, seq_len)
    if moe_layers(config, range(config.num_hidden_layers)):  # the active parameters only, as the trainer counts
        flops -= 6 * (config.num_parameters() - config.num_active_parameters())
    return StepTime(
        compute=compute,
        model_parallel_comm=mp_comm,
        pipeline_bubble=bubble,
        data_parallel_exposed=exposed,
        optimizer=optimizer,
        tokens_per_step=tokens,
        world_size=layout.world_size,
        flops_per_token=flops,
    )


def _param_count(config: LlamaConfig, layout: Layout) -> int:
    from .memory import rank_parameters

    return sum(e.numel for e in rank_parameters(config, layout))
