"""Parameters read through the boosted model right after `train_step` are the updated ones under every plugin that
overlaps the parameter all-gather with the next forward (ZeRO 1/2, alone, in `HybridParallel` or as the
expert plugin's two optimizers): an EMA over
``model.parameters()``, a submodule's ``parameters()``, ``model.state_dict()`` or a parameter read as an attribute
(``model.lm_head.weight``) must not see the previous step's
values, while the gather is still left in flight for the next forward, and the modules keep their classes."""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

ROWS, SEQ = 2, 16


def _plugin(name: str):
    from colo.apps.booster import ExpertParallel, HybridParallel, Zero

    if name == "hybrid-zero2":
        return HybridParallel(zero_stage=2, precision="fp32", chunk_numel=64)
    if name == "expert":  # two ZeRO-2 optimizers on one model: the dense part over dp x ep, the experts over dp
        return ExpertParallel(ep=2, stage=2, chunk_numel=64)
    return Zero(stage=int(name[-1]), chunk_numel=64)


def _model(plugin_name: str):
    from colo.apps.models.llama import Llama, get_preset
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    if plugin_name == "expert":
        return MoELlama(get_moe_preset("tiny-moe", num_local_experts=4, num_experts_per_tok=2))
    return Llama(get_preset("tiny", num_hidden_layers=2))


def _in_flight(booster) -> int:
    """Chunks whose parameter all-gather is still in flight (both parts of the expert plugin's optimizer)."""
    optimizer = booster.engine.optimizer
    parts = [optimizer.dense, optimizer.experts] if hasattr(optimizer, "experts") else [optimizer]
    return sum(len(part.param_sync.in_flight) for part in parts)


def _reads_right_after_steps(plugin_name):
    from colo.apps.booster import Booster

    torch.manual_seed(0)
    model = _model(plugin_name)
    config = model.config
    classes = {name: type(module) for name, module in model.named_modules()}
    booster = Booster(_plugin(plugin_name))
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    outcomes = []
    for step in range(4):
        tokens = torch.randint(0, config.vocab_size, (ROWS, SEQ), generator=generator)
        batch = {"input_ids": tokens, "labels": tokens}
        booster.train_step(batch)
        in_flight = _in_flight(booster)  # the gather overlaps the next forward
        if step % 2:  # the first read after this step is a parameter read as an attribute
            o_proj = model.get_submodule("layers.0.self_attn.o_proj")
            read = {
                "lm_head.weight": model.lm_head.weight.detach().clone(),
                "layers.0.self_attn.o_proj.weight": o_proj.weight.detach().clone(),
            }
            if plugin_name == "expert":
                read["layers.0.mlp.experts.w1"] = model.get_submodule("layers.0.mlp.experts").w1.detach().clone()
            # the reads waited for their own chunks
            waited = in_flight - _in_flight(booster)
            current = dict(booster.unwrap().named_parameters())  # waits for every gather
            same = all(torch.equal(t, current[n]) for n, t in read.items())
            outcomes.append({"in_flight": in_flight, "attributes": same, "waited": waited})
            continue
        every = [p.detach().clone() for p in model.parameters()]  # what an EMA update or a weight norm reads
        left_in_flight = _in_flight(booster)  # model.parameters() waited for every chunk it returned
        state = {name: t.clone() for name, t in model.state_dict().items()}
        mlp = [p.detach().clone() for p in model.get_submodule("layers.1.mlp").parameters()]
        current = dict(booster.unwrap().named_parameters())  # waits for every gather
        outcomes.append(
            {
                "in_flight": in_flight,
                "parameters": left_in_flight == 0 and all(torch.equal(a, b) for a, b in zip(every, current.values())),
                "state_dict": all(torch.equal(state[name], p) for name, p in current.items()),
                "classes_kept": all(type(module) is classes[name] for name, module in model.named_modules()),
                "submodule": all(
                    torch.equal(a, current[f"layers.1.mlp.{name}"])
                    for a, (name, _) in zip(mlp, model.get_submodule("layers.1.mlp").named_parameters())
                ),
            }
        )
    return outcomes


@pytest.mark.parametrize("plugin_name", ["zero1", "zero2", "hybrid-zero2", "expert"])
def test_parameters_read_right_after_a_step_are_the_updated_ones(plugin_name):
    for outcomes in run_distributed(_reads_right_after_steps, plugin_name, world_size=2):
        for outcome in outcomes:
            assert outcome["in_flight"] > 0, "the parameter all-gather no longer overlaps the next forward"
            if "attributes" in outcome:
                assert outcome["attributes"], (
                    "model.lm_head.weight right after train_step held the previous step's values"
                )
                assert 0 < outcome["waited"] < outcome["in_flight"], (
                    "attribute reads must wait for their own chunks only"
                )
                continue
            assert outcome["parameters"], "model.parameters() right after train_step held the previous step's values"
            assert outcome["state_dict"], "model.state_dict() right after train_step held the previous step's values"
            assert outcome["classes_kept"], "boosting changed the model's classes"
            assert outcome["submodule"], "model.layers[1].mlp.parameters() right after train_step held stale values"


def _losses(compile_blocks: bool):
    from colo.apps.booster import Booster, Zero
    from colo.apps.models.llama import Llama, get_preset

    torch.manual_seed(0)
    config = get_preset("tiny", num_hidden_layers=2)
    model = Llama(config)
    options = {"compile_blocks": True, "compile_options": {"backend": "aot_eager"}} if compile_blocks else {}
    booster = Booster(Zero(stage=2, chunk_numel=64, **options))
    model, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, config.vocab_size, (ROWS, SEQ), generator=generator)
        losses.append(booster.train_step({"input_ids": tokens, "labels": tokens}).loss)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_compiled_blocks_wait_for_the_overlapped_gather_before_their_graph():
    """Blocks compiled whole (``fullgraph``) under ZeRO-2: their pre-hooks are traced, so each compiled call waits for
    its chunks before the graph runs; the losses and parameters equal eager ones (aot_eager runs the same kernels).
    Before, the second step failed: the traced hook waited on a communication handle."""
    eager = run_distributed(_losses, False, world_size=2)
    compiled = run_distributed(_losses, True, world_size=2)
    for (eager_losses, eager_params), (compiled_losses, compiled_params) in zip(eager, compiled):
        assert compiled_losses == eager_losses
        for name, value in eager_params.items():
            torch.testing.assert_close(compiled_params[name], value, rtol=0, atol=0, msg=name)
