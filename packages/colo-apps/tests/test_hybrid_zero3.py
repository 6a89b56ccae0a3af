"""`HybridParallel(zero_stage=3)`: ZeRO-3 over the data axes of each tensor-parallel shard (FSDP x TP), dp2 x tp2 on
4 CPU ranks.

Each rank holds a tp shard of every weight (the plan's layout) and, of that, only its 1/dp slice of the chunks it was
packed into; a chunk is all-gathered over ``dp`` (never over ``tp``) before the modules that use it. The runs match
the single-process model over 5 AdamW steps: the loss of every step and every parameter at the end (the fp32
masters gathered over ``dp``; a tp shard against the matching slice of the reference). Also here: clipping, no_sync,
bf16, the communication of a step against its formula, peak parameter memory against an independent count,
checkpoints across layouts, and the errors for sizes that do not fit.

Tolerances (fp32): losses rtol 1e-5; parameters rtol 1e-5, atol 1e-4. Not bit-identical: tensor-parallel matmuls and
the vocabulary-parallel loss sum partial results over ranks, and the data ranks' gradients are averaged in another
order; AdamW moves each weight by about lr * g / (|g| + eps), which amplifies the rounding of near-zero gradient
entries to ~1e-5 (a sharding mistake moves weights by ~lr = 1e-2). bf16 runs compare with the fp32 reference at
2e-2 (8 mantissa bits in the compute copies and the reduced gradients, over five steps of lr 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, ROWS, SEQ, LR, VOCAB, LORA_RANK = 5, 8, 16, 1e-2, 128, 4
CHUNK_NUMEL = 6144
"""About one projection per chunk of a tp2 shard of the tiny models: gathering is per block, with prefetch."""
FP32 = {"rtol": 1e-5, "atol": 1e-4}


# --- the models and the single-process reference ---------------------------------------------------------------


def make_model(kind: str, lora: bool = False, seed: int = 0) -> torch.nn.Module:
    """The same tiny Llama on every rank (seeded): colo's native one or Hugging Face's; with ``lora``, adapters on
    every projection with ``B`` drawn at random (peft starts it at zero, leaving ``A`` without a gradient), and ``A``
    too (uniform in +-1/sqrt(in), as peft's init): with ``add_lora``'s own ``A`` (seed 0) one AdamW step of the
    checkpointed HF model lands on a near-zero gradient entry whose sign rounding decides, and the runs part by
    ~1e-3 (other seeds: < 1e-4, see the tolerances above)."""
    torch.manual_seed(seed)
    if kind == "native":
        from colo.apps import Llama, get_preset

        model = Llama(get_preset("tiny"))
        model.init_weights(seed)
    else:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(config)
    if lora:
        from colo.apps.lora import add_lora, lora_layers

        add_lora(model, r=LORA_RANK, alpha=2.0 * LORA_RANK)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, layer in lora_layers(model):
                weight = layer.lora_B["default"].weight
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
            for _, layer in lora_layers(model):
                weight = layer.lora_A["default"].weight
                weight.copy_((torch.rand(weight.shape, generator=generator) * 2 - 1) / weight.shape[1] ** 0.5)
    return model


def make_optimizer(model: torch.nn.Module, groups: bool = True) -> torch.optim.Optimizer:
    """AdamW; with ``groups`` in two: matrices decay at lr, vectors (norms) get no decay and twice the lr."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not groups:
        return torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1)
    matrices = [p for p in trainable if p.dim() >= 2]
    vectors = [p for p in trainable if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}]
    if vectors:
        groups.append({"params": vectors, "weight_decay": 0.0, "lr": 2 * LR})
    return torch.optim.AdamW(groups, lr=LR)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(500 + step))
    return {"input_ids": tokens, "labels": tokens.clone()}


def local_batch(step: int, mesh) -> dict[str, torch.Tensor]:
    """This data rank's rows of the step's global batch (the tp ranks of a data rank share them)."""
    rows = ROWS // mesh.size("dp")
    start = mesh.rank("dp") * rows
    return {k: v[start : start + rows] for k, v in global_batch(step).items()}


