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
