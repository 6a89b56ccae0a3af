"""Weight-only quantization (colo.apps.quant): error bounds of the formats, storage, model logits and perplexity
against fp32, exact save / load round trips through colo checkpoints and `colo convert --quantize`, bad input."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from typer.testing import CliRunner

from colo.apps.cli import app
from colo.apps.data import load_tokenizer
from colo.apps.generation import SamplingParams, complete, generate
from colo.apps.models.llama import Llama, get_preset, llama_state_dict_to_hf
from colo.apps.quant import (
    QuantConfig,
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    load_quantized,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    save_quantized,
    set_backend,
    storage_report,
    unpack_int4,
)
from colo.tensor.checkpoint import read_index, save_checkpoint

EPS32 = torch.finfo(torch.float32).eps


def tiny_config(**overrides):
    # intermediate_size 192 (not the preset's 176) so that int4 groups of 32 and 64 divide down_proj's inputs
    return get_preset("tiny", intermediate_size=192, **overrides)


def weights(seed: int = 0) -> torch.Tensor:
    """(16, 256) weights with what breaks naive quantizers: outliers, an all-zero row, a constant row, skew."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 256, generator=generator) * 0.02
    w[3, 17] = 0.9  # an outlier sets its row's int8 scale and its group's int4 range
    w[5] = 0.0
    w[6] = -0.125
    w[7] = w[7].abs() + 0.3  # a group far from zero: only an asymmetric grid spans it with 16 codes
    return w


def assert_within_half_step(w: torch.Tensor, dequantized: torch.Tensor, step: torch.Tensor, offset: torch.Tensor):
    """|w - dequant| <= step / 2 elementwise, computed in fp32 with the stored scales. The slack is the fp32
    rounding of computing ``(w - offset) / step`` and ``code * step + offset`` (a few ulps of the magnitudes
    involved), not a quantization error: it is 1e-7 of the values, the step is ~1e-2 of them."""
    slack = 4 * EPS32 * (w.abs() + offset.abs() + step * 16)
    excess = (w - dequantized).abs() - step / 2
    assert bool((excess <= slack).all()), f"worst excess over scale/2: {excess.max().item():.3e}"


def test_int8_error_within_half_scale_and_no_code_clamped():
    w = weights()
    qweight, scale = quantize_int8(w)
    assert qweight.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (16,)
    assert int(qweight.min()) >= -127 and int(qweight.max()) <= 127  # -128 unused: symmetric, nothing clamped
    assert bool((qweight.abs().amax(dim=1)[w.abs().amax(dim=1) > 0] == 127).all())  # each row's absmax is +-127
    dequantized = dequantize_int8(qweight, scale)
    assert_within_half_step(w, dequantized, scale[:, None].expand_as(w), torch.zeros_like(w))
    assert torch.equal(dequantized[5], w[5]) and torch.equal(dequantized[6], w[6])  # constant rows exact


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_within_half_scale_and_no_code_clamped(group_size):
    w = weights(1)
    qweight, scale, zero = quantize_int4(w, group_size)
    groups = 256 // group_size
    assert qweight.shape == (16, 128) and qweight.dtype == torch.uint8
    assert scale.shape == zero.shape == (16, groups) and scale.dtype == zero.dtype == torch.float32
    codes = unpack_int4(qweight).reshape(16, groups, group_size)
    assert int(codes.max()) <= 15
    # the grid spans [min, max] exactly: every varying group's min maps to 0 and its max to 15, none beyond
    varying = w.reshape(16, groups, group_size).amax(-1) > w.reshape(16, groups, group_size).amin(-1)
    assert bool((codes.amin(-1)[varying] == 0).all()) and bool((codes.amax(-1)[varying] == 15).all())
    dequantized = dequantize_int4(qweight, scale, zero)
    expand = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731
    assert_within_half_step(w, dequantized, expand(scale), expand(zero))
    assert torch.equal(dequantized[5], w[5]) and torch.equal(dequantized[6], w[6])


def test_rounding_is_to_nearest_ties_to_even():
    # row absmax 127 -> scale 1: the codes are round(w) with ties to even (torch.round)
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 0.49, 126.51]])
    qweight, scale = quantize_int8(w)
    assert scale.item() == 1.0
    assert qweight.tolist() == [[127, 0, 2, 2, 0, -2, 0, 127]]


