"""The tiny MoE Llama with experts split over ``ep`` and ZeRO-1 / ZeRO-2 (`colo.zero.ExpertParallelZero`) matches the
single process over 5 AdamW steps with clipping, at ep2 (2 ranks) and ep2 x dp2 (4 ranks); the first step's
all-to-all bytes equal the formula for the token counts each MoE block routed. The DeepSeek-style model (a dense
first layer, then two MoE layers with a shared expert, sigmoid routing limited to one of two expert groups, which at
ep2 are the two ranks' experts, routed scaling, and the aux-loss-free bias updated after every step from the counts
of every data rank) matches it too at ep2, biases included. (Its two-layer variant drifts to 2e-4 in the gradient
norm by step 5: one layer-0 qkv element whose gradient is a near-cancelling sum, turned into about +-lr by Adam's
first step, 1.6e-4 apart after it; the three-layer model stays within 5e-6.)

Reference: every data rank ``r`` has its own batch ``x_r``; the single process takes, each step, the mean over
``r`` of the model's loss on ``x_r`` (the next-token loss plus the per-batch aux loss of that batch: the "batch"
form is per rank and microbatch, so the reference computes it per ``x_r`` too), clips the gradient norm to 1.0 and
steps torch's AdamW. Losses rtol 1e-5, parameters rtol 1e-5 / atol 1e-4: the gradients are summed in another order
(all-to-all moves each expert's tokens to one rank, reductions over ranks, flat fp32 chunks), so they agree to
rounding, which Adam's normalization can amplify for tiny gradients (hence the atol).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.apps.models.moe_llama import MoELlama, get_moe_preset
from colo.comm import CommTracker, Mesh, all_gather, all_reduce
from colo.comm.testing import run_distributed
from colo.tensor.moe import dispatch_bytes, is_expert_param, moe_blocks, shard_experts, update_expert_biases
from colo.zero import ExpertParallelZero

STEPS, LR, MAX_NORM = 5, 1e-2, 1.0
CONFIG = {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "router_z_loss_coef": 1e-3}
DEEPSEEK = {
    **CONFIG, "num_local_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "score_func": "sigmoid", "expert_bias": True,
    "first_k_dense_replace": 1, "num_hidden_layers": 3,
}  # fmt: skip
SHAPES = {"mixtral": CONFIG, "deepseek": DEEPSEEK}


def _model(shape: str = "mixtral") -> MoELlama:
    model = MoELlama(get_moe_preset("tiny-moe", **SHAPES[shape]))
    model.init_weights(seed=7)
    return model


def _biases(model) -> dict[str, torch.Tensor]:
    return {name: block.gate.expert_bias.clone() for name, block in moe_blocks(model)}


def _batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``r``'s batch: the same every step (so the loss visibly falls), different per rank."""
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1000 + rank))


def _ep_run(stage: int, dp: int, ep: int, shape: str):
    mesh = Mesh(dp=dp, ep=ep)
    model = _model(shape)
    shard_experts(model, mesh=mesh)
    zero = ExpertParallelZero(model, torch.optim.AdamW(model.parameters(), lr=LR), mesh=mesh, stage=stage)
    losses, norms = [], []
    world = mesh.group("dp", "ep")
    for step in range(STEPS):
        x = _batch(step, dist.get_rank())
        with CommTracker() as tracker:
            loss = model(x, labels=x).loss
            zero.backward(loss)
        if step == 0:
            _check_all_to_all_bytes(model, mesh, tracker)
        norms.append(zero.clip_grad_norm_(MAX_NORM))
        zero.step()
        zero.zero_grad()
        update_expert_biases(model, world)  # no-op without expert_bias (the counts are reset)
        losses.append(float(all_reduce(loss.detach().reshape(1).clone(), op="avg", group=world)))
    params = zero.full_params()
    for name, value in params.items():
        if is_expert_param(name):
            params[name] = all_gather(value.contiguous(), group=mesh.group("ep"), dim=0)
    return losses, norms, params, _biases(model)


def _check_all_to_all_bytes(model, mesh, tracker) -> None:
    """The step's all-to-all bytes over ``ep`` equal, summed over the MoE blocks, the formula for the counts each
    block routed: its counts exchange in forward and its dispatch and combine in forward and backward."""
    ep_group = mesh.group("ep")
    expected = 0
    for _, block in moe_blocks(model):
        counts = block.stats["tokens_per_expert"]
        pieces = [torch.zeros_like(counts) for _ in range(ep_group.size)]
        dist.all_gather(pieces, counts, group=ep_group.process_group)  # torch's: the tracker sees only the model's
        local = counts.numel() // ep_group.size
        me = ep_group.rank
        send = counts.view(ep_group.size, -1).sum(dim=1).tolist()
        recv = [int(piece[me * local : (me + 1) * local].sum()) for piece in pieces]
        hidden = model.config.hidden_size
        expected += 8 * (ep_group.size - 1) * local  # the counts exchange
        expected += dispatch_bytes(send, recv, rank=me, hidden_size=hidden, element_size=4, backward=True)
    assert expected > 0
    assert tracker.bytes("all_to_all", axis="ep") == expected


def _reference(world: int, shape: str):
    model = _model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(model(x, labels=x).loss for x in (_batch(step, r) for r in range(world))) / world
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        update_expert_biases(model)  # the counts of every rank's batch: the reference ran them all
        losses.append(float(loss.detach()))
    return losses, norms, {name: p.detach() for name, p in model.named_parameters()}, _biases(model)


@pytest.mark.parametrize(
    ("shape", "stage", "dp", "ep"),
    [*(("mixtral", stage, dp, 2) for stage in (1, 2) for dp in (1, 2)), ("deepseek", 2, 1, 2)],
)
def test_expert_parallel_zero_matches_the_single_process(shape, stage, dp, ep):
    ref_losses, ref_norms, ref_params, ref_biases = _reference(dp * ep, shape)
    for losses, norms, params, biases in run_distributed(_ep_run, stage, dp, ep, shape, world_size=dp * ep):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert set(params) == set(ref_params)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-4, msg=name)
        for name, bias in biases.items():  # sign updates of integer counts: exact
            torch.testing.assert_close(bias, ref_biases[name], rtol=0, atol=0, msg=name)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learns: the comparison is not of a model standing still
    if shape == "deepseek":
        assert any(bias.abs().sum() > 0 for bias in ref_biases.values())  # the biases moved
        assert any("shared_experts" in name for name in ref_params) and "layers.0.mlp.gate_proj.weight" in ref_params
