"""LoRA (colo.apps.lora over peft): only the adapters train, under every plugin the result matches the single-process
LoRA model, tensor-parallel adapters are sharded like their layer, and merged weights equal the unsharded merge.

Tolerances (fp32) as in test_booster_hybrid: losses rel 1e-5; parameters rtol 1e-5, atol 1e-4 (tensor-parallel
matmuls and reductions sum in another order, and AdamW moves each weight by about lr * g / (|g| + eps), which
amplifies the rounding of near-zero gradient entries to ~1e-5; a sharding mistake moves weights by ~lr = 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

pytest.importorskip("peft")

STEPS, ROWS, SEQ, LR, RANK, ALPHA = 4, 8, 16, 1e-2, 4, 8.0


def make_lora_model(seed: int = 0, adapter_seed: int = 0):
    """The tiny Llama with adapters on every projection; ``B`` drawn at random (peft starts it at zero, which
    would leave ``A`` without a gradient in the first step and the test weaker). ``adapter_seed``: the seed
    ``add_lora`` draws ``A`` from."""
    from colo.apps import Llama, get_preset
    from colo.apps.lora import add_lora, lora_layers

    torch.manual_seed(seed)
    model = Llama(get_preset("tiny"))
    model.init_weights(seed)
    add_lora(model, r=RANK, alpha=ALPHA, seed=adapter_seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
    return model


def global_batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 128, (ROWS, SEQ), generator=generator)
    return {"input_ids": tokens, "labels": tokens.clone()}


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def train_alone(model) -> list[float]:
    """`STEPS` single-process steps on the global batches; the losses."""
    optimizer = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        loss = model(**global_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def reference_run(initial: dict[str, torch.Tensor] | None = None):
    """Single process: the losses, the trained adapters and the merged weights; ``initial``: the parameters to
    start from (default: the seeded model's)."""
    from colo.apps.lora import merge_lora

    model = make_lora_model()
    if initial is not None:
        model.load_state_dict(initial)
    losses = train_alone(model)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    merge_lora(model)
    merged = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, adapters, merged


def full_of(reference: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The unsharded reference tensor that parallel parameter ``name`` is a piece of: ``*.{q,k,v}_weight`` of a
    q/k/v-parallel layer (the base or its lora_B) are row blocks of the reference's fused ``*.weight``."""
    from colo.apps import get_preset

    module_name, _, attr = name.rpartition(".")
    if attr not in ("q_weight", "k_weight", "v_weight"):
        return reference[name]
    config = get_preset("tiny")
    heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
    rows = [n * config.head_dim for n in heads]
    return reference[f"{module_name}.weight"].split(rows)["qkv".index(attr[0])]


def _compare(values: dict, reference: dict, params: dict, exact: bool = False) -> list[str]:
    from colo.tensor import layout_of

    mismatches = []
    for name, value in values.items():
        expected = full_of(reference, name)
        layout = layout_of(params[name]) if name in params else None
        if layout is not None and value.shape != expected.shape:  # a tensor-parallel shard
            expected = layout.local_slice(expected)
        try:
            tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-4}
            torch.testing.assert_close(value, expected, **tolerance)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    return mismatches


def _plugin_run(kind, settings):
    from colo.apps import DDP, Booster, Gemini, Zero
    from colo.apps.booster import HybridParallel
    from colo.apps.lora import lora_parameters, merge_lora

    expected_losses, expected_adapters, expected_merged = reference_run()
    plugin = {"ddp": DDP, "zero": Zero, "gemini": Gemini, "hybrid": HybridParallel}[kind](**settings)
    model = make_lora_model()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    booster = Booster(plugin)
    booster.boost(model, make_optimizer(model))
    mesh = booster.engine.mesh
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    rows = ROWS // dp
    losses = []
    for step in range(STEPS):
        batch = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in global_batch(step).items()}
        losses.append(booster.train_step(batch).loss)
    engine = booster.engine
    params = dict(model.named_parameters())
    if kind == "ddp":
        adapters = {n: p.detach().clone() for n, p in lora_parameters(model).items()}
        optimizer_params = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
        in_optimizer = {n for n, p in params.items() if id(p) in optimizer_params}
    else:
        adapters = engine.optimizer.full_params()  # the fp32 masters of what the optimizer steps
        in_optimizer = set(adapters)
    if kind == "hybrid" and settings.get("pp", 1) > 1:
        params = dict(engine.model.named_parameters())  # this stage's
    mismatches = _compare(adapters, expected_adapters, params)
    frozen_changed = []
    pipelined = kind == "hybrid" and settings.get("pp", 1) > 1
    if kind == "hybrid":
        engine.optimizer.wait_params()
    if not pipelined and settings.get("stage") != 3 and kind != "gemini":  # (sharded or offloaded parameters)
        frozen_after = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        frozen_changed = _compare(frozen_after, frozen_before, params, exact=True)
    merged_mismatches = []
    if kind == "hybrid" and not pipelined:  # the parameters are the modules' own tensors: merge in place
        merge_lora(model)
        merged = {n: p.detach().clone() for n, p in model.named_parameters()}
        merged_mismatches = _compare(merged, expected_merged, dict(model.named_parameters()))
    return {
        "losses": losses,
        "expected_losses": expected_losses,
        "trainable": sorted(in_optimizer),
        "mismatches": mismatches,
        "merged_mismatches": merged_mismatches,
        "frozen_changed": frozen_changed,
        "num_adapters": len(adapters),
    }


