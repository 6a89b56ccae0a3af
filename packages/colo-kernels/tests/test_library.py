"""Every colo.kernels op is a registered torch operator, ``torch.ops.colo.<name>``: `torch.library.opcheck` passes
for each (schema and aliasing, autograd registration, fake implementation, AOT dispatch with dynamic shapes), on
both backends (the Triton one in Triton's interpreter on CPU), and the public functions call them."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from colo.kernels import library, rms_norm, rotary_cos_sin


def _tensor(*shape, grad=False, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed + len(shape) * 7 + shape[-1])
    return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_(grad)


def _cases(backend: str) -> list[tuple[str, tuple]]:
    """``(operator name, arguments)`` pairs covering every operator and its optional inputs."""
    x, w, r = _tensor(2, 3, 16, grad=True), _tensor(16, grad=True), _tensor(2, 3, 16, grad=True, seed=1)
    dy = _tensor(2, 3, 16, seed=2)
    rstd = _tensor(2, 3).abs() + 0.5
    mean = _tensor(2, 3, seed=3)
    q, k, v = _tensor(2, 8, 4, 16, grad=True), _tensor(2, 8, 2, 16, grad=True), _tensor(2, 8, 2, 16, grad=True, seed=1)
    cos, sin = rotary_cos_sin(8, 16)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    offsets = torch.tensor([0, 0])
    out, lse = torch.ops.colo.flash_attention(q.detach(), k.detach(), v.detach(), True, 0.25, None, None, None, "torch")
    logits, target = _tensor(6, 40, grad=True), torch.tensor([1, 5, -100, 39, 0, 7])
    hidden, head = _tensor(6, 16, grad=True), _tensor(40, 16, grad=True, seed=4)
    params = [_tensor(5, 3), _tensor(7)]
    grads = [_tensor(5, 3, seed=5), _tensor(7, seed=5)]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    return [
        ("rms_norm", (x, w, None, 1e-6, backend)),
        ("rms_norm", (x, w, r, 1e-6, backend)),
        ("rms_norm_backward", (dy, dy, x.detach(), w.detach(), rstd, True, backend)),
        ("layer_norm", (x, w, w, r, 1e-5, backend)),
        ("layer_norm", (x, None, None, None, 1e-5, backend)),
        ("layer_norm_backward", (dy, None, x.detach(), w.detach(), mean, rstd, True, True, torch.float32, backend)),
        ("rotary", (q, k, cos, sin, 0, False, backend)),
        ("swiglu", (x, r, backend)),
        ("swiglu_backward", (dy, x.detach(), r.detach(), backend)),
        ("softmax", (x, None, True, 0.5, backend)),
        ("softmax", (x, torch.rand(3, 16, generator=torch.Generator().manual_seed(0)) > 0.3, False, 1.0, backend)),
        ("softmax_backward", (dy, torch.softmax(x.detach(), -1), 0.5, backend)),
        ("cross_entropy", (logits, target, -100, 1e-4, "mean", backend)),
        ("cross_entropy", (logits, target, -100, 0.0, "none", backend)),
        (
            "cross_entropy_backward",
            (
                torch.tensor(1.5),
                logits.detach(),
                target,
                torch.logsumexp(logits.detach(), -1),
                -100,
                0.0,
                "mean",
                backend,
            ),
        ),  # fmt: skip
        ("fused_linear_cross_entropy", (hidden, head, None, target, -100, 0.0, 4, True, True, False, backend)),
        ("flash_attention", (q, k, v, True, 0.25, None, None, None, backend)),
        ("flash_attention", (q, k, v, True, 0.25, None, ids, offsets, backend)),
        (
            "flash_attention_backward",
            (out, q.detach(), k.detach(), v.detach(), out, lse, True, 0.25, None, None, None, backend),
        ),  # fmt: skip
        ("fused_adamw", (params, grads, *states, 1, 1e-2, 0.9, 0.999, 1e-8, 0.01, backend)),
    ]


ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_passes_for_every_operator(backend):
    operators = library.operators()
    cases = _cases(backend)
    assert {name for name, _ in cases} == set(library.OPERATORS)  # every operator is checked
    # the AOT-dispatch check compiles the fake implementation and the autograd formula, which both backends share;
    # on the Triton backend (the interpreter: slow) the other checks compare its real outputs with the fake ones
    checks = ALL_CHECKS if backend == "torch" else ALL_CHECKS[:3]
    for name, args in cases:
        results = torch.library.opcheck(operators[name], args, test_utils=checks, raise_exception=False)
        failed = {test: result for test, result in results.items() if result != "SUCCESS"}
        assert not failed, f"{name} ({backend}): {failed}"


def test_operators_are_in_the_colo_namespace_and_the_functions_call_them():
    operators = library.operators()
    assert all(op.namespace == "colo" for op in operators.values())
    traced = make_fx(lambda x, w: rms_norm(x, w, backend="torch"))(torch.randn(2, 8), torch.ones(8))
    assert operators["rms_norm"] in [node.target for node in traced.graph.nodes]


def _per_layer_ops(backend):
    """rms_norm (alone and with a residual), rotary and swiglu forward and backward: outputs and input gradients."""
    from colo.kernels import rotary, swiglu

    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    x, residual, weight = leaf(3, 5, 32), leaf(3, 5, 32), leaf(32)
    q, k = leaf(2, 6, 4, 16), leaf(2, 6, 2, 16)
    gate, up = leaf(3, 40), leaf(3, 40)
    cos, sin = rotary_cos_sin(10, 16)
    y, h = rms_norm(x, weight, residual=residual, backend=backend)
    outputs = [y, h, rms_norm(x, weight, backend=backend), *rotary(q, k, cos, sin, position_offset=2, backend=backend)]
    outputs.append(swiglu(gate, up, backend=backend))
    sum((o * torch.arange(o.numel()).reshape(o.shape).sin()).sum() for o in outputs).backward()
    return [o.detach() for o in outputs] + [t.grad for t in (x, residual, weight, q, k, gate, up)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_eager_fast_path_equals_the_operators_and_yields_to_dispatch_modes(backend, monkeypatch):
    """In plain eager code rms_norm, rotary and swiglu skip their operator's dispatch (`dispatch.eager_fast_path`)
    with the same outputs and gradients, bit for bit; under a dispatch mode (as selective checkpointing, fake
    tensors and FLOP counting install) the operators run."""
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    dispatch = importlib.import_module("colo.kernels.dispatch")
    fast = _per_layer_ops(backend)
    monkeypatch.setattr(dispatch, "_FAST_PATH", False)
    through_operators = _per_layer_ops(backend)
    for got, expected in zip(fast, through_operators, strict=True):
        assert torch.equal(got, expected)
    monkeypatch.setattr(dispatch, "_FAST_PATH", True)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        _per_layer_ops(backend)
    assert {"colo.rms_norm", "colo.rotary", "colo.swiglu"} <= seen.names, seen.names
    assert {"colo.rms_norm_backward", "colo.swiglu_backward"} <= seen.names, seen.names