def reference_run(kind: str, lora: bool = False, *, max_norm: float | None = None, steps: int = STEPS):
    """The single-process run: its losses and trainable parameters after ``steps`` steps."""
    model = make_model(kind, lora)
    optimizer = make_optimizer(model)
    losses = []
    for step in range(steps):
        loss = model(**global_batch(step)).loss
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def reference_piece(kind: str, reference: dict[str, torch.Tensor], name: str, param: torch.nn.Parameter):
    """The piece of the unsharded reference tensor that this rank's parallel parameter ``name`` holds: the native
    Llama's ``*.qkv_proj.{q,k,v}_weight`` (the base's or its ``lora_B``'s) are row blocks of the fused
    ``*.qkv_proj.weight``; a tensor-parallel shard is its layout's slice of the whole."""
    from colo.tensor import layout_of

    module, _, leaf = name.rpartition(".")
    if kind == "native" and leaf in ("q_weight", "k_weight", "v_weight"):
        from colo.apps import get_preset

        config = get_preset("tiny")
        heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
        whole = reference[f"{module}.weight"].split([n * config.head_dim for n in heads])["qkv".index(leaf[0])]
    else:
        whole = reference[name]
    layout = layout_of(param)
    return layout.local_slice(whole) if layout is not None else whole


def mismatches(kind: str, booster, expected: dict[str, torch.Tensor], **tolerance) -> list[str]:
    """The trainable parameters (fp32 masters, gathered over dp) that differ from the reference's pieces."""
    named = dict(booster.engine.model.named_parameters())
    found = []
    for name, value in booster.engine.optimizer.full_params().items():
        try:
            torch.testing.assert_close(value, reference_piece(kind, expected, name, named[name]), **tolerance)
        except AssertionError as error:
            found.append(f"{name}: {error}")
    return found


def boost(kind: str, lora: bool = False, groups: bool = True, seed: int = 0, **settings):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel

    model = make_model(kind, lora, seed)
    settings = {"tp": 2, "zero_stage": 3, "chunk_numel": CHUNK_NUMEL, **settings}
    booster = Booster(HybridParallel(**settings))
    booster.boost(model, make_optimizer(model, groups))
    return booster


# --- training matches the single process -------------------------------------------------------------------------


def _train_against_reference(kind: str, lora: bool, settings: dict):
    expected_losses, expected = reference_run(kind, lora)
    booster = boost(kind, lora, **settings)
    zero = booster.engine.optimizer
    losses = [booster.train_step(local_batch(step, booster.mesh)).loss for step in range(STEPS)]
    # stage 3 over dp of each tp shard: every chunk's compute copy is a 1/dp shard, gathered per block (more than one
    # chunk, most gathers prefetched), and what is not a tp shard is replicated over tp
    assert zero.config.stage == 3 and len(zero.chunks) > 2
    assert all(chunk.buffer("param_shard").numel() * 2 == chunk.numel for chunk in zero.chunks)
    assert zero.gatherer.num_prefetch_hits > zero.gatherer.num_gathers // 2
    trainable = sorted(zero.full_params())
    found = mismatches(kind, booster, expected, **FP32)
    # backward frees every chunk it gathered: trainable ones once their gradients are reduce-scattered, frozen ones
    # (LoRA's base) once the last module that used them is through its backward; none waits for the step
    booster.backward(booster.forward(local_batch(0, booster.mesh)).loss)
    still_gathered = [chunk.index for chunk in zero.chunks if zero.gatherer.is_gathered(chunk)]
    booster.engine.zero_grad()
    return losses, expected_losses, trainable, found, still_gathered


