"""The run config: every preset validates; errors name the field (unknown field, bad value, bad combination);
``--set`` overrides parse values and switch plugins; YAML and TOML files load; the optimizer groups and the LR
schedule do what the config says."""

from __future__ import annotations

import math

import pytest
import torch

from colo.apps.models.llama import Llama, get_preset
from colo.apps.train import RUN_PRESETS, ConfigError, RunConfig, apply_overrides, load_config
from colo.apps.train.optim import WarmupCosine, build_optimizer, build_scheduler


@pytest.mark.parametrize("preset", sorted(RUN_PRESETS))
def test_every_run_preset_validates(preset):
    config = load_config(preset=preset)
    assert config.name == preset
    if not preset.startswith("tiny-") and config.data.task != "diffusion":  # tiny-*: the CPU presets (DDP, fp32);
        # GPU recipes run HybridParallel in bf16, except diffusion (a UNet has no HybridParallel plan: ZeRO)
        assert config.plugin.name == "hybrid" and config.plugin.precision == "bf16"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimizer.lrr=1e-3"], "optimizer.lrr: unknown field"),
        (["plugin.name=zero", "plugin.stage=5"], "Zero.stage=5 is not a ZeRO stage"),
        (
            ["plugin.name=hybrid", "plugin.pp=2", "plugin.zero_stage=3", "plugin.compile_blocks=true"],
            "compile_blocks=True does not work with zero_stage=3",
        ),
        (["plugin.name=megatron"], "unknown plugin name; use one of ['ddp', 'zero', 'gemini', 'hybrid', 'expert']"),
        (["data.seq_len=many"], "data.seq_len: Input should be a valid integer"),
        (["optimizer.betas=[0.9, 1.5]"], "optimizer.betas: betas=(0.9, 1.5) must both be in [0, 1)"),
        (["model.preset=13b"], "model.preset: unknown Llama preset '13b'"),
        (["model.num_key_value_heads=3"], "num_key_value_heads"),
        (["schedule.warmup_steps=500", "schedule.total_steps=100"], "warmup_steps=500 is longer than total_steps"),
        (["data.seq_len=4096"], "data.seq_len=4096 is longer than the model's max_position_embeddings=1024"),
        (["data.global_batch_size=10", "schedule.num_microbatches=4"], "data.global_batch_size=10 does not divide"),
    ],
)
def test_validation_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(preset="tiny-llama", overrides=overrides)
    assert message in str(error.value)


def test_overrides_parse_values_and_switch_plugins():
    config = load_config(
        preset="tiny-llama",
        overrides=[
            "optimizer.lr=3e-4",
            "plugin.name=zero",
            "plugin.stage=1",
            "data.paths=[a.txt, b.txt]",
            "checkpoint.every_steps=null",
            "model.num_hidden_layers=2",
        ],
    )
    assert config.optimizer.lr == 3e-4
    assert config.plugin.name == "zero" and config.plugin.stage == 1
    assert config.plugin.max_grad_norm == 1.0  # kept: the zero plugin has it too
    assert config.data.paths == ["a.txt", "b.txt"]
    assert config.checkpoint.every_steps is None
    assert config.model.llama_config(vocab_size=320).num_hidden_layers == 2
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["optimizer.lr"])
    with pytest.raises(ConfigError, match="optimizer.lr is a value"):
        apply_overrides({"optimizer": {"lr": 1.0}}, ["optimizer.lr.x=2"])