def test_int4_packed_layout_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[1 | 2 << 4, 15], [7 | 8 << 4, 3 | 12 << 4]]
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize(("mode", "group_size"), [("int8", None), ("int4", 32), ("int4", 64)])
def test_storage_ratio_vs_bf16_is_the_formula(mode, group_size):
    model = Llama(tiny_config())
    quantize_model(model, mode, group_size=group_size)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 5 * 2  # qkv, o, gate, up, down in each of the 2 layers; lm_head stays float
    stored = sum(t.numel() * t.element_size() for m in layers for t in (m.qweight, m.scale, m.zero) if t is not None)
    bf16 = sum(2 * m.in_features * m.out_features for m in layers)
    report = storage_report(model)
    assert report["quantized_bytes"] == stored and report["bf16_bytes"] == bf16
    for m in layers:  # per layer: int8 (in + 4) / (2 in); int4 1/4 + 4 / group_size
        ratio = m.storage_bytes() / (2 * m.in_features * m.out_features)
        expected = (m.in_features + 4) / (2 * m.in_features) if mode == "int8" else 1 / 4 + 4 / group_size
        assert ratio == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("mode", "group_size"), [("int8", None), ("int4", 32)])
def test_fused_qkv_quantizes_like_separate_q_k_v(mode, group_size):
    torch.manual_seed(0)
    config = tiny_config()
    model = Llama(config)
    fused = model.layers["0"].self_attn.qkv_proj.weight.detach().clone()
    parts = fused.split([4 * 16, 2 * 16, 2 * 16])  # 4 query heads, 2 kv heads of 16
    quantize_model(model, mode, group_size=group_size)
    layer = model.layers["0"].self_attn.qkv_proj
    if mode == "int8":
        separate = [quantize_int8(p) for p in parts]
    else:
        separate = [quantize_int4(p, group_size) for p in parts]
    for index, tensor in enumerate((layer.qweight, layer.scale)):
        assert torch.equal(tensor, torch.cat([s[index] for s in separate]))


def dequantized_copy(model: Llama, quantized: Llama) -> Llama:
    """A float Llama holding exactly the weights ``quantized`` stands for."""
    reference = Llama(model.config)
    reference.load_state_dict(model.state_dict())
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear):
            reference.get_submodule(name).weight.data.copy_(module.dequantize())
    return reference.eval()


@pytest.mark.parametrize(
    ("mode", "group_size", "tolerance"),
    # relative error of the logits: int8's step is max|w| / 127 per row (<1% of the largest weight), int4 g32's is
    # (max - min) / 15 per 32 weights (~13% of a group's range); errors of independent weights average out in
    # the dot products, measured ~0.7% and ~9% on this model: the bounds leave ~2x margin
    [("int8", None, 0.015), ("int4", 32, 0.2)],
)
def test_quantized_logits_close_to_fp32(mode, group_size, tolerance):
    torch.manual_seed(0)
    model = Llama(tiny_config()).eval()
    ids = torch.randint(0, 128, (2, 24))
    quantized = Llama(model.config)
    quantized.load_state_dict(model.state_dict())
    quantize_model(quantized, mode, group_size=group_size)
    with torch.no_grad():
        expected, got = model(ids).logits, quantized(ids).logits
        # the on-the-fly path computes exactly the float model with the dequantized weights (same ops, same data)
        torch.testing.assert_close(got, dequantized_copy(model, quantized)(ids).logits, rtol=0, atol=0)
    relative = ((got - expected).norm() / expected.norm()).item()
    assert relative <= tolerance, relative