@pytest.mark.parametrize(
    "kind, lora, settings",
    [
        ("native", False, {"activation_checkpointing": "full"}),
        ("native", True, {}),
        ("hf", False, {}),
        ("hf", True, {"activation_checkpointing": "full"}),
    ],
    ids=["native-checkpointed", "native-lora", "hf", "hf-lora-checkpointed"],
)
def test_dp2_tp2_zero3_matches_the_single_process_model(kind, lora, settings):
    if kind == "hf":
        pytest.importorskip("transformers")
    if lora:
        pytest.importorskip("peft")
    for losses, expected_losses, trainable, found, still_gathered in run_distributed(
        _train_against_reference, kind, lora, settings, world_size=4
    ):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert trainable and not found, found
        assert still_gathered == []
        # with LoRA only the adapters train (only they have fp32 masters and optimizer state)
        assert all((".lora_" in name) == lora for name in trainable), trainable


# --- clipping over every axis, no_sync, mixed precision ----------------------------------------------------------


def _clipped_against_reference():
    max_norm = 0.05  # well below the gradient norms of these steps: every step is clipped
    model = make_model("native")
    optimizer = make_optimizer(model)
    expected_losses, expected_norms = [], []
    for step in range(3):
        loss = model(**global_batch(step)).loss
        loss.backward()
        expected_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append(loss.item())
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    booster = boost("native", max_grad_norm=max_norm)
    results = [booster.train_step(local_batch(step, booster.mesh)) for step in range(3)]
    return (
        [r.loss for r in results],
        expected_losses,
        [r.grad_norm for r in results],
        expected_norms,
        mismatches("native", booster, expected, **FP32),
    )


def test_clipping_sums_the_norm_over_dp_and_tp_counting_tp_replicas_once():
    for losses, expected_losses, norms, expected_norms, found in run_distributed(
        _clipped_against_reference, world_size=4
    ):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert norms == pytest.approx(expected_norms, rel=1e-5)  # the norm of the whole model's gradient
        assert not found, found


def _no_sync_against_reference():
    from colo.comm import CommTracker

    expected_losses, expected = reference_run("native", steps=2)
    booster = boost("native")
    engine = booster.engine
    silent_volume, losses = [], []
    for step in range(2):
        batch = local_batch(step, booster.mesh)
        half = batch["input_ids"].shape[0] // 2
        first, second = ({k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()})
        with CommTracker() as silent, booster.no_sync():
            loss_first = booster.forward(first).loss * 0.5
            booster.backward(loss_first)
        silent_volume.append(silent.bytes(axis="dp") - silent.bytes("all_gather", axis="dp"))
        loss_second = booster.forward(second).loss * 0.5
        booster.backward(loss_second)
        engine.step()
        engine.zero_grad()
        losses.append(booster.mean_over_data_ranks(float(loss_first + loss_second)))
    return losses, expected_losses, silent_volume, mismatches("native", booster, expected, **FP32)


def test_no_sync_accumulates_without_reducing_over_dp_and_equals_the_big_batch():
    for losses, expected_losses, silent_volume, found in run_distributed(_no_sync_against_reference, world_size=4):
        # inside no_sync dp only gathers parameters (stage 3 still needs them): no gradient leaves the rank
        assert silent_volume == [0, 0]
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert not found, found


def _bf16_against_zero1_and_fp32():
    expected_losses, _ = reference_run("native")
    runs = {}
    for stage in (1, 3):
        booster = boost("native", precision="bf16", zero_stage=stage)
        losses = [booster.train_step(local_batch(step, booster.mesh)).loss for step in range(STEPS)]
        runs[stage] = (losses, booster.engine.optimizer.full_params(), booster)
    zero = runs[3][2].engine.optimizer
    dtypes = {chunk.buffer("param_shard").dtype for chunk in zero.chunks}
    masters = {chunk.buffer("master").dtype for chunk in zero.trainable_chunks}
    differences = {name: float((value - runs[1][1][name]).abs().max()) for name, value in runs[3][1].items()}
    return runs[3][0], runs[1][0], expected_losses, dtypes, masters, differences