@pytest.mark.parametrize(
    "kind, settings, world_size",
    [
        ("ddp", {}, 2),
        ("zero", {"stage": 2}, 2),
        ("zero", {"stage": 3}, 2),
        ("gemini", {"placement": "auto", "device_capacity": "64MiB"}, 2),  # chunks placed by Gemini's auto policy
        ("hybrid", {"tp": 2, "zero_stage": 1}, 4),  # dp2 x tp2
        ("hybrid", {"tp": 4, "zero_stage": 0}, 4),  # tp4 > 2 kv heads: k/v (and their lora_B rows) replicated
        ("hybrid", {"tp": 2, "sp_mode": "megatron", "zero_stage": 1}, 2),  # Megatron-SP
        ("hybrid", {"tp": 2, "pp": 2, "num_microbatches": 4, "zero_stage": 0}, 4),  # pp2 x tp2
        # pp2 x dp2 ZeRO-3 under ZB-H1, with full activation checkpointing: frozen base chunks held for the step
        (
            "hybrid",
            {
                "pp": 2,
                "num_microbatches": 4,
                "zero_stage": 3,
                "schedule": "zero_bubble_h1",
                "activation_checkpointing": "full",
            },
            4,
        ),
    ],
    ids=[
        "ddp",
        "zero2",
        "zero3",
        "gemini",
        "dp2-tp2-zero1",
        "tp4-kv-replicated",
        "tp2-megatron-sp",
        "pp2-tp2",
        "pp2-dp2-zero3-zbh1-checkpointed",
    ],
)
def test_lora_under_each_plugin_matches_the_single_process_lora_model(kind, settings, world_size):
    for result in run_distributed(_plugin_run, kind, settings, world_size=world_size):
        assert result["losses"] == pytest.approx(result["expected_losses"], rel=1e-5)
        assert result["num_adapters"] > 0 and not result["mismatches"], result["mismatches"]
        # only adapters enter the optimizer (ZeRO: only they have fp32 masters and optimizer state)
        assert result["trainable"] and all(".lora_" in name for name in result["trainable"]), result["trainable"]
        assert not result["frozen_changed"], result["frozen_changed"]
        assert not result["merged_mismatches"], result["merged_mismatches"]


