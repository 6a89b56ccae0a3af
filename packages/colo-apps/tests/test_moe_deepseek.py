"""colo's MoE block with DeepSeek-V3's settings (shared experts, many small experts with top-8, sigmoid scores with the
aux-loss-free bias, group-limited routing, routed scaling) equals transformers 5's ``DeepseekV3MoE`` on the same
weights (its fused ``gate_up_proj`` (E, 2I, H) split into colo's ``w1`` / ``w3``, its ``e_score_correction_bias`` as
colo's ``expert_bias``): outputs, chosen experts, and the gradients of the input, the router, every expert tensor and
the shared experts, in fp32, for the grouped and the loop expert implementations.

Tolerances rtol 1e-5 / atol 1e-6 (fp32): transformers loops over experts and accumulates with ``index_add_`` in
expert order; colo groups the rows by expert and combines per token, so sums are taken in another order.
"""

from __future__ import annotations

import pytest
import torch

from colo.tensor.moe import MoEBlock, MoEConfig

pytest.importorskip("transformers")

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, GROUPS, TOP_GROUPS, SHARED = 16, 8, 16, 8, 4, 3, 2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _hf_block():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
        n_group=GROUPS, topk_group=TOP_GROUPS, n_shared_experts=SHARED, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    block = DeepseekV3MoE(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block.gate.e_score_correction_bias.normal_(std=0.1)  # the aux-loss-free bias steers the choice
    return block


def _colo_block(hf, impl: str) -> MoEBlock:
    config = MoEConfig(
        num_experts=EXPERTS, top_k=TOP_K, score_func="sigmoid", expert_bias=True, num_shared_experts=SHARED,
        num_groups=GROUPS, top_k_groups=TOP_GROUPS, routed_scaling_factor=2.5, expert_impl=impl,
    )  # fmt: skip
    block = MoEBlock(HIDDEN, INTERMEDIATE, config)
    block.load_state_dict(_colo_names(dict(hf.state_dict())), strict=False)
    block.gate.expert_bias.copy_(hf.gate.e_score_correction_bias)
    assert block.shared_experts.gate_proj.weight.shape == (SHARED * INTERMEDIATE, HIDDEN)
    return block


def _colo_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory DeepseekV3MoE names and tensors (parameters or gradients) as colo's."""
    gate_up = tensors.pop("experts.gate_up_proj")
    tensors["experts.w1"], tensors["experts.w3"] = gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:]
    tensors["experts.w2"] = tensors.pop("experts.down_proj")
    tensors.pop("gate.e_score_correction_bias", None)
    return tensors


def _run(block, x, g):
    x = x.clone().requires_grad_(True)
    y = block(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_deepseek_style_block_equals_transformers_deepseek_v3_moe(impl):
    hf = _hf_block()
    block = _colo_block(hf, impl)
    generator = torch.Generator().manual_seed(1)
    x, g = torch.randn(3, 7, HIDDEN, generator=generator), torch.randn(3, 7, HIDDEN, generator=generator)
    hf_y, hf_x_grad = _run(hf, x, g)
    y, x_grad = _run(block, x, g)
    _, _, hf_index = hf.gate(x)
    chosen = block.last_routing.top_k_index
    assert torch.equal(chosen.sort(dim=-1).values, hf_index.sort(dim=-1).values)  # the same 8 experts per token
    groups_used = torch.zeros(chosen.shape[0], GROUPS, dtype=torch.bool).scatter_(
        1, chosen // (EXPERTS // GROUPS), True
    )
    assert groups_used.sum(dim=-1).max() <= TOP_GROUPS < GROUPS  # the limit binds: some tokens would use 4 groups
    torch.testing.assert_close(y, hf_y, **TOLERANCE)
    torch.testing.assert_close(x_grad, hf_x_grad, **TOLERANCE)
    hf_grads = _colo_names({name: p.grad for name, p in hf.named_parameters()})
    grads = {name: p.grad for name, p in block.named_parameters()}
    assert set(grads) == set(hf_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_grads[name], **TOLERANCE, msg=name)


DEEPSEEK_LLAMA = {
    "num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
    "n_shared_experts": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "score_func": "sigmoid",
    "expert_bias": True, "first_k_dense_replace": 1,
}  # fmt: skip


def test_a_deepseek_style_moe_llama_has_dense_first_layers_and_counts_its_parameters():
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    config = get_moe_preset("tiny-moe", **DEEPSEEK_LLAMA)
    model = MoELlama(config)
    assert not isinstance(model.layers["0"].mlp, MoEBlock)  # first_k_dense_replace=1
    for index in ("1", "2"):
        block = model.layers[index].mlp
        assert isinstance(block, MoEBlock)
        assert block.experts.w1.shape == (8, 24, config.hidden_size)
        assert block.shared_experts.up_proj.weight.shape == (2 * 24, config.hidden_size)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    # a token uses 4 of 8 routed experts per MoE layer, the shared experts and everything else
    idle = 2 * (8 - 4) * 3 * config.hidden_size * 24
    assert config.num_active_parameters() == config.num_parameters() - idle
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids, labels=ids).loss)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_group": 3}, "MoELlamaConfig: n_group=3 does not divide num_local_experts=8"),
        ({"topk_group": 5}, "MoELlamaConfig: topk_group=5 must be an integer in 1..n_group=4"),
        ({"topk_group": 1}, "num_experts_per_tok=4 is more than the 2 experts in the topk_group=1 groups"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace=3 must be an integer in 0..num_hidden_layers - 1 = 2"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0 must be a positive integer"),
        ({"n_shared_experts": -1}, "MoELlamaConfig: n_shared_experts=-1 must be an integer >= 0"),
    ],
)
def test_bad_deepseek_settings_name_the_moe_llama_field(change, message):
    from colo.apps.models.moe_llama import get_moe_preset

    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        get_moe_preset("tiny-moe", **{**DEEPSEEK_LLAMA, **change})


