"""colo's MoE block equals transformers 5's ``MixtralSparseMoeBlock`` with the same weights (its fused
``gate_up_proj`` (E, 2I, H) split into colo's ``w1`` / ``w3``): outputs, router logits (its ``gate``), and the
gradients of the input, the router and every expert tensor, in fp32, in one process and at ep2; the load-balancing
loss equals transformers' ``load_balancing_loss_func`` for one layer.

Tolerances rtol 1e-5 / atol 1e-6 (fp32): transformers loops over experts and accumulates with ``index_add_`` in
expert order; colo groups the rows by expert and combines per token, so sums are taken in another order. At ep2
transformers runs in the pytest process and the ranks get its weights and results (no transformers import there).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor.moe import MoEBlock, MoEConfig, load_balancing_loss, shard_experts

transformers = pytest.importorskip("transformers")

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 16, 24, 4, 2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _hf_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def _weights(hf) -> dict[str, torch.Tensor]:
    gate_up = hf.experts.gate_up_proj.detach()
    return {
        "gate.weight": hf.gate.weight.detach().clone(),
        "experts.w1": gate_up[:, :INTERMEDIATE].clone(),
        "experts.w3": gate_up[:, INTERMEDIATE:].clone(),
        "experts.w2": hf.experts.down_proj.detach().clone(),
    }


def _colo_block(weights, impl="grouped") -> MoEBlock:
    block = MoEBlock(HIDDEN, INTERMEDIATE, MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_impl=impl))
    block.load_state_dict({**block.state_dict(), **weights})
    return block


def _inputs(rank: int):
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3, 5, HIDDEN, generator=generator), torch.randn(3, 5, HIDDEN, generator=generator)


def _run(block, x, g):
    x = x.clone().requires_grad_(True)
    y = block(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def _hf_results(hf, x, g):
    hf.zero_grad()
    y, x_grad = _run(hf, x, g)
    logits = hf.gate(x.reshape(-1, HIDDEN))[0].detach()
    grad_up = hf.experts.gate_up_proj.grad
    grads = {
        "gate.weight": hf.gate.weight.grad.clone(),
        "experts.w1": grad_up[:, :INTERMEDIATE].clone(),
        "experts.w3": grad_up[:, INTERMEDIATE:].clone(),
        "experts.w2": hf.experts.down_proj.grad.clone(),
    }
    return y, x_grad, logits, grads


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_block_equals_mixtral_sparse_moe_block(impl):
    hf = _hf_block()
    block = _colo_block(_weights(hf), impl)
    x, g = _inputs(0)
    hf_y, hf_x_grad, hf_logits, hf_grads = _hf_results(hf, x, g)
    y, x_grad = _run(block, x, g)
    torch.testing.assert_close(y, hf_y, **TOLERANCE)
    torch.testing.assert_close(block.last_routing.logits, hf_logits, rtol=0, atol=0)  # the same matmul, fp32
    torch.testing.assert_close(x_grad, hf_x_grad, **TOLERANCE)
    for name, param in block.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name], **TOLERANCE, msg=name)


def test_load_balancing_loss_equals_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = _hf_block()
    block = _colo_block(_weights(hf))
    block(_inputs(0)[0])
    routing = block.last_routing
    expected = load_balancing_loss_func((routing.logits,), EXPERTS, TOP_K)
    got = load_balancing_loss(routing.scores, routing.top_k_index, num_experts=EXPERTS)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def _ep2(weights):
    mesh = Mesh(ep=2)
    block = _colo_block(weights)
    holder = torch.nn.Module()
    holder.moe = block
    shard_experts(holder, mesh=mesh)
    y, x_grad = _run(block, *_inputs(mesh.rank("ep")))
    return y, x_grad, block.last_routing.logits, {n: p.grad for n, p in block.named_parameters()}


def test_ep2_block_equals_mixtral_sparse_moe_block():
    hf = _hf_block()
    weights = _weights(hf)
    for rank, (y, x_grad, logits, grads) in enumerate(run_distributed(_ep2, weights, world_size=2)):
        hf_y, hf_x_grad, hf_logits, hf_grads = _hf_results(hf, *_inputs(rank))
        torch.testing.assert_close(y, hf_y, **TOLERANCE)
        torch.testing.assert_close(logits, hf_logits, rtol=0, atol=0)
        torch.testing.assert_close(x_grad, hf_x_grad, **TOLERANCE)
        torch.testing.assert_close(grads["gate.weight"], hf_grads["gate.weight"], **TOLERANCE)  # this rank's term
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            # this rank's experts saw both ranks' tokens; scaled by 1/ep: the mean over the two ranks' losses
            other = _hf_results(hf, *_inputs(1 - rank))[3][name]
            expected = (hf_grads[name] + other) / 2
            torch.testing.assert_close(grads[name], expected[2 * rank : 2 * rank + 2], **TOLERANCE, msg=name)


def test_moe_llama_exports_as_a_mixtral_that_transformers_loads_with_the_same_logits(tmp_path):
    from transformers import MixtralForCausalLM

    from colo.apps.hf.mixtral_io import save_moe_llama_as_hf
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    model = MoELlama(get_moe_preset("tiny-moe", num_hidden_layers=2)).eval()
    model.init_weights(seed=3)
    files = save_moe_llama_as_hf(model, tmp_path)
    assert files == ["config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as file:  # one tensor per expert, Mixtral's names
        experts = {name for name in file.keys() if ".block_sparse_moe.experts." in name}
    assert experts == {
        f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
        for layer in range(2)
        for e in range(4)
        for w in ("w1", "w2", "w3")
    }
    hf = MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == 2
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got = model(ids).logits
    # fp32, the same weights: attention and the experts sum in another order than transformers' loops
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_interleaved_moe_llama_has_no_mixtral_export(tmp_path):
    from colo.apps.hf.mixtral_io import save_moe_llama_as_hf
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    model = MoELlama(get_moe_preset("tiny-moe", moe_layer_interval=2))
    with pytest.raises(ValueError, match="moe_layer_interval=2"):
        save_moe_llama_as_hf(model, tmp_path)


def test_a_mixtral_with_colo_blocks_computes_what_it_computed():
    """transformers' ``MixtralForCausalLM`` with its sparse blocks replaced by colo's (same weights): the same logits
    and the same gradients of every remaining parameter and of the experts (fp32, summation order differs)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from colo.apps.hf.mixtral_io import use_colo_moe_blocks

    config = MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = MixtralForCausalLM(config)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    expected = hf(ids, labels=ids)
    expected.loss.backward()
    expected_grads = {name: p.grad.clone() for name, p in hf.named_parameters()}
    hf.zero_grad()
    use_colo_moe_blocks(hf)
    assert type(hf.model.layers[0].mlp).__name__ == "MoEBlock"
    got = hf(ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits, **TOLERANCE)
    grads = {name: p.grad for name, p in hf.named_parameters()}
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        gate_up = expected_grads.pop(f"{mlp}.experts.gate_up_proj")
        expected_grads[f"{mlp}.experts.w1"] = gate_up[:, :48]
        expected_grads[f"{mlp}.experts.w3"] = gate_up[:, 48:]
        expected_grads[f"{mlp}.experts.w2"] = expected_grads.pop(f"{mlp}.experts.down_proj")
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **TOLERANCE, msg=name)