def _unseeded_adapters_run():
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel
    from colo.comm import broadcast_object
    from colo.tensor import layout_of

    rank = torch.distributed.get_rank()
    model = make_lora_model(adapter_seed=1000 + rank)  # the same base; A drawn from a seed of each rank's own
    mine = dict(model.state_dict())
    rank_0s = broadcast_object(mine if rank == 0 else None, src=0)
    name = next(n for n in mine if ".lora_A." in n)
    differed = not torch.equal(mine[name], rank_0s[name])
    expected_losses, expected_adapters, _ = reference_run(initial=rank_0s)
    booster = Booster(HybridParallel(tp=2, zero_stage=1))  # A replicated or sharded to match its layer
    booster.boost(model, make_optimizer(model))
    losses = [booster.train_step(global_batch(step)).loss for step in range(STEPS)]
    adapters = booster.engine.optimizer.full_params()
    params = dict(model.named_parameters())
    sharded = any(layout_of(params[n]) is not None for n in adapters)
    return losses, expected_losses, differed, sharded, _compare(adapters, expected_adapters, params)


def test_adapters_drawn_differently_on_each_rank_start_as_rank_0s():
    """`Booster.boost` makes the adapters rank 0's before sharding them: the run equals the single-process run of
    rank 0's model (tolerances as above)."""
    results = run_distributed(_unseeded_adapters_run, world_size=2)
    assert any(differed for _, _, differed, _, _ in results)
    for losses, expected_losses, _, sharded, mismatches in results:
        assert sharded
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert not mismatches, mismatches


def _unseeded_lora_tp2_run(expected: dict[str, torch.Tensor]):
    """``add_lora`` with no seed on ranks whose torch RNGs differ (as a launched job's do), then tp=2; the trained
    adapters' mismatches against ``expected`` (one process's)."""
    from colo.apps import Booster, Llama, get_preset
    from colo.apps.booster import HybridParallel
    from colo.apps.lora import add_lora, lora_layers

    torch.manual_seed(1000 + torch.distributed.get_rank())  # each rank's torch RNG elsewhere
    model = Llama(get_preset("tiny"))
    model.init_weights(0)
    drawn = {}
    for name, layer in lora_layers(add_lora(model, r=RANK, alpha=ALPHA)):
        drawn[name] = layer.lora_A["default"].weight.detach().clone()
    booster = Booster(HybridParallel(tp=2, zero_stage=0))
    booster.boost(model, make_optimizer(model))
    losses = [booster.train_step(global_batch(step)).loss for step in range(STEPS)]
    return drawn, losses, _compare(booster.engine.optimizer.full_params(), expected, dict(model.named_parameters()))


def test_unseeded_adapters_are_the_same_on_every_tp_rank_and_in_one_process():
    """`add_lora` draws A from its seed and the layer's name, not from the torch RNG: ranks seeded differently
    draw the same adapters, and the tp=2 run equals one process whose RNG is in yet another state (losses rel
    1e-5, adapters rtol 1e-5 / atol 1e-4, as above; A differs by ~0.1 between seeds)."""
    from colo.apps import Llama, get_preset
    from colo.apps.lora import add_lora

    torch.manual_seed(12345)
    reference = Llama(get_preset("tiny"))
    reference.init_weights(0)
    add_lora(reference, r=RANK, alpha=ALPHA)
    expected_losses = train_alone(reference)
    expected = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}

    (drawn_0, losses, mismatches), (drawn_1, _, _) = run_distributed(_unseeded_lora_tp2_run, expected, world_size=2)
    assert len(drawn_0) == 10 and all(torch.equal(drawn_0[name], drawn_1[name]) for name in drawn_0)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert not mismatches, mismatches


