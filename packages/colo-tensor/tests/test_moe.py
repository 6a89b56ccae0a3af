"""The MoE building blocks in one process: grouped experts equal the loop reference, the capacity rule drops exactly
the assignments its documented rule says, every kept assignment is combined back exactly once, the losses follow
their documented formulas, the per-sequence aux loss does not depend on how the batch is split into microbatches,
the expert bias steers only the choice, and bad settings fail with a message naming the field.

Tolerances: float64 where a reference recomputes the same sums in another order (exact up to 1e-12); the grouped
experts run in float32 (``grouped_mm`` has no float64) against the float32 loop: one matmul per expert in both, the
same products, so rtol 1e-6 / atol 1e-6 covers the different blocking of the two kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from colo.comm.testing import requires_cuda
from colo.tensor.moe import (
    GroupedExperts,
    MoEBlock,
    MoEConfig,
    capacity_mask,
    check_expert_parallel,
    expert_capacity,
    load_balancing_loss,
    permute,
    unpermute,
    z_loss,
)

HIDDEN, INTERMEDIATE = 8, 12


def _block(dtype=torch.float64, seed=0, **config) -> MoEBlock:
    torch.manual_seed(seed)
    block = MoEBlock(HIDDEN, INTERMEDIATE, MoEConfig(**config)).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def _x(*shape, seed=1, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(block: MoEBlock, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: the sum over its kept choices of weight * expert(token)."""
    tokens = x.reshape(-1, HIDDEN)
    routing = block.gate(tokens)
    e = block.experts
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(routing.top_k_index.shape[1]):
            if keep is not None and not keep[t, j]:
                continue
            k = int(routing.top_k_index[t, j])
            h = torch.nn.functional.silu(e.w1[k] @ tokens[t]) * (e.w3[k] @ tokens[t])
            out[t] += routing.top_k_weights[t, j].to(x.dtype) * (e.w2[k] @ h)
    return out.view_as(x)


