"""The native `Llama` computes what Hugging Face's ``LlamaForCausalLM`` computes, and builds like a model that is
parallelized from outside should.

- Against transformers (a tiny ``LlamaForCausalLM`` built from a config, no download; weights randomized so every
  parameter matters, norm scales included; copied over by `llama_state_dict_from_hf`): logits, loss and every
  gradient agree in fp32, with default positions, offset and per-sequence ``position_ids``, ignored labels, and
  tied embeddings. Tolerances: rtol=1e-5, atol=1e-5 on logits and loss, rtol=1e-4, atol=1e-6 on gradients. Not
  required to be bit-identical: the kernels' backward passes (the rotary transpose, the fused RMSNorm + residual,
  the cross-entropy gradient) are written out by hand rather than derived by autograd from transformers' ops, so
  they sum in other orders; gradients get a looser rtol because they accumulate many such terms. Observed on CPU:
  logits and loss equal to the bit, gradients within 6e-7 of each tensor's largest entry.
- Initialization is a function of (seed, module name): meta construction + ``to_empty`` + ``init_weights(seed)``
  equals eager construction + ``init_weights(seed)`` exactly, whatever the global generator did in between.
- On the Triton kernels (Triton's interpreter on CPU: the code CUDA runs) the model gives the loss, logits and
  gradients of the torch references, per-sequence positions included (the rotary kernel then sees the batch folded
  into one sequence). Same tolerances as against transformers, for the same reason: hand-written backward passes.
- The fused loss (no logits) equals the loss from logits; pipeline stages composed equal the whole model, and a
  stage materialized on its own equals the matching slice of the whole model.
"""

from __future__ import annotations

import os

import pytest
import torch

from colo.apps.models.llama import (
    Llama,
    causal_lm_loss,
    get_preset,
    llama_config_from_hf,
    llama_pipeline_stages,
    llama_state_dict_from_hf,
    llama_state_dict_to_hf,
)
from colo.kernels import use_backend

SEED = 1234
LOGITS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


def _hf_llama(tie_word_embeddings: bool):
    """A tiny transformers LlamaForCausalLM with the "tiny" shape and random weights (norm scales around 1)."""
    transformers = pytest.importorskip("transformers")
    shape = get_preset("tiny")
    hf_config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=500.0,  # a small base, so that positions up to 128 turn through many full rotations
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    hf_model = transformers.LlamaForCausalLM(hf_config).float()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    return hf_model


def _batch():
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (3, 24), generator=generator)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt without loss
    labels[2, 17:] = -100  # padding at the end
    return ids, labels


POSITIONS = {
    "default": None,
    "strided": torch.arange(24) * 2 + 50,  # (seq,): transformers takes it as (1, seq)
    "per-sequence": torch.stack([torch.arange(24) * stride + offset for stride, offset in ((1, 0), (3, 7), (2, 40))]),
}
"""Positions that are not a uniform shift of 0..seq-1 (RoPE is invariant to those), so each changes the logits."""


@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_transformers_logits_loss_and_gradients(tied, positions):
    hf_model = _hf_llama(tied)
    config = llama_config_from_hf(hf_model.config)
    assert config == get_preset("tiny", rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tied)
    model = Llama(config)
    model.load_state_dict(llama_state_dict_from_hf(hf_model.state_dict(), config), strict=True)
    ids, labels = _batch()
    position_ids = POSITIONS[positions]
    hf_position_ids = position_ids[None] if position_ids is not None and position_ids.dim() == 1 else position_ids
    # an explicit all-ones mask: without one, transformers reads position ids that do not step by 1 as packed
    # sequences and masks attention between them; so does colo's Llama, unless told that every row is one document
    mask = torch.ones_like(ids)
    expected = hf_model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=hf_position_ids)
    expected.loss.backward()
    one_document = torch.zeros_like(ids)
    got = model(ids, labels=labels, position_ids=position_ids, return_logits=True, document_ids=one_document)
    got.loss.backward()
    if position_ids is not None:  # without the mask, both read the positions as packed documents, the same way
        with torch.no_grad():
            packed = hf_model(input_ids=ids, position_ids=hf_position_ids, use_cache=False).logits
            torch.testing.assert_close(model(ids, position_ids=position_ids).logits, packed, **LOGITS_TOLERANCE)
            assert (packed - expected.logits).abs().max() > 1e-2
    torch.testing.assert_close(got.logits, expected.logits, **LOGITS_TOLERANCE)
    torch.testing.assert_close(got.loss, expected.loss, **LOGITS_TOLERANCE)
    if position_ids is not None:  # the positions mattered
        assert (got.logits - model(ids).logits).abs().max() > 1e-2
    expected_grads = llama_state_dict_from_hf({name: p.grad for name, p in hf_model.named_parameters()}, config)
    mismatches = []
    for name, param in model.named_parameters():
        try:
            torch.testing.assert_close(param.grad, expected_grads[name], **GRAD_TOLERANCE)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    assert not mismatches, "\n".join(mismatches)


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (the root conftest sets it on CPU)")
def test_triton_kernels_give_the_torch_reference_results():
    model = Llama(get_preset("tiny"))
    model.init_weights(SEED)
    ids, labels = _batch()
    position_ids = POSITIONS["per-sequence"]
    results = {}
    for backend in ("torch", "triton"):
        model.zero_grad()
        with use_backend(backend):
            out = model(ids, labels=labels, position_ids=position_ids)  # fused linear + cross-entropy
            out.loss.backward()
            logits = model(ids, position_ids=position_ids).logits
        results[backend] = (out.loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss, logits, grads), (expected_loss, expected_logits, expected_grads) = results["triton"], results["torch"]
    torch.testing.assert_close(loss, expected_loss, **LOGITS_TOLERANCE)
    torch.testing.assert_close(logits, expected_logits, **LOGITS_TOLERANCE)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **GRAD_TOLERANCE, msg=f"{name}")


