"""`LlamaConfig` rejects bad shapes with messages that name the field and the fix; the presets have the published
parameter counts (counted on the meta device, equal to the config's own count); `flops_per_token` and `mfu` match
a hand computation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colo.apps import PEAK_FLOPS, format_mfu, mfu, peak_flops
from colo.apps.mfu import device_family
from colo.apps.models.llama import PRESETS, Llama, LlamaConfig, flops_per_token, get_preset, matmul_parameters

BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 60, "num_attention_heads": 8}, r"hidden_size=60 is not divisible by num_attention_heads=8"),
        ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3.*\[1, 2, 4\]"),
        ({"hidden_size": 12, "num_attention_heads": 4}, r"head_dim = .* = 3 must be even"),
        ({"vocab_size": 0}, r"vocab_size=0 must be a positive integer"),
        ({"num_hidden_layers": 2.0}, r"num_hidden_layers=2.0 must be a positive integer"),
        ({"max_position_embeddings": True}, r"max_position_embeddings=True must be a positive integer"),
        ({"rms_norm_eps": 0.0}, r"rms_norm_eps=0.0 must be a positive number"),
        ({"rope_theta": -1.0}, r"rope_theta=-1.0 must be a positive number"),
        ({"initializer_range": -0.1}, r"initializer_range=-0.1 must be a number >= 0"),
        ({"tie_word_embeddings": 1}, r"tie_word_embeddings=1 must be True or False"),
    ],
)
def test_config_rejects_bad_fields_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**BASE, **change})


def test_config_is_keyword_only_frozen_and_derives_head_dim():
    with pytest.raises(TypeError):
        LlamaConfig(128, 64, 176, 2, 4, 2)  # positional arguments are refused
    config = LlamaConfig(**BASE)
    assert config.head_dim == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 128
    wider = dataclasses.replace(config, hidden_size=128)
    assert wider.head_dim == 32  # derived, so a replaced hidden_size cannot leave a stale head_dim behind


def test_get_preset_lists_names_and_validates_overrides():
    with pytest.raises(ValueError, match=r"unknown Llama preset 'llama-9b'; choose one of \['1b', '70b', '7b'"):
        get_preset("llama-9b")
    with pytest.raises(ValueError, match=r"\['num_layers'\] are not LlamaConfig fields"):
        get_preset("tiny", num_layers=4)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        get_preset("tiny", num_key_value_heads=3)
    assert get_preset("tiny", num_hidden_layers=4).num_hidden_layers == 4
    assert get_preset("tiny") == PRESETS["tiny"]


# (preset, parameter count, tolerance): bench-25m is BENCHMARKS.md's Hugging Face LlamaForCausalLM (25.8M), 1b is
# TinyLlama-1.1B (1,100,048,384), 7b Llama-2-7B (6,738,415,616), 70b Llama-2-70B (68,976,648,192).
PUBLISHED = [
    ("bench-25m", 25.8e6, 0.1e6),
    ("tiny-llama", 5.0e6, 0.1e6),
    ("1b", 1_100_048_384, 0),
    ("7b", 6_738_415_616, 0),
    ("70b", 68_976_648_192, 0),
]


@pytest.mark.parametrize(("name", "expected", "tolerance"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_preset_parameter_counts_on_the_meta_device(name, expected, tolerance):
    config = get_preset(name)
    with torch.device("meta"):
        model = Llama(config)
    counted = sum(p.numel() for p in model.parameters())
    assert abs(counted - expected) <= tolerance, f"{name}: {counted:,} parameters"
    assert counted == config.num_parameters()
    assert all(p.is_meta for p in model.parameters())


def test_tied_parameters_are_counted_once():
    config = get_preset("tiny", tie_word_embeddings=True)
    with torch.device("meta"):
        model = Llama(config)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    assert config.num_parameters() == get_preset("tiny").num_parameters() - 128 * 64


def test_flops_per_token_by_hand():
    # bench-25m: L=6, hidden=512, 8 heads of 64, 4 kv heads, intermediate 1376, vocab 8192
    attention = 512 * (8 + 2 * 4) * 64 + 8 * 64 * 512  # fused q/k/v rows, then o_proj
    mlp = 3 * 512 * 1376
    weights = 6 * (attention + mlp) + 8192 * 512  # lm_head; the embedding is a lookup
    assert matmul_parameters(get_preset("bench-25m")) == weights == 21_594_112
    seq = 256
    scores = 12 * 6 * seq * 8 * 64  # q k^T and p v: 2 * 2 * S * H * D forward per token per layer, x3 for training
    assert flops_per_token(get_preset("bench-25m"), seq) == 6 * weights + scores == 139_001_856
    assert flops_per_token(get_preset("bench-25m"), seq, causal=True) == 6 * weights + scores // 2
    # tying removes the embedding, not a matmul: the FLOPs are those of the untied model
    tied = get_preset("bench-25m", tie_word_embeddings=True)
    assert flops_per_token(tied, seq) == flops_per_token(get_preset("bench-25m"), seq)
    with pytest.raises(ValueError, match="seq_len=0 must be a positive integer"):
        flops_per_token(tied, 0)


def test_mfu_and_device_peaks():
    # 7b at 4096 tokens: 6 * 6.476e9 + 12 * 32 * 4096 * 4096 = 4.530e10 FLOPs per token
    per_token = flops_per_token(get_preset("7b"), 4096)
    assert per_token == 6 * (6_738_415_616 - 32000 * 4096 - (2 * 32 + 1) * 4096) + 12 * 32 * 4096 * 4096
    value = mfu(3000.0, per_token, PEAK_FLOPS["H100 SXM"], num_devices=1)
    assert value == pytest.approx(3000.0 * per_token / 989e12)
    assert mfu(8 * 3000.0, per_token, 989e12, num_devices=8) == pytest.approx(value)
    assert mfu(3000.0, per_token, None) is None
    assert format_mfu(None) == "n/a" and format_mfu(0.4131) == "41.3%"
    assert device_family("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert device_family("NVIDIA H100 PCIe") == "H100 PCIe"
    assert device_family("NVIDIA H200") == "H200"
    assert device_family("NVIDIA A100-SXM4-80GB") == device_family("NVIDIA A100 80GB PCIe") == "A100"
    assert device_family("NVIDIA H100 NVL") is None and device_family("NVIDIA GeForce RTX 4090") is None
    assert peak_flops("cpu") is None
    assert peak_flops(dtype=torch.float32) is None  # no fp32 peak is listed: MFU is "n/a" rather than guessed
    if not torch.cuda.is_available():
        assert peak_flops() is None