def _rule_keep(top_k_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The documented drop rule, literally: choice rank first, then token position; each expert keeps its first C."""
    num_tokens, top_k = top_k_index.shape
    taken = [0] * num_experts
    keep = torch.zeros(num_tokens, top_k, dtype=torch.bool)
    for j in range(top_k):
        for t in range(num_tokens):
            e = int(top_k_index[t, j])
            if taken[e] < capacity:
                keep[t, j] = True
            taken[e] += 1
    return keep


def test_block_equals_the_token_by_token_reference_dropless():
    block = _block(num_experts=4, top_k=2)
    x = _x(2, 5, HIDDEN)
    torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-12, atol=1e-12)
    assert float(block.stats["drop_fraction"]) == 0.0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_grouped_experts_equal_the_loop_forward_and_backward(score_func):
    outputs = {}
    for impl in ("grouped", "loop"):
        block = _block(torch.float32, num_experts=6, top_k=3, score_func=score_func, expert_impl=impl)
        x = _x(3, 7, HIDDEN, dtype=torch.float32).requires_grad_(True)
        y = block(x)
        (y * _x(3, 7, HIDDEN, seed=2, dtype=torch.float32)).sum().backward()
        outputs[impl] = [y.detach(), x.grad, *(p.grad for p in block.parameters())]
    for grouped, loop in zip(outputs["grouped"], outputs["loop"]):
        torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-6)


def test_an_expert_with_no_rows_gets_a_zero_gradient():
    experts = GroupedExperts(3, HIDDEN, INTERMEDIATE)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(5, HIDDEN)
    experts(x, torch.tensor([2, 0, 3])).square().sum().backward()
    assert experts.w1.grad[1].abs().sum() == 0 and experts.w1.grad[0].abs().sum() > 0


def test_capacity_rule_drops_exactly_the_documented_assignments():
    # hand-made: 4 tokens, k=2, 3 experts, capacity 2. First choices: e0, e0, e0, e1 -> token 2's first choice is
    # the third for e0: dropped. Second choices: e1, e2, e1, e0 -> e1 already has token 3's first choice, so
    # token 0's second choice is kept (second for e1), token 2's dropped (third); e0 is full, token 3's dropped.
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = capacity_mask(index, num_experts=3, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    generator = torch.Generator().manual_seed(3)
    for case in range(20):
        num_tokens, num_experts, top_k = 17, 5, 2
        index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
        factor = [0.25, 0.5, 1.0, 1.5][case % 4]
        capacity = expert_capacity(num_tokens, top_k=top_k, num_experts=num_experts, capacity_factor=factor)
        assert capacity == math.ceil(factor * num_tokens * top_k / num_experts)
        expected = _rule_keep(index, num_experts, capacity)
        assert torch.equal(capacity_mask(index, num_experts=num_experts, capacity=capacity), expected)


def test_capacity_block_computes_only_the_kept_assignments():
    block = _block(num_experts=4, top_k=2, capacity_factor=0.5)
    x = _x(2, 6, HIDDEN)
    routing = block.gate(x.reshape(-1, HIDDEN))
    capacity = expert_capacity(12, top_k=2, num_experts=4, capacity_factor=0.5)
    keep = _rule_keep(routing.top_k_index, 4, capacity)
    assert not keep.all()
    torch.testing.assert_close(block(x), _reference(block, x, keep), rtol=1e-12, atol=1e-12)
    assert float(block.stats["drop_fraction"]) == pytest.approx(1 - keep.sum().item() / keep.numel())
    assert int(block.stats["tokens_per_expert"].max()) <= capacity


@pytest.mark.parametrize("drop", [False, True])
def test_every_kept_assignment_is_combined_back_exactly_once(drop):
    tokens = torch.arange(1.0, 11.0, dtype=torch.float64)[:, None].expand(10, HIDDEN).contiguous()
    index = torch.stack([torch.randperm(5, generator=torch.Generator().manual_seed(t))[:3] for t in range(10)])
    keep = capacity_mask(index, num_experts=5, capacity=4) if drop else None
    rows, permutation = permute(tokens, index, num_experts=5, keep=keep)
    expected_experts = index.reshape(-1) if keep is None else index.reshape(-1)[keep.reshape(-1)]
    assert torch.equal(permutation.counts, torch.bincount(expected_experts, minlength=5))
    sorted_experts = torch.repeat_interleave(torch.arange(5), permutation.counts)
    assert torch.equal(index.reshape(-1)[permutation.assignment_index], sorted_experts)  # grouped by expert
    combined = unpermute(rows, permutation, torch.ones(10, 3, dtype=torch.float64))
    kept_per_token = torch.full((10,), 3.0) if keep is None else keep.sum(dim=1).double()
    torch.testing.assert_close(combined, tokens * kept_per_token[:, None], rtol=0, atol=0)


def test_load_balancing_loss_follows_its_formula_per_batch_and_per_sequence():
    generator = torch.Generator().manual_seed(5)
    batch, seq, experts, top_k = 3, 4, 5, 2
    scores = torch.softmax(torch.randn(batch * seq, experts, generator=generator, dtype=torch.float64), dim=-1)
    index = torch.topk(scores, top_k, dim=-1).indices

    def formula(s, i):
        counts = torch.bincount(i.reshape(-1), minlength=experts).double()
        return experts * sum(counts[e] / s.shape[0] * s[:, e].mean() for e in range(experts))

    batch_loss = load_balancing_loss(scores, index, num_experts=experts)
    torch.testing.assert_close(batch_loss, formula(scores, index), rtol=1e-12, atol=0)
    per_sequence = [formula(scores[b * seq : (b + 1) * seq], index[b * seq : (b + 1) * seq]) for b in range(batch)]
    sequence_loss = load_balancing_loss(scores, index, num_experts=experts, batch_size=batch)
    torch.testing.assert_close(sequence_loss, sum(per_sequence) / batch, rtol=1e-12, atol=0)
    uniform = torch.full((8, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(load_balancing_loss(uniform, balanced, num_experts=4)) == pytest.approx(2.0)  # perfect: k


def test_z_loss_is_the_mean_squared_logsumexp():
    logits = _x(6, 4)
    expected = sum(torch.log(torch.exp(row).sum()) ** 2 for row in logits) / 6
    torch.testing.assert_close(z_loss(logits), expected, rtol=1e-12, atol=0)


def _aux_grad(block: MoEBlock, microbatches: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    block.zero_grad()
    total = 0.0
    for x in microbatches:
        block(x)
        (block.aux_loss / len(microbatches)).backward()
        total += float(block.aux_loss.detach()) / len(microbatches)
    return total, block.gate.weight.grad.clone()


def test_per_sequence_aux_loss_and_gradient_do_not_depend_on_the_number_of_microbatches():
    block = _block(num_experts=4, top_k=2, aux_loss_type="sequence", aux_loss_coef=1.0, z_loss_coef=0.1)
    x = _x(8, 5, HIDDEN)
    one_loss, one_grad = _aux_grad(block, [x])
    four_loss, four_grad = _aux_grad(block, list(x.chunk(4)))
    assert four_loss == pytest.approx(one_loss, rel=1e-12)
    torch.testing.assert_close(four_grad, one_grad, rtol=1e-10, atol=1e-12)


def test_per_batch_aux_loss_gradient_is_the_mean_of_the_per_microbatch_gradients():
    block = _block(num_experts=4, top_k=2, aux_loss_type="batch", aux_loss_coef=1.0)
    microbatches = list(_x(8, 5, HIDDEN).chunk(4))
    _, accumulated = _aux_grad(block, microbatches)
    each = [_aux_grad(block, [m])[1] for m in microbatches]
    torch.testing.assert_close(accumulated, sum(each) / 4, rtol=1e-10, atol=1e-12)
    _, whole = _aux_grad(block, [torch.cat(microbatches)])
    assert not torch.allclose(whole, accumulated)  # the per-batch form depends on the split: documented


def test_expert_bias_steers_the_choice_not_the_weights_and_moves_against_the_load():
    block = _block(torch.float32, num_experts=4, top_k=1, expert_bias=True, expert_bias_update_rate=0.5)
    block.train()
    x = _x(2, 6, HIDDEN, dtype=torch.float32)
    scores = torch.softmax(block.gate(x.reshape(-1, HIDDEN)).logits, dim=-1)
    block.gate.tokens_per_expert.zero_()
    with torch.no_grad():
        block.gate.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    routing = block.gate(x.reshape(-1, HIDDEN))
    assert torch.equal(routing.top_k_index, torch.zeros(12, 1, dtype=torch.long))  # the bias wins the choice
    torch.testing.assert_close(routing.top_k_weights, torch.ones(12, 1))  # normalized over k=1: the score's own
    assert routing.scores.requires_grad and not block.gate.expert_bias.requires_grad
    torch.testing.assert_close(routing.scores, scores)
    counts = block.gate.update_expert_bias()
    assert counts.tolist() == [12.0, 0.0, 0.0, 0.0]
    assert block.gate.expert_bias.tolist() == [9.5, 0.5, 0.5, 0.5]  # overloaded down, idle up, by the rate
    assert block.gate.tokens_per_expert.sum() == 0


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_block_counts_its_assignments_once(use_reentrant):
    """Activation checkpointing runs the block's forward again in backward; the router counts each assignment once
    (the aux-loss-free bias update reads these counts) and the block keeps the losses of the original forward."""
    block = _block(torch.float32, num_experts=4, top_k=2, expert_bias=True)
    block.train()
    x = _x(2, 6, HIDDEN, dtype=torch.float32).requires_grad_(True)
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)
    aux, stats = block.aux_loss, block.stats
    (y.sum() + aux).backward()
    expected = torch.bincount(block.last_routing.top_k_index.flatten(), minlength=4).float()
    assert block.gate.tokens_per_expert.sum() == 12 * 2
    assert torch.equal(block.gate.tokens_per_expert, expected)
    assert block.aux_loss is aux and block.stats is stats  # not replaced by the recomputation
    grad = x.grad.clone()
    x.grad = None
    (block(x).sum() + block.aux_loss).backward()  # the same block without checkpointing: the same gradient
    torch.testing.assert_close(x.grad, grad, rtol=1e-6, atol=1e-6)
    assert block.gate.tokens_per_expert.sum() == 2 * 12 * 2  # one more forward, counted once


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_experts": 4, "top_k": 5}, "top_k=5 is larger than num_experts=4"),
        ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0"),
        ({"capacity_factor": -1.0}, "capacity_factor=-1.0 must be > 0"),
        ({"score_func": "relu"}, "score_func='relu'"),
        ({"aux_loss_type": "global"}, "aux_loss_type='global'"),
        ({"num_shared_experts": -1}, "num_shared_experts=-1 must be an integer >= 0"),
        ({"shared_intermediate_size": 16}, "shared_intermediate_size=16 is set but num_shared_experts=0"),
        ({"num_experts": 8, "num_groups": 3}, "num_groups=3 does not divide num_experts=8: .* [1, 2, 4, 8]"),
        (
            {"num_experts": 8, "num_groups": 4, "top_k_groups": 5},
            "top_k_groups=5 must be an integer in 1..num_groups=4",
        ),
        (
            {"num_experts": 16, "top_k": 8, "num_groups": 4, "top_k_groups": 1},
            "top_k=8 is more than the 4 experts in the top_k_groups=1 groups of 4 .* set top_k_groups >= 2",
        ),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor=0.0 must be > 0"),
    ],
)
def test_bad_moe_settings_name_the_field(settings, message):
    escaped = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=escaped):
        MoEConfig(**settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_experts": 6, "ep": 4, "data_parallel_size": 4}, r"ep=4 does not divide num_experts=6.*\[1, 2, 3, 6\]"),
        ({"num_experts": 8, "ep": 4, "data_parallel_size": 6}, "ep=4 does not divide the 6 data-parallel ranks"),
    ],
)
def test_bad_expert_parallel_layouts_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        check_expert_parallel(**settings)
    # tensor, pipeline and sequence parallelism compose with ep (colo.apps' HybridParallel(ep=...))
    check_expert_parallel(num_experts=8, ep=2, data_parallel_size=2, tp=2, pp=2)
    check_expert_parallel(num_experts=8, ep=2, data_parallel_size=2, sp=2)


@requires_cuda
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_experts_equal_the_loop_on_cuda(dtype, tolerance):
    """``grouped_mm``'s CUDA kernels (16-byte aligned shapes, an expert without rows) against the loop, forward and
    backward; bf16 to bf16 rounding of the two kernels' different accumulation."""
    hidden, intermediate, num_experts = 64, 96, 8
    results = {}
    for impl in ("grouped", "loop"):
        torch.manual_seed(0)
        experts = GroupedExperts(num_experts, hidden, intermediate, impl=impl).cuda()
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.1)
        experts.to(dtype)
        counts = torch.tensor([5, 0, 17, 3, 40, 1, 9, 21], device="cuda")
        x = torch.randn(int(counts.sum()), hidden, generator=torch.Generator().manual_seed(1)).cuda().to(dtype)
        x.requires_grad_(True)
        y = experts(x, counts)
        y.float().square().sum().backward()
        results[impl] = [y.detach(), x.grad, *(p.grad for p in experts.parameters())]
    for grouped, loop in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(grouped.float(), loop.float(), rtol=tolerance, atol=tolerance)
