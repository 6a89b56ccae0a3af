"""colo.kernels' ops are torch operators (``torch.ops.colo.*``), so the native Llama built on them compiles into one
graph, exports with colo nodes, and selective activation checkpointing keeps the attention kernel's outputs.

On CPU the ops run their torch reference backend through the same operators the Triton backend uses on a GPU.
``aot_eager`` runs the traced graph with the same eager kernels, so compiled losses are bit-equal to eager ones
(inductor, which fuses and reorders the ops around the colo kernels, is measured in ``benchmarks/compile_llama.py``).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from colo.apps import Llama, apply_activation_checkpointing, get_preset

LAYERS, BATCH, SEQ = 2, 2, 32


def _llama() -> Llama:
    model = Llama(get_preset("tiny", num_hidden_layers=LAYERS))
    model.init_weights(0)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _train(model, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    ids = _batch(0)  # one batch, learned over the steps: the loss must go down
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_native_llama_compiles_without_graph_breaks_and_trains_bit_equal_to_eager():
    # packed rows: document ids given directly (the model derives them from restarting position ids with a
    # data-dependent check of its own, which would break the graph)
    document_ids = torch.tensor([[0] * 20 + [1] * 12, [0] * 32])
    for kwargs in ({}, {"document_ids": document_ids}):
        explanation = torch._dynamo.explain(_llama())(_batch(0), labels=_batch(0), **kwargs)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1

    torch._dynamo.reset()
    eager = _train(_llama())
    compiled = _train(torch.compile(_llama(), backend="aot_eager", fullgraph=True))
    assert compiled == eager  # bit-equal: aot_eager runs the same kernels in the same order
    assert eager[-1] < eager[0]


class _LossOf(torch.nn.Module):
    """The model's loss as a plain tensor output (`LlamaOutput` is not a pytree type export can flatten)."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, labels=labels).loss


def test_exported_llama_graph_holds_colo_operators():
    ids = _batch(0)
    exported = torch.export.export(_LossOf(_llama()), (ids, ids))
    colo_ops = collections.Counter(
        node.target.name() for node in exported.graph.nodes if getattr(node.target, "namespace", None) == "colo"
    )
    assert colo_ops == {
        "colo::rms_norm": 2 * LAYERS + 1,
        "colo::rotary": LAYERS,
        "colo::flash_attention": LAYERS,
        "colo::swiglu": LAYERS,
        "colo::fused_linear_cross_entropy": 1,
    }
    torch.testing.assert_close(exported.module()(ids, ids), _llama()(ids, labels=ids).loss, rtol=0, atol=0)


class _ColoOps(TorchDispatchMode):
    """Counts the ``torch.ops.colo`` operators that run (``rotary`` split by its ``inverse`` flag: the inverse
    rotation is rotary's backward)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "colo":
            name = func._opname
            if name == "rotary" and args[5]:
                name = "rotary (inverse: backward)"
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _ops_in_backward(mode: str | None) -> collections.Counter:
    model = _llama()
    if mode is not None:
        apply_activation_checkpointing(model, mode=mode)
    ids = _batch(0)
    loss = model(ids, labels=ids).loss
    with _ColoOps() as ops:
        loss.backward()
    return ops.counts


def test_selective_checkpointing_keeps_attention_outputs_and_recomputes_the_elementwise_kernels():
    backward = {
        "rms_norm_backward": 2 * LAYERS + 1,
        "rotary (inverse: backward)": LAYERS,
        "flash_attention_backward": LAYERS,
        "swiglu_backward": LAYERS,
    }
    assert _ops_in_backward(None) == backward  # without checkpointing the backward runs backward ops only
    # selective: the blocks' norms, rotary and SwiGLU run again in the backward; attention does not (the policy
    # keeps torch.ops.colo.flash_attention's output and logsumexp, as it keeps the matmuls' outputs)
    recomputed = {"rms_norm": 2 * LAYERS, "rotary": LAYERS, "swiglu": LAYERS}
    assert _ops_in_backward("selective") == collections.Counter(backward) + collections.Counter(recomputed)
    # full checkpointing recomputes attention too
    recomputed["flash_attention"] = LAYERS
    assert _ops_in_backward("full") == collections.Counter(backward) + collections.Counter(recomputed)


def test_compiled_blocks_share_one_graph_without_recompiles_and_train_bit_equal_to_eager():
    # what compile_blocks does to the model, on one process: every block compiled whole (a graph break is an error);
    # the blocks have one type, so dynamo compiles one frame for all of them, once (a recompile is an error too)
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = _train(_llama())
    model, counter = _llama(), CompileCounterWithBackend("aot_eager")
    for block in model.layers.values():
        block.compile(backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _train(model)
    assert counter.frame_count == 1
    assert compiled == eager  # bit-equal: aot_eager runs the same kernels in the same order


def test_booster_compiles_blocks_as_full_graphs_unless_they_exchange_point_to_point_or_hook_parameters(monkeypatch):
    from colo.apps import DDP
    from colo.apps.booster import Gemini, HybridParallel

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda block, **options: calls.append(options))
    DDP(compile_blocks=True, compile_options={"backend": "aot_eager"}).maybe_compile(_llama())
    assert calls == [{"fullgraph": True, "backend": "aot_eager"}] * LAYERS
    # the plans' collectives are functional collectives in compiled code: one graph per block (torch >= 2.13; older
    # torch keeps them eager, breaking the graph)
    from colo.comm.traced import TRACEABLE

    for settings in ({"tp": 2}, {"tp": 2, "sp_mode": "megatron"}, {"sp": 2, "sp_mode": "ulysses"}):
        calls.clear()
        HybridParallel(compile_blocks=True, **settings).maybe_compile(_llama())
        assert calls == [{"fullgraph": TRACEABLE}] * LAYERS, settings
    calls.clear()
    HybridParallel(sp=2, sp_mode="ring", compile_blocks=True).maybe_compile(_llama())  # p2p exchanges: breaks
    assert calls == [{"fullgraph": False}] * LAYERS
    calls.clear()
    Gemini(compile_blocks=True).maybe_compile(_llama())  # its chunk hooks run eagerly, between graphs
    assert calls == [{"fullgraph": False}] * LAYERS


def test_compiled_blocks_with_zero_stage_3_are_refused_naming_the_fix():
    from colo.apps.booster import HybridParallel, Zero
    from colo.apps.booster.parallel_dims import UnsupportedLayout

    with pytest.raises(ValueError, match="Zero.compile_blocks=True does not work with stage=3.*stage <= 2"):
        Zero(stage=3, compile_blocks=True)
    with pytest.raises(UnsupportedLayout, match="compile_blocks=True does not work with zero_stage=3"):
        HybridParallel(zero_stage=3, compile_blocks=True)
