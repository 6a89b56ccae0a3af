"""Expert parallelism on 2 ranks: an ep2 MoE block equals the single-process block on the same tokens (outputs,
input gradients, router and expert gradients, dropless and with capacity), its all-to-all bytes equal the
formula for the routed counts, and the per-sequence aux loss and its gradient are the same at dp1 and dp2.

Reference: each rank ``r`` has its own tokens ``x_r`` and output weights ``g_r``; the global loss is
``mean_r sum(y_r * g_r)``. The single process runs the unsharded block on every ``x_r`` and differentiates that
mean. At ep2 each rank differentiates its own term; the router gradient is then averaged over the ranks (what
the data-parallel reduction does) and each rank's expert gradient, scaled by 1/ep in backward, is its slice of the
reference gradient directly. Float64 (the loop experts): only summation order differs (a token's expert output
is the same product; a weight gradient sums the same per-token terms in another order), so rtol 1e-10 / atol 1e-12.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import CommTracker, Mesh, all_reduce
from colo.comm.testing import run_distributed
from colo.tensor.moe import MoEBlock, MoEConfig, dispatch_bytes, shard_experts

HIDDEN, INTERMEDIATE, EXPERTS = 8, 12, 4
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}


class _Holder(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.moe = block


def _block(config: MoEConfig) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(HIDDEN, INTERMEDIATE, config).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def _inputs(rank: int, batch: int = 2, seq: int = 5):
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batch, seq, HIDDEN, generator=generator, dtype=torch.float64)
    return x, torch.randn(batch, seq, HIDDEN, generator=generator, dtype=torch.float64)


def _run(block, x, g, scale=1.0):
    x = x.clone().requires_grad_(True)
    y = block(x)
    ((y * g).sum() * scale).backward()
    return y.detach(), x.grad


def _ep2(config: MoEConfig):
    mesh = Mesh(ep=2)
    rank = mesh.rank("ep")
    block = _block(config)
    shard_experts(_Holder(block), mesh=mesh)
    x, g = _inputs(rank)
    with CommTracker() as forward:
        y, x_grad = _run_forward_only(block, x)
    counts = block.stats["tokens_per_expert"]
    with CommTracker() as backward:
        (y * g).sum().backward()
    gate_grad = all_reduce(block.gate.weight.grad.clone(), op="avg", group=mesh.group("ep"))
    send = counts.view(2, -1).sum(dim=1).tolist()
    recv = [int(v) for v in torch.tensor(dist_all_gather_counts(counts)).tolist()]
    return {
        "y": y.detach(),
        "x_grad": x_grad.grad,
        "gate_grad": gate_grad,
        "expert_grads": [p.grad for p in (block.experts.w1, block.experts.w2, block.experts.w3)],
        "forward_bytes": forward.bytes("all_to_all", axis="ep"),
        "backward_bytes": backward.bytes("all_to_all", axis="ep"),
        "forward_calls": forward.calls("all_to_all", axis="ep"),
        "send": send,
        "recv": recv,
        "element_size": y.element_size(),
    }


def _run_forward_only(block, x):
    x = x.clone().requires_grad_(True)
    return block(x), x


def dist_all_gather_counts(counts: torch.Tensor) -> list[int]:
    """Rows this rank receives from each rank: what every rank sends to it (gathered by torch, not colo, so the
    tracker sees only the MoE traffic)."""
    pieces = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, counts)
    local = counts.numel() // dist.get_world_size()
    me = dist.get_rank()
    return [int(piece[me * local : (me + 1) * local].sum()) for piece in pieces]


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_ep2_block_equals_the_single_process_block(capacity_factor):
    config = MoEConfig(num_experts=EXPERTS, top_k=2, capacity_factor=capacity_factor)
    results = run_distributed(_ep2, config, world_size=2)
    reference = _block(config)
    ys, x_grads = zip(*(_run(reference, *_inputs(r), scale=0.5) for r in range(2)))
    expert_refs = [p.grad for p in (reference.experts.w1, reference.experts.w2, reference.experts.w3)]
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["y"], ys[rank], **TOLERANCE)
        torch.testing.assert_close(result["x_grad"], 2 * x_grads[rank], **TOLERANCE)  # its own term, unscaled
        torch.testing.assert_close(result["gate_grad"], reference.gate.weight.grad, **TOLERANCE)
        for got, full in zip(result["expert_grads"], expert_refs):
            torch.testing.assert_close(got, full[rank * 2 : (rank + 1) * 2], **TOLERANCE)
        # counts exchange + dispatch + combine in forward; the two again, reversed, in backward
        rows = dispatch_bytes(
            result["send"], result["recv"], rank=rank, hidden_size=HIDDEN, element_size=8, backward=False
        )
        assert result["forward_calls"] == 3
        assert result["forward_bytes"] == 8 * (2 - 1) * EXPERTS // 2 + rows
        assert result["backward_bytes"] == rows
        assert sum(result["send"]) > 0


def _aux_dp2():
    mesh = Mesh(dp=2)
    block = _block(MoEConfig(num_experts=EXPERTS, top_k=2, aux_loss_type="sequence", aux_loss_coef=1.0))
    x = _inputs(0, batch=4)[0].chunk(2)[mesh.rank("dp")]
    block(x)
    block.aux_loss.backward()
    loss = all_reduce(block.aux_loss.detach().clone(), op="avg", group=mesh.group("dp"))
    return loss, all_reduce(block.gate.weight.grad.clone(), op="avg", group=mesh.group("dp"))


def test_per_sequence_aux_loss_and_gradient_are_the_same_at_dp1_and_dp2():
    block = _block(MoEConfig(num_experts=EXPERTS, top_k=2, aux_loss_type="sequence", aux_loss_coef=1.0))
    block(_inputs(0, batch=4)[0])
    block.aux_loss.backward()
    for loss, grad in run_distributed(_aux_dp2, world_size=2):
        torch.testing.assert_close(loss, block.aux_loss.detach(), **TOLERANCE)
        torch.testing.assert_close(grad, block.gate.weight.grad, **TOLERANCE)


def _bias_update_dp_ep():
    mesh = Mesh(dp=2, ep=2)
    block = _block(MoEConfig(num_experts=EXPERTS, top_k=2, expert_bias=True, expert_bias_update_rate=0.1))
    shard_experts(_Holder(block), mesh=mesh)
    block(_inputs(dist.get_rank())[0])
    local = block.gate.tokens_per_expert.clone()
    counts = block.gate.update_expert_bias(mesh.group("dp", "ep"))
    return local, counts, block.gate.expert_bias.clone()


def test_expert_bias_is_updated_from_the_counts_of_every_data_rank():
    """dp2 x ep2: each rank routes its own tokens; the bias update uses the counts summed over all 4 ranks, so every
    rank ends with the same bias: ``rate * sign(mean - count)`` of the global counts."""
    results = run_distributed(_bias_update_dp_ep, world_size=4)
    total = sum(local for local, _, _ in results)
    expected = 0.1 * torch.sign(total.mean() - total)
    assert len({tuple(local.tolist()) for local, _, _ in results}) > 1  # the ranks' own counts differ
    for _, counts, bias in results:
        torch.testing.assert_close(counts, total, rtol=0, atol=0)
        torch.testing.assert_close(bias, expected, rtol=0, atol=0)
