"""`HybridParallel(tp=4, tp_mode="2d")` x dp2 with ZeRO-2, `HybridParallel(tp=8, tp_mode="2.5d", tp_depth=2)` and
`HybridParallel(tp=8, tp_mode="3d")` with ZeRO-1 (8 ranks, one spawn) train colo's tiny Llama like the single process
over 3 AdamW steps: the loss of every step and every parameter (gathered over ZeRO shards; grid blocks against the
matching block of the reference). Settings the grid modes do not support are refused naming the field, before any
collective.

Tolerances (fp32): losses rtol 1e-5; parameters rtol 1e-5, atol 2e-4 (tests/test_llama_grid.py says why: AdamW
turns the rounding of near-zero gradient entries into steps of up to ~lr * 1e-2; a sharding mistake moves weights by
~lr = 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, ROWS, SEQ, LR = 3, 4, 8, 1e-2


def _model():
    from colo.apps import Llama, get_preset

    model = Llama(get_preset("tiny"))
    model.init_weights(0)
    return model


def _batch(step: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 128, (ROWS, SEQ), generator=torch.Generator().manual_seed(500 + step))
    return {"input_ids": tokens, "labels": tokens.clone()}


def _full_of(reference, name):
    from colo.apps import get_preset

    module_name, _, attr = name.rpartition(".")
    if attr not in ("q_weight", "k_weight", "v_weight"):
        return reference[name]
    config = get_preset("tiny")
    heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
    return reference[f"{module_name}.weight"].split([n * config.head_dim for n in heads])["qkv".index(attr[0])]


def boosted_run(settings):
    from colo.apps import Booster
    from colo.apps.booster import HybridParallel
    from colo.tensor import layout_of

    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    expected_losses = []
    for step in range(STEPS):
        loss = reference(**_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append(loss.item())
    expected = {name: p.detach() for name, p in reference.named_parameters()}

    model = _model()
    booster = Booster(HybridParallel(**settings))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    mesh = booster.engine.mesh
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    rows = ROWS // dp
    losses = []
    for step in range(STEPS):
        batch = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in _batch(step).items()}
        losses.append(booster.train_step(batch).loss)
    named = dict(booster.engine.model.named_parameters())
    mismatches = []
    for name, value in booster.engine.optimizer.full_params().items():
        try:
            block = layout_of(named[name]).local_slice(_full_of(expected, name))
            torch.testing.assert_close(value, block, rtol=1e-5, atol=2e-4)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    kinds = sorted({type(m).__name__ for m in booster.engine.model.modules()})
    return losses, expected_losses, len(named), mismatches, kinds


def _check(results):
    for losses, expected_losses, num_params, mismatches, kinds in results:
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert num_params > 0 and not mismatches, mismatches[:3]
        assert ("Linear2D" in kinds or "Linear3D" in kinds) and "Linear" not in kinds


def _eight_rank_runs():
    return [
        boosted_run({"tp": 4, "tp_mode": "2d", "zero_stage": 2}),  # 2D x dp2, ZeRO-2
        boosted_run({"tp": 8, "tp_mode": "2.5d", "tp_depth": 2, "zero_stage": 1}),
        boosted_run({"tp": 8, "tp_mode": "3d", "zero_stage": 1}),
    ]


def test_hybrid_parallel_2d_x_dp2_zero2_2p5d_and_3d_match_the_single_process_llama():
    for results in zip(*run_distributed(_eight_rank_runs, world_size=8)):
        _check(results)


@pytest.mark.parametrize(
    ("settings", "field", "message"),
    [
        (
            {"tp": 8, "tp_mode": "2d"},
            "tp",
            "tp_mode='2d' needs tp = q^2 (a q x q grid) but tp=8; choose tp in {1, 4, 9",
        ),
        ({"tp": 12, "tp_mode": "2.5d", "tp_depth": 2}, "tp", "with tp_depth=2 choose tp in {2, 8, 18, 32, 50, ...}"),
        (
            {"tp": 4, "tp_mode": "3d"},
            "tp",
            "tp_mode='3d' needs tp = q^3 (a q x q x q cube) but tp=4; choose tp in {1, 8",
        ),
        ({"tp": 4, "tp_mode": "2d", "pp": 2}, "tp_mode", "composes with dp and zero_stage 0-2 only (got pp=2"),
        ({"tp": 4, "tp_mode": "2d", "zero_stage": 3}, "tp_mode", "zero_stage=3); use pp=1, sp=1"),
        ({"tp": 4, "tp_mode": "2d", "sp": 2, "sp_mode": "ulysses"}, "tp_mode", "sp=2, sp_mode='ulysses'"),
        ({"tp": 4, "tp_mode": "4d"}, "tp_mode", "tp_mode='4d' is unknown; use one of ('1d', '2d', '2.5d', '3d')"),
        ({"tp": 2, "tp_depth": 2}, "tp", "tp_depth=2 applies to tp_mode='2.5d' only"),
    ],
)
def test_grid_settings_the_plugin_cannot_run_are_refused_naming_the_field(settings, field, message):
    from colo.apps.booster import HybridParallel
    from colo.apps.booster.parallel_dims import LayoutError

    with pytest.raises(LayoutError) as error:
        HybridParallel(**settings)
    assert error.value.field == field
    assert message in str(error.value)
