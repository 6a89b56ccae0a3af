"""``loss_weighting="token"``: with rows of very different numbers of labelled tokens (SFT-like masks), the Booster
over data ranks and microbatches trains exactly like one process on the whole batch, whose loss is the mean over
all labelled tokens; the default ``"microbatch"`` weighting does not (the test shows the difference is real).

SGD with momentum rather than AdamW, so that parameters compare tightly (AdamW turns the rounding of near-zero
gradient entries into steps of ~lr); tolerances (fp32): losses rel 1e-5, parameters rtol 1e-5 / atol 1e-6
(reductions in another order).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

STEPS, ROWS, SEQ, LR = 3, 8, 16, 0.5


def make_model():
    from colo.apps import Llama, get_preset

    torch.manual_seed(0)
    model = Llama(get_preset("tiny"))
    model.init_weights(0)
    return model


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Rows with 2 labelled targets next to rows with 15 (a prompt masked out except its last tokens)."""
    generator = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, 128, (ROWS, SEQ), generator=generator)
    labels = tokens.clone()
    for row in range(ROWS):
        keep = 3 if row % 3 else SEQ
        labels[row, : SEQ - keep] = -100
    return {"input_ids": tokens, "labels": labels}


def reference_run():
    model = make_model()
    optimizer = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        loss = model(**global_batch(step)).loss  # the mean over every labelled target of the batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(kind, settings):
    from colo.apps import DDP, Booster, Zero
    from colo.apps.booster import HybridParallel

    expected_losses, expected = reference_run()
    plugin = {"ddp": DDP, "zero": Zero, "hybrid": HybridParallel}[kind](**settings)
    model = make_model()
    booster = Booster(plugin)
    booster.boost(model, make_optimizer(model))
    mesh = booster.engine.mesh
    rows = ROWS // mesh.size("dp")
    losses = []
    for step in range(STEPS):
        batch = {k: v[mesh.rank("dp") * rows : (mesh.rank("dp") + 1) * rows] for k, v in global_batch(step).items()}
        losses.append(booster.train_step(batch).loss)
    if kind == "ddp":
        params = {n: p.detach() for n, p in model.named_parameters()}
    else:
        params = booster.engine.optimizer.full_params()
    mismatches = []
    for name, value in params.items():
        try:
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    return losses, expected_losses, mismatches


@pytest.mark.parametrize(
    "kind, settings, world_size",
    [
        ("ddp", {"num_microbatches": 2}, 2),
        ("zero", {"stage": 2, "num_microbatches": 2}, 2),
        ("hybrid", {"sp": 2, "sp_mode": "ulysses", "zero_stage": 1, "num_microbatches": 2}, 4),  # sp2 x dp2
    ],
    ids=["ddp", "zero2", "sp2-dp2"],
)
def test_token_weighting_equals_the_single_process_token_mean(kind, settings, world_size):
    for losses, expected_losses, mismatches in run_distributed(
        _run, kind, {**settings, "loss_weighting": "token"}, world_size=world_size
    ):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert not mismatches, mismatches


def test_microbatch_weighting_differs_on_uneven_rows():
    losses, expected_losses, _ = run_distributed(_run, "ddp", {"num_microbatches": 2}, world_size=2)[0]
    assert abs(losses[0] - expected_losses[0]) > 1e-3


def test_bad_loss_weighting_names_the_choices():
    from colo.apps import DDP
    from colo.apps.booster import HybridParallel

    with pytest.raises(
        ValueError, match=r"DDP.loss_weighting='tokens' is unknown; use one of \('microbatch', 'token'\)"
    ):
        DDP(loss_weighting="tokens")
    with pytest.raises(ValueError, match="loss_weighting='token' with pp > 1 is not supported"):
        HybridParallel(pp=2, num_microbatches=2, loss_weighting="token")
