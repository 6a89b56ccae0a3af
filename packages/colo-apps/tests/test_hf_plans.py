"""``transformers`` models trained through colo's plugins match the single-process ``transformers`` model over 5
AdamW steps: the loss of every step and every parameter at the end (gathered over ZeRO shards; tensor-parallel
shards against the matching slice of the reference). Models: a tiny ``LlamaForCausalLM`` (4 heads, 2 kv heads)
under dp2 ZeRO-2 (`Zero`), dp2 x tp2 ZeRO-1 and pp2 x tp2 (`HybridParallel`); a tiny tied ``GPT2LMHeadModel``
under dp2 (`DDP`) and tp2 (`HybridParallel`, its ``Conv1D`` modules converted to ``nn.Linear``).

Tolerances (fp32): losses rtol 1e-5; parameters rtol 1e-5, atol 1e-4. Not bit-identical: tensor-parallel matmuls
sum partial results over ranks, the pipeline's loss (colo.kernels' cross-entropy) and the microbatch and
data-rank means are reduced in another order than Hugging Face's single loss; AdamW moves each weight by about
lr * g / (|g| + eps), which amplifies the rounding of near-zero gradient entries to ~1e-5 (a sharding mistake
moves weights by ~lr = 1e-2). GPT-2's key bias (``c_attn``'s k rows of the bias) gets a zero gradient in exact
arithmetic (it adds the same ``q . b_k`` to every score of a query, which the softmax cancels), so its gradient is
rounding noise that AdamW turns into steps of about +-lr: it is only checked to have moved by at most the
2 * STEPS * lr two such runs can differ by.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, ROWS, SEQ, LR, VOCAB = 5, 8, 16, 1e-2, 128


def make_model(kind: str):
    """The same tiny model on every rank (seeded)."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(700 + step))
    return {"input_ids": tokens, "labels": tokens.clone()}


def reference_run(kind: str):
    model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**global_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def full_of(reference: dict[str, torch.Tensor], name: str, width: int, converted: bool) -> torch.Tensor:
    """The unsharded reference tensor a trained parameter is (a piece of): under `HFGPT2Plan` (``converted``)
    GPT-2's ``Conv1D`` weights became ``nn.Linear`` weights (transposed), ``c_attn``'s q, k and v its row blocks."""
    module, _, leaf = name.rpartition(".")
    if leaf[:2] in ("q_", "k_", "v_"):  # c_attn.{q,k,v}_{weight,bias} of the tensor-parallel GPT-2
        full = reference[f"{module}.{leaf[2:]}"]
        full = full.t() if full.dim() == 2 else full
        return full.split(width, dim=0)["qkv".index(leaf[0])]
    value = reference[name]
    if converted and any(part in name for part in (".c_attn.", ".c_proj.", ".c_fc.")) and leaf == "weight":
        return value.t()
    return value


def _train(kind: str, plugin_name: str, settings: dict):
    from colo.apps import DDP, Booster, HybridParallel, Zero
    from colo.tensor import layout_of

    expected_losses, expected = reference_run(kind)
    plugin = {"ddp": DDP, "zero": Zero, "hybrid": HybridParallel}[plugin_name](**settings)
    model = make_model(kind)
    booster = Booster(plugin)
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    mesh = booster.engine.mesh
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    rows = ROWS // dp
    losses = []
    for step in range(STEPS):
        batch = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in global_batch(step).items()}
        losses.append(booster.train_step(batch).loss)
    if plugin_name == "ddp":
        params = {n.removeprefix("module."): p.detach() for n, p in booster.engine.model.named_parameters()}
        named = {}
    else:
        params = booster.engine.optimizer.full_params()
        named = dict(booster.engine.model.named_parameters())
    mismatches = []
    for name, value in params.items():
        reference = full_of(expected, name, model.config.hidden_size, converted=plugin_name == "hybrid")
        layout = layout_of(named[name]) if name in named else None
        if layout is not None:  # a tensor-parallel shard: compare with the matching slice
            reference = layout.local_slice(reference)
        key_bias = name.endswith("c_attn.k_bias") or (kind == "gpt2" and name.endswith("c_attn.bias"))
        if key_bias and name.endswith("c_attn.bias"):  # unsharded: only its k rows are noise-driven
            width = model.config.hidden_size
            value, reference = value[width : 2 * width], reference[width : 2 * width]
        try:
            atol = 2 * STEPS * LR if key_bias else 1e-4
            torch.testing.assert_close(value, reference, rtol=1e-5, atol=atol)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    return losses, expected_losses, len(params), mismatches


@pytest.mark.parametrize(
    "kind, plugin_name, settings, world_size",
    [
        ("llama", "zero", {"stage": 2}, 2),
        ("llama", "hybrid", {"tp": 2, "zero_stage": 1}, 4),
        ("llama", "hybrid", {"tp": 2, "pp": 2, "num_microbatches": 4, "zero_stage": 0}, 4),
        ("gpt2", "ddp", {}, 2),
        ("gpt2", "hybrid", {"tp": 2, "zero_stage": 0}, 2),
    ],
    ids=["llama-dp2-zero2", "llama-dp2-tp2-zero1", "llama-pp2-tp2", "gpt2-dp2-ddp", "gpt2-tp2"],
)
def test_transformers_model_matches_the_single_process_model(kind, plugin_name, settings, world_size):
    for losses, expected_losses, num_params, mismatches in run_distributed(
        _train, kind, plugin_name, settings, world_size=world_size
    ):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert num_params > 0 and not mismatches, mismatches


def test_the_plans_are_registered_without_importing_transformers():
    import subprocess
    import sys

    from colo.apps.booster import plan_for
    from colo.apps.hf import HFGPT2Plan, HFLlamaPlan

    code = "import sys, colo.apps; assert 'transformers' not in sys.modules, 'colo.apps imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert isinstance(plan_for(make_model("llama")), HFLlamaPlan)
    assert isinstance(plan_for(make_model("gpt2")), HFGPT2Plan)


def test_a_module_the_plan_does_not_know_is_named():
    from torch import nn

    from colo.apps import HybridParallel
    from colo.apps.booster import plan_for

    llama = make_model("llama")
    llama.model.layers[1].self_attn.q_norm = nn.LayerNorm(16)  # e.g. a Qwen3-style query norm
    with pytest.raises(ValueError, match=r"module 'model\.layers\.1\.self_attn\.q_norm' \(LayerNorm\) is not part"):
        plan_for(llama).check(llama, HybridParallel(tp=2))

    class OtherAttention(nn.Module):
        pass

    llama = make_model("llama")
    llama.model.layers[0].self_attn = OtherAttention()
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn' is a OtherAttention, but .* LlamaAttention"):
        plan_for(llama).check(llama, HybridParallel(tp=2))

    gpt2 = make_model("gpt2")
    gpt2.config.add_cross_attention = True
    import transformers

    gpt2.transformer.h[0].crossattention = transformers.models.gpt2.modeling_gpt2.GPT2Attention(
        gpt2.config, is_cross_attention=True, layer_idx=0
    )
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.crossattention\.c_attn' \(Conv1D\)"):
        plan_for(gpt2).check(gpt2, HybridParallel(tp=2))

    llama = make_model("llama")
    with pytest.raises(ValueError, match=r"tp=3 does not divide config\.num_attention_heads=4"):
        plan_for(llama).check(llama, HybridParallel(tp=3))
    with pytest.raises(ValueError, match="sp_mode='megatron' is not supported for Hugging Face models"):
        plan_for(gpt2).check(make_model("gpt2"), HybridParallel(tp=2, sp_mode="megatron"))