def test_bf16_compute_shards_with_fp32_masters_track_zero1_and_the_fp32_run():
    for losses, zero1_losses, fp32_losses, dtypes, masters, differences in run_distributed(
        _bf16_against_zero1_and_fp32, world_size=4
    ):
        assert dtypes == {torch.bfloat16} and masters == {torch.float32}
        assert losses == pytest.approx(fp32_losses, rel=2e-2)
        assert losses == pytest.approx(zero1_losses, rel=1e-5)
        # the same bf16 compute copies (cast from the same fp32 masters) and gradients reduced over two data ranks (a
        # sum of two is the same in any order): ZeRO-3's gathered weights give ZeRO-1's parameters bit for bit
        assert max(differences.values()) == 0, differences


# --- communication per step and peak parameter memory ------------------------------------------------------------


def _communication_and_memory():
    from colo.apps import get_preset
    from colo.comm import CommTracker
    from colo.zero import stage3

    # one param group: chunks follow the modules' order (with a separate group for the norms, their one chunk would
    # be used by every block and stay gathered all along)
    booster = boost("native", groups=False)
    mesh, zero, model = booster.mesh, booster.engine.optimizer, booster.engine.model
    # the independent count of full parameter copies held: the storages the parameters view (gathered chunks), plus
    # the output buffers of all-gathers started over dp whose parameters do not view them yet (prefetches in flight)
    in_flight: dict[int, int] = {}
    peaks = {"viewed": 0, "held": 0}

    def spy_all_gather(tensor, *, out=None, **kwargs):
        in_flight[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
        return all_gather(tensor, out=out, **kwargs)

    def sample(*_):
        viewed = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        viewed = {pointer: n for pointer, n in viewed.items() if pointer and n}
        for pointer in viewed:
            in_flight.pop(pointer, None)
        peaks["viewed"] = max(peaks["viewed"], sum(viewed.values()))
        peaks["held"] = max(peaks["held"], sum(viewed.values()) + sum(in_flight.values()))

    for module in model.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(sample)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(sample)
    trackers = []
    all_gather, stage3.all_gather = stage3.all_gather, spy_all_gather
    try:
        for step in range(3):
            with CommTracker() as tracker:
                booster.train_step(local_batch(step, mesh))
            trackers.append(tracker)
    finally:
        stage3.all_gather = all_gather
    config = get_preset("tiny")
    volumes = [
        {(r.op, r.axis): (t.calls(r.op, axis=r.axis), t.bytes(r.op, axis=r.axis)) for r in t.records}
        for t in (trackers[0], trackers[2])
    ]
    report = zero.memory_report()
    chunks = [(chunk.numel, chunk.used_numel, chunk.buffer("param_shard").numel()) for chunk in zero.chunks]
    root = zero.gatherer.kept_for_backward
    return volumes, chunks, root, report, peaks, config, mesh.size("dp"), mesh.size("tp")


def test_communication_per_step_and_peak_parameter_memory_follow_the_formulas():
    volumes, chunks, root, report, peaks, config, dp, tp = run_distributed(_communication_and_memory, world_size=4)[0]
    fp32 = 4
    tokens = ROWS // dp * SEQ  # per rank: the tp ranks of a data rank share its rows
    hidden, layers = config.hidden_size, config.num_hidden_layers
    activation = tokens * hidden * fp32
    # each rank packs its tp shards: the vocabulary-parallel embedding and lm_head, q/k/v, o, gate/up/down split
    # over tp, the norms replicated; the chunks hold exactly that, padded
    heads = config.num_attention_heads + 2 * config.num_key_value_heads
    per_layer = (heads * config.head_dim * hidden + hidden * hidden + 3 * config.intermediate_size * hidden) // tp
    local_numel = 2 * config.vocab_size * hidden // tp + layers * (per_layer + 2 * hidden) + hidden
    assert sum(used for _, used, _ in chunks) == local_numel
    chunk_bytes = [numel * fp32 for numel, _, _ in chunks]
    assert all(shard * dp == numel for numel, _, shard in chunks)  # every chunk sharded over dp only
    ring = 2 * (tp - 1) / tp  # ring all-reduce over tp moves 2(n-1)/n of the buffer
    for step, volume in zip((1, 3), volumes):
        expected = {
            # tp: forward all-reduces the embedding and each layer's o_proj and down_proj outputs, backward the input
            # gradients of each layer's qkv, gate and up projections and of lm_head; the vocabulary-parallel loss
            # all-reduces each token's max, then its target logit and sum of exponentials
            ("all_reduce", "tp"): (5 * layers + 4, ring * ((5 * layers + 2) * activation + 3 * tokens * fp32)),
            # dp: every chunk gathered in forward and again in backward, except the root chunk (the one forward ends
            # with) which stays gathered into backward once the first forward has shown which it is
            ("all_gather", "dp"): (
                2 * len(chunks) - (step > 1),
                (dp - 1) / dp * (2 * sum(chunk_bytes) - (chunk_bytes[root] if step > 1 else 0)),
            ),
            ("reduce_scatter", "dp"): (len(chunks), (dp - 1) / dp * sum(chunk_bytes)),  # each chunk's gradients
            ("all_reduce", "dp"): (1, 2 * (dp - 1) / dp * 8),  # the reported loss (fp64)
            ("all_reduce", "dp+tp"): (1, 2 * (dp * tp - 1) / (dp * tp) * 8),  # the gradient norm over every axis
        }
        assert volume.keys() == expected.keys(), f"step {step}: {sorted(volume)}"
        for key, (calls, volume_bytes) in expected.items():
            assert volume[key][0] == calls, f"step {step} {key}: {volume[key][0]} calls, expected {calls}"
            assert volume[key][1] == pytest.approx(volume_bytes), f"step {step} {key}"
    # memory: after a step only the shards are held, 1/(dp*tp) of the model (the tp-replicated norms are 1/dp,
    # padding included); during a step at most (prefetch depth 1 + 1) gathered chunks and the root chunk on top
    model_numel = 2 * config.vocab_size * hidden + layers * (per_layer * tp + 2 * hidden) + hidden
    replicated = layers * 2 * hidden + hidden
    padding = sum(numel - used for numel, used, _ in chunks)
    shard_bytes = (model_numel / (dp * tp) + replicated * (tp - 1) / (dp * tp) + padding / dp) * fp32
    assert report.params == pytest.approx(shard_bytes)
    largest = max(chunk_bytes)
    assert report.peak_params <= shard_bytes + (1 + 1) * largest + chunk_bytes[root]
    # the independent count agrees with the report's peak. Every module's parameters lie in one chunk here (about
    # one projection each), so a module sees one gathered chunk at a time, and while it runs the all-gather of the
    # next chunk is in flight (prefetch depth 1): two chunks held at the peak, the root chunk never on top of them
    # (it is the last chunk of forward and the first whose gradients backward reduces, which frees it)
    assert peaks["viewed"] == largest
    assert report.peak_gathered_params == peaks["held"] == 2 * largest


# --- checkpoints -------------------------------------------------------------------------------------------------


def _save_then_resume_and_convert(saved: str, converted: str):
    """Train dp2 x tp2 ZeRO-3 for 2 steps, save, train 3 more (the uninterrupted run); resume from the checkpoint in
    a fresh run of the same layout; load it into pp2 x tp2 ZeRO-1 and save it again from there."""
    booster = boost("native")
    for step in range(2):
        booster.train_step(local_batch(step, booster.mesh))
    booster.save(saved)
    uninterrupted = [booster.train_step(local_batch(step, booster.mesh)).loss for step in range(2, 5)]
    resumed = continue_from(saved)
    pipeline = boost("native", seed=1, zero_stage=1, pp=2, num_microbatches=2)
    pipeline.load(saved)
    pipeline.save(converted)
    return uninterrupted, resumed


def continue_from(path: str, seed: int = 1) -> list[float]:
    """The losses of steps 2-4 of a dp2 x tp2 ZeRO-3 run of another initialisation that loads ``path`` first."""
    booster = boost("native", seed=seed)  # another initialisation: everything must come from the checkpoint
    booster.load(path)
    assert booster.step_count == 2
    return [booster.train_step(local_batch(step, booster.mesh)).loss for step in range(2, 5)]


def _load_in_one_process_and_save(saved: str, converted: str):
    from colo.apps import Booster, Zero

    model = make_model("native", seed=1)
    booster = Booster(Zero(stage=1))
    booster.boost(model, make_optimizer(model))
    booster.load(saved)
    booster.save(converted)


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from colo.tensor.checkpoint import load_checkpoint, read_index

    stored = {name: torch.empty(entry.shape, dtype=entry.dtype) for name, entry in read_index(path).tensors.items()}
    load_checkpoint(path, stored)
    return stored


def test_a_zero3_checkpoint_resumes_exactly_and_round_trips_through_pp2_tp2_zero1_and_one_process(tmp_path):
    saved, pipelined, single = (str(tmp_path / name) for name in ("dp2-tp2-zero3", "pp2-tp2-zero1", "single"))
    uninterrupted, resumed = run_distributed(_save_then_resume_and_convert, saved, pipelined, world_size=4)[0]
    assert resumed == uninterrupted  # the same layout resumes bit for bit (fp32)
    run_distributed(_load_in_one_process_and_save, saved, single, world_size=1)
    # what pp2 x tp2 ZeRO-1 and one process loaded, they save again unchanged: every tensor of the model and of
    # AdamW's state (unfused names, whatever the layout)
    original = checkpoint_tensors(saved)
    assert "layers.0.self_attn.q_proj.weight" in original and "optim/layers.1.mlp.up_proj.weight/exp_avg" in original
    assert not any("qkv_proj" in name for name in original)
    for path in (pipelined, single):
        tensors = checkpoint_tensors(path)
        assert tensors.keys() == original.keys()
        for name, value in original.items():
            assert torch.equal(tensors[name], value), f"{path}: {name}"
    # and back: their checkpoints resume dp2 x tp2 ZeRO-3 exactly where the saved run went on
    for path in (single, pipelined):
        for losses in run_distributed(continue_from, path, world_size=4):
            assert losses == uninterrupted


# --- bad input ---------------------------------------------------------------------------------------------------


def _bad_layouts():
    from colo.apps import Llama, get_preset
    from colo.comm import CommTracker

    errors = {}
    cases = {"dp2 x tp4 on 4 ranks": ({"dp": 2, "tp": 4}, {}), "tp4 over 2 heads": ({"tp": 4}, {"heads": 2})}
    for label, (settings, shape) in cases.items():
        model = make_model("native")
        if shape:
            model = Llama(get_preset("tiny", num_attention_heads=shape["heads"], num_key_value_heads=1))
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        with CommTracker() as tracker:
            try:
                boost_model(model, **settings)
            except ValueError as error:
                errors[label] = str(error)
        unchanged = all(torch.equal(p, before[name]) for name, p in model.named_parameters())
        errors[label] = (errors.get(label), len(tracker.records), unchanged)
    return errors


def boost_model(model: torch.nn.Module, **settings):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel

    Booster(HybridParallel(zero_stage=3, **settings)).boost(model, make_optimizer(model))


def test_sizes_that_do_not_fit_the_world_or_the_heads_fail_before_any_collective():
    for errors in run_distributed(_bad_layouts, world_size=4):
        message, collectives, unchanged = errors["dp2 x tp4 on 4 ranks"]
        assert "dp=2 x tp=4 x pp=1 x sp=1 = 8 ranks, but the world size is 4" in message
        assert collectives == 0 and unchanged  # raised before any collective, the model as it was
        message, collectives, unchanged = errors["tp4 over 2 heads"]
        assert message is not None and "tp=4 cannot shard num_attention_heads=2" in message, message
        assert collectives == 0 and unchanged