def test_a_deepseek_style_moe_llama_has_no_mixtral_export_and_says_why(tmp_path):
    from colo.apps.hf.mixtral_io import save_moe_llama_as_hf
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    model = MoELlama(get_moe_preset("tiny-moe", n_shared_experts=1))
    with pytest.raises(ValueError, match="n_shared_experts=1: .* multi-head latent attention"):
        save_moe_llama_as_hf(model, tmp_path)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_counts_each_assignment_once(mode):
    """The recomputation in backward routes again; the routers count one forward's assignments (the aux-loss-free
    bias update reads them) and the gradients are those of the model without checkpointing."""
    from colo.apps.checkpointing import apply_activation_checkpointing
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset
    from colo.tensor.moe import moe_blocks

    config = get_moe_preset("tiny-moe", **DEEPSEEK_LLAMA)
    plain, checkpointed = MoELlama(config), MoELlama(config)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, mode=mode)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (plain, checkpointed):
        model.train()
        model(ids, labels=ids).loss.backward()
        for _, block in moe_blocks(model):
            assert block.gate.tokens_per_expert.sum() == 2 * 12 * 4
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


MLA = {"kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}


WIDE_MLA = {"kv_lora_rank": 12, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
"""DeepSeek-V3's head sizes (192 for queries and keys): wider than colo's attention kernel takes, so SDPA."""


@pytest.mark.parametrize(
    ("q_lora_rank", "rope_interleave", "dims"), [(16, True, MLA), (None, False, MLA), (16, True, WIDE_MLA)]
)
def test_multi_head_latent_attention_equals_transformers_deepseek_v3_attention(q_lora_rank, rope_interleave, dims):
    """colo's MLA (`MultiHeadLatentAttention`, on colo.kernels' rotary and attention) equals transformers'
    ``DeepseekV3Attention`` (eager, causal mask) on the same weights: the output and the gradients of the input and
    of every weight, fp32. rtol 1e-5 / atol 1e-6 for the output and the input's gradient (the same products, the
    attention summed by another kernel); the weights' gradients, sums over the 18 tokens of terms up to ~1, atol 1e-5
    (one element of kv_a_proj_with_mqa's differs by 1.3e-6 from the RMSNorm backward's order)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from colo.apps.models.llama.layers import RotaryEmbedding
    from colo.apps.models.moe_llama.mla import MultiHeadLatentAttention

    hidden, heads, seq = 32, 4, 9
    config = DeepseekV3Config(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=q_lora_rank,
        rope_interleave=rope_interleave, max_position_embeddings=64, **dims,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = DeepseekV3Attention(config, layer_idx=0)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    colo = MultiHeadLatentAttention(hidden, heads, q_lora_rank=q_lora_rank, rope_interleave=rope_interleave, **dims)
    colo.load_state_dict(hf.state_dict())
    generator = torch.Generator().manual_seed(2)
    x, g = torch.randn(2, seq, hidden, generator=generator), torch.randn(2, seq, hidden, generator=generator)
    positions = torch.arange(seq)[None]
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    cos, sin = RotaryEmbedding(dims["qk_rope_head_dim"], 64, config.rope_parameters["rope_theta"])(seq)
    x_hf, x_colo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf = hf(x_hf, (hf_cos, hf_sin), mask)[0]
    y = colo(x_colo, cos, sin)
    (y_hf * g).sum().backward()
    (y * g).sum().backward()
    torch.testing.assert_close(y, y_hf, **TOLERANCE)
    torch.testing.assert_close(x_colo.grad, x_hf.grad, **TOLERANCE)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    for name, p in colo.named_parameters():
        torch.testing.assert_close(
            p.grad, hf_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


DEEPSEEK_V3 = {**DEEPSEEK_LLAMA, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, **{
    name: MLA[name] for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}}  # fmt: skip


def test_a_deepseek_v3_shaped_moe_llama_exports_as_a_deepseek_v3_that_transformers_loads_with_the_same_logits(tmp_path):
    """MoELlama with multi-head latent attention, a dense first layer, shared experts and group-limited sigmoid routing
    with a (non-zero) expert bias, written with one tensor per expert (``mlp.experts.{e}.gate_proj.weight``), loads
    in transformers' ``DeepseekV3ForCausalLM`` with the same logits (fp32; rtol / atol 1e-5: the attention and the
    experts sum in another order)."""
    from safetensors import safe_open
    from transformers import DeepseekV3ForCausalLM

    from colo.apps.hf.deepseek_io import save_moe_llama_as_deepseek_v3
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset
    from colo.apps.models.moe_llama.mla import MultiHeadLatentAttention
    from colo.tensor.moe import moe_blocks

    config = get_moe_preset("tiny-moe", **DEEPSEEK_V3)
    model = MoELlama(config).eval()
    model.init_weights(seed=3)
    assert isinstance(model.layers["0"].self_attn, MultiHeadLatentAttention)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    from colo.apps.models.llama.flops import flops_per_token, matmul_parameters

    params = model.named_parameters(remove_duplicate=False)
    assert matmul_parameters(config) == sum(p.numel() for n, p in params if p.dim() > 1 and "embed_tokens" not in n)
    qk, v, heads = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"], MLA["v_head_dim"], config.num_attention_heads
    assert flops_per_token(config, 32) - 6 * matmul_parameters(config) == 6 * 3 * 32 * heads * (qk + v)
    with torch.no_grad():
        for _, block in moe_blocks(model):
            block.gate.expert_bias.normal_(std=0.02, generator=torch.Generator().manual_seed(4))
    save_moe_llama_as_deepseek_v3(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as file:
        names = set(file.keys())
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in names and "model.layers.1.mlp.experts.w1" not in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.n_routed_experts == 8 and hf.config.first_k_dense_replace == 1
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def _train_ep2_and_save(path: str) -> None:
    from colo.apps.booster import Booster, ExpertParallel
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    model = MoELlama(get_moe_preset("tiny-moe", **DEEPSEEK_V3))
    booster = Booster(ExpertParallel(ep=2, stage=2))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        booster.train_step({"input_ids": x, "labels": x})
    booster.save(path)


def test_an_ep2_deepseek_v3_shaped_run_converts_to_a_deepseek_v3_with_the_same_logits(tmp_path):
    """An ep2 ZeRO-2 checkpoint of the MLA model (experts saved as slices of (E, ...) tensors by two ranks, the expert
    biases in its metadata) loads into one process with its biases and becomes a DeepseekV3 directory whose logits in
    transformers equal colo's."""
    from transformers import DeepseekV3ForCausalLM

    from colo.apps.hf.deepseek_io import save_moe_llama_as_deepseek_v3
    from colo.apps.hf.mixtral_io import load_moe_llama_checkpoint
    from colo.apps.models.moe_llama import get_moe_preset
    from colo.comm.testing import run_distributed
    from colo.tensor.moe import moe_blocks

    run_distributed(_train_ep2_and_save, str(tmp_path / "ckpt"), world_size=2)
    model = load_moe_llama_checkpoint(tmp_path / "ckpt", get_moe_preset("tiny-moe", **DEEPSEEK_V3))
    assert all(block.gate.expert_bias.abs().sum() > 0 for _, block in moe_blocks(model))  # restored, not zeros
    save_moe_llama_as_deepseek_v3(model, tmp_path / "hf")
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_planner_takes_the_deepseek_block_and_names_what_it_does_not_model():
    """`colo plan` models the DeepSeek-style block (measured against the model in test_plan_moe_layouts.py), under ep
    x Ulysses sp too with Llama's attention; multi-head latent attention under sp, which the planner does not model,
    is refused naming the field."""
    from colo.apps.models.moe_llama import get_moe_preset
    from colo.apps.plan.layout import Layout
    from colo.apps.plan.memory import check_layout

    config = get_moe_preset("tiny-deepseek")
    check_layout(config, Layout(plugin="expert", ep=2))
    ulysses = Layout(plugin="hybrid", ep=2, sp=2, sp_mode="ulysses")
    latent = dict(kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None)
    check_layout(get_moe_preset("tiny-deepseek", num_key_value_heads=2, **latent), ulysses)
    with pytest.raises(ValueError, match=r"Layout.sp=2: colo plan does not model multi-head latent attention"):
        check_layout(config, ulysses)


@pytest.mark.parametrize("dims", [MLA, WIDE_MLA], ids=["kernel", "wide"])
def test_latent_attention_decodes_with_a_kv_cache_as_the_full_forward(dims):
    """Prefill 6 tokens, then 4 one at a time through a static KVCache: each step's logits equal the full forward's
    at that position (the cache holds the expanded, padded keys and values)."""
    from colo.apps.models.llama import KVCache
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    config = get_moe_preset("tiny-moe", **{**DEEPSEEK_V3, **{k: v for k, v in dims.items() if k != "kv_lora_rank"}})
    model = MoELlama(config).eval()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(7))
    cache = KVCache.for_model(model, batch_size=2, max_len=16)
    with torch.no_grad():
        full = model(ids).logits
        steps = [model(ids[:, :6], kv_cache=cache).logits]
        steps += [model(ids[:, i : i + 1], kv_cache=cache).logits for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dims", [MLA, WIDE_MLA], ids=["kernel", "wide"])
def test_latent_attention_keeps_packed_documents_apart(dims):
    """Two documents packed in one row (positions restart) give the logits each gives alone: the attention does not
    cross the boundary, on colo's kernel (padded heads) and on the wide path (torch reference with the mask)."""
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    config = get_moe_preset("tiny-moe", **{**DEEPSEEK_V3, **{k: v for k, v in dims.items() if k != "kv_lora_rank"}})
    model = MoELlama(config).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        packed = model(ids, position_ids=torch.arange(6).repeat(2)[None]).logits
        apart = torch.cat([model(ids[:, :6]).logits, model(ids[:, 6:]).logits], dim=1)
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)