@pytest.fixture(scope="module")
def trained_tiny():
    """A tiny Llama trained 120 steps on colo.apps.quant's own source (bytes below 128): a model whose perplexity
    (~14, against ~128 untrained) a quantization error can visibly hurt. ~8 s on one busy core."""
    import colo.apps.quant as package

    root = os.path.dirname(package.__file__)
    text = b"".join(open(os.path.join(root, f), "rb").read() for f in sorted(os.listdir(root)) if f.endswith(".py"))
    data = torch.tensor([b for b in text if b < 128], dtype=torch.long)
    held_out, train = data[:4096], data[4096:]
    torch.manual_seed(0)
    model = Llama(tiny_config(num_hidden_layers=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(120):
        starts = torch.randint(0, len(train) - 65, (8,), generator=generator)
        batch = torch.stack([train[s : s + 64] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), held_out[: 64 * 64].reshape(64, 64)


def perplexity(model: Llama, rows: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(model(rows, labels=rows).loss.item())


def test_perplexity_change_int8_and_int4_group32(trained_tiny):
    model, rows = trained_tiny
    base = perplexity(model, rows)
    assert base < 16  # trained: the byte-level perplexity of the untrained model is ~128
    changes = {}
    for mode, group_size, limit in (("int8", None, 0.01), ("int4", 32, 0.05)):
        quantized = Llama(model.config)
        quantized.load_state_dict(model.state_dict())
        quantize_model(quantized, mode, group_size=group_size)
        changes[mode] = perplexity(quantized.eval(), rows) / base - 1
        assert changes[mode] <= limit, (mode, base, changes)
    print(f"perplexity fp32 {base:.4f}, change int8 {changes['int8']:+.4%}, int4 g32 {changes['int4']:+.4%}")


def test_greedy_generation_of_the_quantized_model(trained_tiny):
    model, rows = trained_tiny
    quantized = Llama(model.config)
    quantized.load_state_dict(model.state_dict())
    quantize_model(quantized, "int4", group_size=32)
    prompts = [rows[0, :8].tolist(), rows[1, :5].tolist()]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    got = generate(quantized.eval(), prompts, params)  # KV cache in the model's compute dtype (fp32)
    expected = generate(dequantized_copy(model, quantized), prompts, params)
    assert torch.equal(got.response_ids, expected.response_ids)


def run_metadata(config) -> dict:
    return {"llama_config": dataclasses.asdict(config), "config": {}}


@pytest.mark.parametrize(("mode", "group_size"), [("int8", None), ("int4", 32)])
def test_save_load_round_trip_is_exact(tmp_path, mode, group_size):
    torch.manual_seed(0)
    config = tiny_config(tie_word_embeddings=True)
    model = Llama(config)
    quantize_model(model, mode, group_size=group_size)
    save_quantized(model, tmp_path / "q", run=run_metadata(config))
    index = read_index(tmp_path / "q")
    assert "layers.0.self_attn.k_proj.qweight" in index.tensors  # q, k, v apart, as trainer checkpoints store them
    assert "lm_head.weight" not in index.tensors  # tied: the embedding, once
    loaded, metadata = load_quantized(tmp_path / "q")
    assert metadata["quantization"]["mode"] == mode
    saved, restored = model.state_dict(), loaded.state_dict()
    assert sorted(saved) == sorted(restored)
    for name, tensor in saved.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def write_trainer_checkpoint(path, model: Llama) -> None:
    """A checkpoint laid out as the trainer's: unfused Hugging Face-style names without ``model.``, run metadata."""
    state = {
        name.removeprefix("model."): t for name, t in llama_state_dict_to_hf(model.state_dict(), model.config).items()
    }
    save_checkpoint(path, {n: t.contiguous() for n, t in state.items()}, metadata={"run": run_metadata(model.config)})


def test_colo_convert_quantize_int4_then_colo_generate(tmp_path):
    torch.manual_seed(0)
    model = Llama(tiny_config(vocab_size=320)).eval()  # the byte tokenizer's vocabulary, for `colo generate`
    write_trainer_checkpoint(tmp_path / "ckpt", model)
    args = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "int4"), "--quantize", "int4", "--group-size", "64"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    loaded, metadata = load_quantized(tmp_path / "int4")
    assert metadata["quantization"]["group_size"] == 64 and metadata["run"]["llama_config"]["hidden_size"] == 64
    direct = Llama(model.config)
    direct.load_state_dict(model.state_dict())
    quantize_model(direct, "int4", group_size=64)
    for name, tensor in direct.state_dict().items():  # the CLI's checkpoint holds what quantize_model computes
        assert torch.equal(loaded.state_dict()[name], tensor), name
    again = CliRunner().invoke(app, [*args[:3], "--quantize", "int4"])  # OUT exists: refused without --overwrite
    assert again.exit_code == 2 and "--overwrite" in again.output
    result = CliRunner().invoke(app, ["generate", str(tmp_path / "int4"), "--prompt", "def ", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    expected = complete(direct.eval(), load_tokenizer(None), "def ", max_new_tokens=6, temperature=0.0)
    assert result.output.rstrip("\n") == expected


def test_colo_convert_keep_float_for_layers_no_group_divides(tmp_path):
    torch.manual_seed(0)
    model = Llama(get_preset("tiny")).eval()  # down_proj has 176 = 16 * 11 inputs: no int4 group size divides it
    write_trainer_checkpoint(tmp_path / "ckpt", model)
    args = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "int4"), "--quantize", "int4"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "down_proj: group_size=32 does not divide in_features=176" in refused.output
    assert "--keep-float" in refused.output
    result = CliRunner().invoke(app, [*args, "--keep-float", "down_proj"])
    assert result.exit_code == 0, result.output
    loaded, metadata = load_quantized(tmp_path / "int4")
    assert "layers.1.mlp.down_proj.weight" in read_index(tmp_path / "int4").tensors
    assert isinstance(loaded.layers["1"].mlp.up_proj, QuantizedLinear)
    assert type(loaded.layers["1"].mlp.down_proj) is torch.nn.Linear
    assert torch.equal(loaded.layers["1"].mlp.down_proj.weight, model.layers["1"].mlp.down_proj.weight)


@pytest.mark.parametrize(("mode", "group_size", "tolerance"), [("int8", None, 0.015), ("int4", 32, 0.2)])
def test_hf_llama_quantized_logits_and_round_trip(tmp_path, mode, group_size, tolerance):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    names = quantize_model(model, mode, group_size=group_size)
    assert len(names) == 14 and "lm_head" not in names  # q, k, v, o, gate, up, down per layer
    with torch.no_grad():
        got = model(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() <= tolerance  # as for the native Llama
    save_quantized(model, tmp_path / "hf")
    loaded, _ = load_quantized(tmp_path / "hf")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, got)


def test_backends_compute_the_reference():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    x = torch.randn(3, 5, 128)
    int8 = QuantizedLinear.from_linear(linear, QuantConfig(mode="int8"))
    reference = int8(x)
    int8.backend = "aten"  # torch._weight_int8pack_mm: sums in another order
    torch.testing.assert_close(int8(x), reference, rtol=1e-5, atol=1e-5)
    int4 = QuantizedLinear.from_linear(linear, QuantConfig(mode="int4", group_size=32)).to(torch.bfloat16)
    assert int4.scale.dtype == torch.float32 and int4.dtype == torch.bfloat16  # casts keep the stored format
    xb = x.bfloat16()
    reference = int4(xb).float()
    int4.backend = "aten"  # torch's CPU int4 kernel keeps scales and zero points in bf16: ~3 bf16 ulps apart
    torch.testing.assert_close(int4(xb).float(), reference, rtol=0.03, atol=0.03)
    with pytest.raises(ValueError, match="bfloat16"):
        int4(x)


def test_torchao_int8_backend_matches_the_reference():
    pytest.importorskip("torchao.quantization", reason="torchao is colo-apps' `quant` extra")
    torch.manual_seed(0)
    model = Llama(tiny_config()).eval()
    quantize_model(model, "int8")
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        reference = model(ids).logits
        set_backend(model, "torchao")  # torchao's Int8Tensor over the same codes and scales: (x @ q^T) * scale
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)


def test_bad_input_gives_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="mode 'int3' is unknown"):
        QuantConfig(mode="int3")
    with pytest.raises(ValueError, match="choose one of"):
        QuantConfig(mode="int4", group_size=48)
    with pytest.raises(ValueError, match="int8 is per output channel"):
        QuantConfig(mode="int8", group_size=32)
    model = Llama(get_preset("tiny"))  # down_proj has 176 inputs: 16 * 11
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj: group_size=32 does not divide in_features=176"):
        quantize_model(model, "int4", group_size=32)
    assert {name: type(m) for name, m in model.named_modules()} == before  # nothing replaced
    with pytest.raises(ValueError, match="serves int8 only"):
        quantize_model(model, "int4", group_size=32, backend="torchao")
    with pytest.raises(ValueError, match="backend 'fast' is unknown"):
        quantize_model(model, "int8", backend="fast")
    weight = torch.ones(4, 64)
    weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_int8(weight)
    write_trainer_checkpoint(tmp_path / "ckpt", Llama(tiny_config()))
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "o"), "--quantize", "int2"])
    assert result.exit_code == 2 and "use mode='int8' or mode='int4'" in result.output
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "o"), "--group-size", "32"])
    assert result.exit_code == 2 and "--group-size and --keep-float are for --quantize" in result.output
    with pytest.raises(Exception, match="not a quantized colo checkpoint"):
        load_quantized(tmp_path / "ckpt")
