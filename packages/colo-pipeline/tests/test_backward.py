"""The B/W split: B leaves every .grad alone, W produces it, and together they equal one ordinary backward."""

from __future__ import annotations

import copy

import torch
from torch import nn

from colo.pipeline import backward_input, backward_weight

# B + W sums the same terms as one backward, in another order: equal up to float32 rounding.
RTOL, ATOL = 1e-5, 1e-6


class CountBackward(torch.autograd.Function):
    """Identity whose backward counts its calls (it sits on the input path)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CountBackward.calls += 1
        return grad


def _stage():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 3))


def test_b_then_w_equals_one_backward_and_w_does_not_redo_the_input_path():
    stage, reference = _stage(), _stage()
    x, grad_out = torch.randn(5, 4), torch.randn(5, 3)
    x_ref = x.clone().requires_grad_(True)
    reference(CountBackward.apply(x_ref)).backward(grad_out)

    CountBackward.calls = 0
    x_in = x.clone().requires_grad_(True)
    out = stage(CountBackward.apply(x_in))
    (grad_x,), pending = backward_input([out], [grad_out], [x_in], list(stage.parameters()))
    assert all(p.grad is None for p in stage.parameters()), "B must leave the weights' .grad unchanged"
    assert CountBackward.calls == 1
    backward_weight(pending)
    assert CountBackward.calls == 1, "W must not run the input path's backward again"
    torch.testing.assert_close(grad_x, x_ref.grad, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(stage.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_w_accumulates_into_existing_grads():
    stage, reference = _stage(), _stage()
    x, grad_out = torch.randn(5, 4, requires_grad=True), torch.randn(5, 3)
    for _ in range(2):  # two microbatches
        reference(x).backward(grad_out)
        _, pending = backward_input([stage(x)], [grad_out], [x.detach().requires_grad_()], list(stage.parameters()))
        backward_weight(pending)
    for p, q in zip(stage.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_first_stage_without_input_gradient_does_everything_in_w():
    embedding, reference = nn.Embedding(10, 4), None
    reference = copy.deepcopy(embedding)
    ids, grad_out = torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 4)
    grads, pending = backward_input([embedding(ids).tanh()], [grad_out], [ids], list(embedding.parameters()))
    assert grads == [None] and embedding.weight.grad is None
    backward_weight(pending)
    reference(ids).tanh().backward(grad_out)
    torch.testing.assert_close(embedding.weight.grad, reference.weight.grad, rtol=RTOL, atol=ATOL)


def test_weights_used_several_times_on_the_input_path():
    """A weight used by several ops (tied inside a stage) whose gradient paths merge before it."""
    torch.manual_seed(1)
    w, s = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    w_ref, s_ref = (nn.Parameter(t.detach().clone()) for t in (w, s))
    x, grad_out = torch.randn(3, 4), torch.randn(3, 4)

    def f(x, w, s):
        return ((x @ w) * s) @ w.t() + s

    x_in, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    f(x_ref, w_ref, s_ref).backward(grad_out)
    (grad_x,), pending = backward_input([f(x_in, w, s)], [grad_out], [x_in], [w, s])
    assert w.grad is None and s.grad is None
    backward_weight(pending)
    torch.testing.assert_close(grad_x, x_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(s.grad, s_ref.grad, rtol=RTOL, atol=ATOL)