def test_only_adapters_train_and_merging_keeps_the_function():
    from colo.apps import Llama, get_preset
    from colo.apps.lora import add_lora, lora_layers, lora_parameters, merge_lora

    torch.manual_seed(0)
    base = Llama(get_preset("tiny"))
    base.init_weights(0)
    batch = global_batch(0)
    with torch.no_grad():
        base_logits = base(batch["input_ids"]).logits
    model = make_lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and len(trainable) == 2 * 5 * 2  # A, B x 5 linears x 2 layers
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = make_optimizer(model)
    for step in range(3):
        model(**global_batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), f"{name} is frozen but changed"
    with torch.no_grad():
        lora_logits = model(batch["input_ids"]).logits
    assert (lora_logits - base_logits).abs().max() > 1e-3  # the adapters changed the function
    merge_lora(model)
    assert not list(lora_layers(model)) and type(model.layers["0"].mlp.up_proj) is torch.nn.Linear
    with torch.no_grad():
        merged_logits = model(batch["input_ids"]).logits
    # merging changes the rounding only (x (W + s B A)^T vs x W^T + s (x A^T) B^T)
    torch.testing.assert_close(merged_logits, lora_logits, rtol=1e-5, atol=1e-5)

    fresh = Llama(get_preset("tiny"))
    add_lora(fresh)  # peft starts B at zero: the model is unchanged until trained
    fresh.load_state_dict({**dict(fresh.state_dict()), **_base_state(base, fresh)})
    with torch.no_grad():
        torch.testing.assert_close(fresh(batch["input_ids"]).logits, base_logits, rtol=0, atol=0)


def _base_state(base, adapted):
    names = {n.replace(".base_layer.", "."): n for n in adapted.state_dict() if ".base_layer." in n}
    return {names.get(n, n): t for n, t in base.state_dict().items()}


def test_bad_lora_settings_name_the_fix():
    from colo.apps import Llama, get_preset
    from colo.apps.lora import add_lora

    model = Llama(get_preset("tiny"))
    with pytest.raises(ValueError, match=r"r=0 must be a positive rank"):
        add_lora(model, r=0)
    with pytest.raises(ValueError, match=r"dropout=1.5 must be in \[0, 1\)"):
        add_lora(model, dropout=1.5)
    with pytest.raises(ValueError, match=r"target_modules=\['nope'\]"):
        add_lora(model, target_modules=["nope"])
    add_lora(model)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(model)


def make_hf_lora_model():
    """A tiny transformers ``LlamaForCausalLM`` (4 heads, 2 kv heads) with adapters on q, k, v, o and the MLP."""
    import transformers

    from colo.apps.lora import add_lora, lora_layers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    add_lora(model, r=RANK, alpha=ALPHA)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
    return model


def _hf_run(settings):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel
    from colo.apps.lora import merge_lora

    reference = make_hf_lora_model()
    optimizer = make_optimizer(reference)
    expected_losses = []
    for step in range(STEPS):
        loss = reference(**global_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append(loss.item())
    expected_adapters = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    merge_lora(reference)
    expected_merged = {n: p.detach().clone() for n, p in reference.named_parameters()}

    model = make_hf_lora_model()
    booster = Booster(HybridParallel(**settings))
    booster.boost(model, make_optimizer(model))
    mesh = booster.engine.mesh
    rows = ROWS // mesh.size("dp")
    losses = []
    for step in range(STEPS):
        batch = {k: v[mesh.rank("dp") * rows : (mesh.rank("dp") + 1) * rows] for k, v in global_batch(step).items()}
        losses.append(booster.train_step(batch).loss)
    adapters = booster.engine.optimizer.full_params()
    params = dict(model.named_parameters())
    mismatches = _compare(adapters, expected_adapters, params)
    booster.engine.optimizer.wait_params()
    merge_lora(model)
    merged = {n: p.detach().clone() for n, p in model.named_parameters()}
    mismatches += _compare(merged, expected_merged, dict(model.named_parameters()))
    return losses, expected_losses, sorted(adapters), mismatches


def test_lora_on_a_transformers_llama_under_tensor_parallelism():
    """The Hugging Face plan shards q/k/v/o and the MLP; their adapters follow (a transformers model, tp=2)."""
    pytest.importorskip("transformers")
    for losses, expected_losses, trainable, mismatches in run_distributed(
        _hf_run, {"tp": 2, "zero_stage": 1}, world_size=2
    ):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert len(trainable) == 2 * 7 * 2 and all(".lora_" in name for name in trainable), trainable
        assert not mismatches, mismatches