def test_a_deepseek_v3_with_colo_blocks_computes_what_it_computed():
    """transformers' ``DeepseekV3ForCausalLM`` with its MoE blocks replaced by colo's (same weights and bias): the same
    logits and the same gradients of every parameter (fp32; the experts sum in another order)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from colo.apps.hf.deepseek_io import use_colo_deepseek_blocks

    config = DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=16, **MLA,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            for p in layer.mlp.parameters():
                p.normal_(std=0.3)
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.05)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    expected = hf(ids, labels=ids)
    expected.loss.backward()
    expected_grads = {name: p.grad.clone() for name, p in hf.named_parameters()}
    hf.zero_grad()
    use_colo_deepseek_blocks(hf)
    assert type(hf.model.layers[1].mlp).__name__ == "MoEBlock"
    got = hf(ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits, **TOLERANCE)
    grads = {name: p.grad for name, p in hf.named_parameters()}
    for layer in (1, 2):
        mlp = f"model.layers.{layer}.mlp"
        tensors = {name.removeprefix(mlp + "."): expected_grads.pop(name) for name in list(expected_grads)
                   if name.startswith(mlp + ".")}  # fmt: skip
        expected_grads.update({f"{mlp}.{name}": grad for name, grad in _colo_names(tensors).items()})
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
