"""Hugging Face ``LlamaForCausalLM`` directories load into colo's native `Llama` and export back exactly.

Claims: HF -> native -> HF keeps every tensor bit for bit (names, dtypes, values; one file or shards), the export
loads in ``transformers`` unchanged, and native logits equal the ``transformers`` model's. Logit tolerance (fp32):
rtol 1e-5, atol 1e-5 — the two models compute the same math with different kernels (colo.kernels' RMSNorm, fused
q/k/v matmul, its attention) whose reduction orders differ; the observed difference is ~2e-7.
"""

from __future__ import annotations

import json

import pytest
import torch


def tiny_hf_llama(*, tie: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie, shard", [(False, None), (True, 20_000)], ids=["one-file", "tied-sharded"])
def test_hf_native_hf_round_trip_is_exact_and_loads_in_transformers(tmp_path, tie, shard):
    from transformers import LlamaForCausalLM

    from colo.apps.hf import load_llama_from_hf, read_hf_state_dict, save_llama_as_hf

    reference = tiny_hf_llama(tie=tie)
    reference.save_pretrained(tmp_path / "hf", max_shard_size=shard or "5GB")
    native = load_llama_from_hf(tmp_path / "hf")
    written = save_llama_as_hf(native, tmp_path / "out", max_shard_bytes=shard)
    assert ("model.safetensors.index.json" in written) == (shard is not None)

    original, exported = read_hf_state_dict(tmp_path / "hf"), read_hf_state_dict(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert reloaded.config.tie_word_embeddings == tie
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_native_logits_and_loss_match_transformers(tmp_path):
    from colo.apps.hf import load_llama_from_hf

    reference = tiny_hf_llama()
    reference.save_pretrained(tmp_path)
    native = load_llama_from_hf(tmp_path).eval()
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=ids)
        actual = native(ids, labels=ids, return_logits=True)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-6)


def test_bf16_round_trip_keeps_dtype(tmp_path):
    from colo.apps.hf import load_llama_from_hf, read_hf_state_dict, save_llama_as_hf

    tiny_hf_llama().to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    native = load_llama_from_hf(tmp_path / "hf")
    assert {p.dtype for p in native.parameters()} == {torch.bfloat16}
    save_llama_as_hf(native, tmp_path / "out")
    original, exported = read_hf_state_dict(tmp_path / "hf"), read_hf_state_dict(tmp_path / "out")
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


def test_missing_weights_and_unsupported_configs_are_named(tmp_path):
    from colo.apps.hf import load_llama_from_hf

    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_llama_from_hf(tmp_path)
    model = tiny_hf_llama()
    model.config.mlp_bias = True
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mlp_bias"):
        load_llama_from_hf(tmp_path)