def test_state_dict_mapping_round_trips():
    hf_model = _hf_llama(False)
    config = llama_config_from_hf(hf_model.config)
    hf_state = hf_model.state_dict()
    native = llama_state_dict_from_hf(hf_state, config)
    assert set(native) == set(Llama(config).state_dict())
    back = llama_state_dict_to_hf(native, config)
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name
    partial = {k: v for k, v in hf_state.items() if not k.endswith("layers.1.self_attn.v_proj.weight")}
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn has \['k', 'q'\] projections"):
        llama_state_dict_from_hf(partial, config)


def test_config_from_transformers_rejects_what_llama_does_not_implement():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        attention_bias=True, hidden_act="gelu",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"does not implement attention_bias, hidden_act != 'silu'"):
        llama_config_from_hf(hf_config)


def test_meta_construction_then_init_equals_eager_init():
    config = get_preset("tiny", tie_word_embeddings=True)
    torch.manual_seed(0)
    eager = Llama(config)
    eager.init_weights(SEED)
    torch.manual_seed(99)  # the global generator plays no part in init_weights(seed)
    with torch.device("meta"):
        lazy = Llama(config)
    lazy.to_empty(device="cpu")
    with pytest.raises(ValueError, match="on the meta device"):
        _on_meta(config).init_weights(SEED)
    lazy.init_weights(SEED)
    assert lazy.lm_head.weight is lazy.embed_tokens.weight  # to_empty unties; init_weights ties again
    for (name, got), (_, expected) in zip(lazy.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(got, expected), name
    torch.testing.assert_close(lazy.rotary_emb.cos, eager.rotary_emb.cos, rtol=0, atol=0)
    other = Llama(config)
    other.init_weights(SEED + 1)
    assert not torch.equal(other.layers["0"].mlp.up_proj.weight, eager.layers["0"].mlp.up_proj.weight)
    std = eager.layers["1"].self_attn.qkv_proj.weight.std().item()
    assert abs(std - config.initializer_range) < 0.1 * config.initializer_range


def _on_meta(config):
    with torch.device("meta"):
        return Llama(config)


def test_fused_loss_equals_loss_from_logits_and_handles_ignored_labels():
    model = Llama(get_preset("tiny"))
    model.init_weights(SEED)
    ids, labels = _batch()
    fused = model(ids, labels=labels)
    assert fused.logits is None
    unfused = model(ids, labels=labels, return_logits=True)
    # fused_linear_cross_entropy sums the same per-token losses in chunks: equal up to fp32 rounding
    torch.testing.assert_close(fused.loss, unfused.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(causal_lm_loss(unfused.logits, labels), unfused.loss, rtol=0, atol=0)
    assert model(ids).loss is None
    all_ignored = torch.full_like(labels, -100)
    assert model(ids, labels=all_ignored).loss.item() == 0.0
    with pytest.raises(ValueError, match="longer than max_position_embeddings=128"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels \(3, 23\) must be shaped like input_ids \(3, 24\)"):
        model(ids, labels=labels[:, 1:])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pipeline_stages_compose_to_the_model(tied):
    config = get_preset("tiny", num_hidden_layers=5, tie_word_embeddings=tied)
    model = Llama(config)
    model.init_weights(SEED)
    ids, labels = _batch()
    stages = llama_pipeline_stages(model, 3)
    assert [list(stage.layers) for stage in stages] == [["0", "1"], ["2", "3"], ["4"]]
    x = ids
    for stage in stages:
        x = stage(x)
    expected = model(ids, labels=labels, return_logits=True)
    torch.testing.assert_close(x, expected.logits, rtol=0, atol=0)  # the same modules and ops, in the same order
    torch.testing.assert_close(causal_lm_loss(x, labels), expected.loss, rtol=0, atol=0)
    by_parameters = llama_pipeline_stages(model, 2, balance="parameters")
    assert [list(stage.layers) for stage in by_parameters] == [["0", "1"], ["2", "3", "4"]]
    assert bool(stages[0].tied_parameters()) == bool(stages[-1].tied_parameters()) == tied
    assert stages[1].tied_parameters() == {}
    with pytest.raises(ValueError, match="balance='time' is unknown"):
        llama_pipeline_stages(model, 2, balance="time")
    with pytest.raises(ValueError, match="cannot split 5 blocks into num_stages=6"):
        llama_pipeline_stages(model, 6)


def test_a_stage_materialized_alone_equals_its_slice_of_the_model():
    config = get_preset("tiny", num_hidden_layers=4, tie_word_embeddings=True)
    full = Llama(config)
    full.init_weights(SEED)
    expected = full.state_dict()
    for index in range(2):
        with torch.device("meta"):
            model = Llama(config)
        stage = llama_pipeline_stages(model, 2)[index]
        stage.to_empty(device="cpu")
        stage.init_weights(SEED)
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    # the last stage's tied lm_head, drawn on its own, holds exactly the embedding of the first stage
    assert torch.equal(stage.lm_head.weight, full.embed_tokens.weight)
