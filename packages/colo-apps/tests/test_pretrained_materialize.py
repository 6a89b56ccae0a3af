"""Pretrained weights into a model the plugin materializes shard by shard: a meta-device `Llama` with
`PretrainedLlamaWeights` (``model.init_from``) under HybridParallel tp=2 and pp=2 holds exactly the pretrained
values (each rank its shards; compared with the whole model loaded in one process, bit for bit) and its first loss
equals the single-process loss (rel 1e-5: tensor-parallel sums in another order). A LoRA run's checkpoint as the
source gives the merged weights."""

from __future__ import annotations

import pytest
import torch

from colo.comm import CommTracker
from colo.comm.testing import run_distributed


def write_base(root) -> str:
    """A 'pretrained' tiny Llama in Hugging Face format (vocabulary 320: room for the byte tokenizer's 259)."""
    from colo.apps import Llama, get_preset
    from colo.apps.hf.llama_io import save_llama_as_hf

    torch.manual_seed(3)
    model = Llama(get_preset("tiny", vocab_size=320))
    model.init_weights(3)
    save_llama_as_hf(model, root / "base")
    return str(root / "base")


def batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": tokens, "labels": tokens.clone()}


def full_of(reference: dict[str, torch.Tensor], name: str, config) -> torch.Tensor:
    module, _, attr = name.rpartition(".")
    if attr not in ("q_weight", "k_weight", "v_weight"):
        return reference[name]
    rows = [n * config.head_dim for n in (config.num_attention_heads, *[config.num_key_value_heads] * 2)]
    return reference[f"{module}.weight"].split(rows)["qkv".index(attr[0])]


def _materialized_run(base: str, settings: dict):
    from colo.apps import Booster, Llama
    from colo.apps.booster import HybridParallel
    from colo.apps.booster.llama_plan import set_materialize_fn
    from colo.apps.hf.llama_io import load_llama_from_hf
    from colo.apps.runs import PretrainedLlamaWeights, pretrained_llama_config
    from colo.tensor import layout_of

    reference = load_llama_from_hf(base)
    expected_loss = reference(**batch()).loss.item()
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    config = pretrained_llama_config(base)
    with torch.device("meta"):
        model = Llama(config)
    set_materialize_fn(model, PretrainedLlamaWeights(base, config))
    booster = Booster(HybridParallel(**settings))
    with CommTracker() as tracker:
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    # every rank materializes the same values: no broadcast of the model over the world (as for a model built on
    # every rank, which may have been built unseeded)
    world_broadcasts = tracker.calls("broadcast", axis="world")
    engine = booster.engine
    values = engine.optimizer.full_params()  # this pipeline stage's parameters, gathered over data ranks
    params = dict(engine.model.named_parameters())
    mismatches = []
    for name, value in values.items():
        reference_value = full_of(expected, name, config)
        layout = layout_of(params[name])
        if layout is not None:
            reference_value = layout.local_slice(reference_value)
        if not torch.equal(value, reference_value):
            mismatches.append(name)
    loss = booster.train_step(batch()).loss
    return len(values), mismatches, loss, expected_loss, world_broadcasts


@pytest.mark.parametrize("settings", [{"tp": 2}, {"pp": 2, "num_microbatches": 2}], ids=["tp2", "pp2"])
def test_meta_model_materializes_pretrained_shards(tmp_path, settings):
    base = write_base(tmp_path)
    results = run_distributed(_materialized_run, base, settings, world_size=2)
    for count, mismatches, loss, expected_loss, world_broadcasts in results:
        assert count > 0 and not mismatches, mismatches
        assert world_broadcasts == 0
        assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_a_lora_checkpoint_source_gives_the_merged_weights(tmp_path):
    from colo.apps import Llama, get_preset
    from colo.apps.runs import RUN_KEY, PretrainedLlamaWeights
    from colo.tensor.checkpoint import save_checkpoint

    config = get_preset("tiny", vocab_size=128)
    torch.manual_seed(0)
    base = {n: p.detach().clone() for n, p in Llama(config).named_parameters()}
    q_rows = config.num_attention_heads * config.head_dim
    weight = base["layers.0.self_attn.qkv_proj.weight"][:q_rows]
    a, b = torch.randn(4, weight.shape[1]), torch.randn(weight.shape[0], 4)
    tensors = {
        "layers.0.self_attn.q_proj.base_layer.weight": weight,
        "layers.0.self_attn.q_proj.lora_A.default.weight": a,
        "layers.0.self_attn.q_proj.lora_B.default.weight": b,
        "layers.0.input_layernorm.weight": base["layers.0.input_layernorm.weight"],
    }
    run = {"config": {"lora": {"enabled": True, "r": 4, "alpha": 8.0}}, "llama_config": {}}
    save_checkpoint(str(tmp_path / "ckpt"), tensors, metadata={RUN_KEY: run})
    source = PretrainedLlamaWeights(tmp_path / "ckpt", config)
    torch.testing.assert_close(source._stored("layers.0.self_attn.q_proj.weight"), weight + 2.0 * b @ a)
    assert torch.equal(source.tensor("layers.0.input_layernorm.weight"), base["layers.0.input_layernorm.weight"])
    with pytest.raises(ValueError, match="has no tensor 'layers.1.mlp.up_proj.weight'"):
        source.tensor("layers.1.mlp.up_proj.weight")