def _train_ep2_and_save(path: str, config_overrides: dict) -> None:
    from colo.apps.booster import Booster, ExpertParallel
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    model = MoELlama(get_moe_preset("tiny-moe", **config_overrides))
    booster = Booster(ExpertParallel(ep=2, stage=2))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        booster.train_step({"input_ids": x, "labels": x})
    booster.save(path)


def test_an_ep2_run_converts_to_a_mixtral_with_the_same_logits(tmp_path):
    """An ep2 ZeRO-2 checkpoint (experts saved as slices of (E, ...) tensors by two ranks) becomes a Hugging Face
    Mixtral directory; transformers' model computes the logits of the checkpoint's weights in colo's model."""
    from transformers import MixtralForCausalLM

    from colo.apps.hf.mixtral_io import export_moe_llama_checkpoint_as_hf, load_moe_llama_checkpoint
    from colo.apps.models.moe_llama import get_moe_preset

    overrides = {"router_aux_loss_coef": 0.02}
    run_distributed(_train_ep2_and_save, str(tmp_path / "ckpt"), overrides, world_size=2)
    config = get_moe_preset("tiny-moe", **overrides)
    export_moe_llama_checkpoint_as_hf(tmp_path / "ckpt", tmp_path / "hf", config)
    colo_model = load_moe_llama_checkpoint(tmp_path / "ckpt", config)
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(colo_model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