def test_yaml_and_toml_files(tmp_path):
    (tmp_path / "run.yaml").write_text("seed: 7\noptimizer:\n  lr: 0.001\nplugin:\n  name: zero\n  stage: 2\n")
    (tmp_path / "run.toml").write_text('seed = 7\n[optimizer]\nlr = 0.001\n[plugin]\nname = "zero"\nstage = 2\n')
    from_yaml = load_config(tmp_path / "run.yaml", overrides=["seed=8"])
    from_toml = load_config(tmp_path / "run.toml", overrides=["seed=8"])
    assert from_yaml == from_toml and from_yaml.seed == 8 and from_yaml.plugin.stage == 2
    (tmp_path / "bad.yaml").write_text("optimizer:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match="optimizer.learning_rate: unknown field"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match="unknown extension"):
        load_config(tmp_path / "run.json")


def test_every_field_is_documented():
    def walk(schema, defs, where):
        for name, prop in schema.get("properties", {}).items():
            resolved = defs.get(prop.get("$ref", "").rpartition("/")[2], prop)
            assert prop.get("description") or resolved.get("description"), f"{where}.{name}"
            if "properties" in resolved:
                walk(resolved, defs, f"{where}.{name}")

    schema = RunConfig.model_json_schema()
    defs = schema["$defs"]
    walk(schema, defs, "config")
    for plugin in ("DDPSection", "ZeroSection", "GeminiSection", "HybridParallelSection"):
        walk(defs[plugin], defs, plugin)


def test_adamw_is_fused_on_cuda_unless_the_config_says():
    """``optimizer.fused: null`` runs torch's fused AdamW when the run computes on CUDA (its default there, foreach,
    took 37 ms of a 234 ms Llama-1b step on an H200), torch's default elsewhere; an explicit value wins."""
    model = Llama(get_preset("tiny"))
    settings = load_config(preset="tiny-llama").optimizer
    assert build_optimizer(model, settings, num_layers=2, device="cuda").defaults["fused"] is True
    assert not build_optimizer(model, settings, num_layers=2, device="cpu").defaults["fused"]
    assert not build_optimizer(model, settings, num_layers=2).defaults["fused"]
    explicit = settings.model_copy(update={"fused": False})
    assert build_optimizer(model, explicit, num_layers=2, device="cuda").defaults["fused"] is False


def test_param_groups_and_schedule():
    model = Llama(get_preset("tiny"))
    config = load_config(overrides=["optimizer.layerwise_lr_decay=0.5", "optimizer.lr=1.0"]).optimizer
    optimizer = build_optimizer(model, config, num_layers=2)
    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    assert by_param[id(model.norm.weight)]["weight_decay"] == 0.0
    assert by_param[id(model.lm_head.weight)]["weight_decay"] == 0.1
    assert by_param[id(model.lm_head.weight)]["lr"] == 1.0
    assert by_param[id(model.layers["1"].mlp.up_proj.weight)]["lr"] == 0.5
    assert by_param[id(model.layers["0"].mlp.up_proj.weight)]["lr"] == 0.25
    assert by_param[id(model.embed_tokens.weight)]["lr"] == 0.125
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))

    schedule = load_config(
        overrides=["schedule.total_steps=10", "schedule.warmup_steps=2", "schedule.min_lr=0.1", "optimizer.lr=1.0"]
    ).schedule
    lambda_lr = build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), schedule, peak_lr=1.0)
    lrs = []
    for _ in range(12):
        lrs.append(lambda_lr.get_last_lr()[0])
        lambda_lr.optimizer.step()
        lambda_lr.step()
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert math.isclose(lrs[10], 0.1) and math.isclose(lrs[11], 0.1)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert isinstance(lambda_lr.lr_lambdas[0], WarmupCosine)
    import json

    json.dumps(lambda_lr.state_dict())  # JSON: no pickle in checkpoints


def test_what_the_apps_readme_says_validation_accepts_and_refuses():
    """packages/colo-apps/README.md: SFT with ``packing: documents`` is accepted; rm / DPO under ``hybrid`` run with
    tp > 1 and are refused with pp > 1 or sp > 1."""
    sft = ["data.task=sft", "data.paths=[chats.jsonl]", "data.max_tokens=null", "data.packing=documents"]
    assert load_config(preset="tiny-llama", overrides=sft).data.packing == "documents"
    with pytest.raises(ConfigError, match="max_tokens"):
        load_config(preset="tiny-llama", overrides=[*sft[:2], "data.packing=documents"])
    for preset in ("tiny-rm", "tiny-dpo"):
        hybrid = ["plugin.name=hybrid", "plugin.zero_stage=1"]
        assert load_config(preset=preset, overrides=[*hybrid, "plugin.tp=2"]).plugin.tp == 2
        for refused in ("plugin.pp=2", "plugin.sp=2"):
            with pytest.raises(ConfigError):
                load_config(preset=preset, overrides=[*hybrid, refused])