def _train_losses(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    return train(validate_config(config)).losses


def test_trainer_init_from_under_hybrid_matches_the_eager_ddp_run(tmp_path):
    """``model.init_from`` under ``hybrid`` goes through the meta device and per-shard loading; under ``ddp`` the
    whole model is loaded first. Same data, same first two losses (rel 1e-5)."""
    base = write_base(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def pretrained_{n}(x):\n    return x + {n}\n" for n in range(400)))

    def config(plugin: dict, name: str) -> dict:
        return {
            "output_dir": str(tmp_path / name),
            "seed": 1,
            "model": {"init_from": base},
            "plugin": {"precision": "fp32", **plugin},
            "schedule": {"total_steps": 2, "warmup_steps": 1},
            "data": {"paths": [str(corpus)], "seq_len": 32, "global_batch_size": 4, "shuffle": False},
            "checkpoint": {"enabled": False},
            "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False, "jsonl": False},
            "sample": {"max_new_tokens": 0},
        }

    hybrid = run_distributed(_train_losses, config({"name": "hybrid", "tp": 2}, "hybrid"), world_size=2)[0]
    eager = run_distributed(_train_losses, config({"name": "ddp"}, "ddp"), world_size=2)[0]
    assert sorted(hybrid) == [1, 2]
    for step in (1, 2):
        assert hybrid[step] == pytest.approx(eager[step], rel=1e-5)


def _meta_lora_run(base: str):
    from colo.apps import Booster, Llama
    from colo.apps.booster import HybridParallel
    from colo.apps.booster.llama_plan import set_materialize_fn
    from colo.apps.hf.llama_io import load_llama_from_hf
    from colo.apps.lora import add_lora, lora_layers
    from colo.apps.runs import PretrainedLlamaWeights, pretrained_llama_config
    from colo.comm import all_gather_object

    expected_loss = load_llama_from_hf(base)(**batch()).loss.item()
    config = pretrained_llama_config(base)
    with torch.device("meta"):
        model = Llama(config)
    set_materialize_fn(model, PretrainedLlamaWeights(base, config))
    add_lora(model, r=4, alpha=8.0)
    booster = Booster(HybridParallel(tp=2))
    booster.boost(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    replicated = {}
    for name, layer in lora_layers(model):
        for half in ("lora_A", "lora_B"):
            module = getattr(layer, half)["default"]
            if type(module) is torch.nn.Linear:  # the replicated half: A of a column layer, B of a row layer
                replicated[f"{name}.{half}"] = module.weight.detach().clone()
    everyone = all_gather_object(replicated)
    same_everywhere = all(torch.equal(everyone[0][k], other[k]) for other in everyone for k in replicated)
    loss = booster.train_step(batch()).loss  # B starts at zero: the first loss is the base model's
    return len(replicated), same_everywhere, any(p.is_meta for p in model.parameters()), loss, expected_loss


def test_lora_on_a_meta_model_gets_the_same_adapters_on_every_rank(tmp_path):
    base = write_base(tmp_path)
    for count, same, any_meta, loss, expected_loss in run_distributed(_meta_lora_run, base, world_size=2):
        assert count == 2 * 5 and same and not any_meta
        assert loss == pytest.approx(expected_loss, rel=1e-5)
