"""Only the denoiser boosted: DDP dp2, ZeRO-2 dp2, ZeRO-3 dp2 and Gemini (optimizer state on the host tier)
match the single-process recipe over 5 steps, and the sharded EMA equals diffusers' ``EMAModel`` on the same
updates.

Tolerances (fp32): losses rtol 1e-5; parameters and EMA rtol 1e-5 / atol 1e-4. Not bit-identical: each rank runs
its half of the batch through the UNet (convolutions and GroupNorm sum in another order) and the gradients are
averaged over ranks; AdamW's normalisation turns that rounding of near-zero gradients into steps of ~lr.
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.diffusion.testing import GLOBAL_BATCH, LR, SEED, components, step_images
from colo.comm.testing import run_distributed

pytest.importorskip("diffusers")

NUM_STEPS = 5
EMA = {"decay": 0.9, "use_ema_warmup": True, "inv_gamma": 1.0, "power": 0.75}
OBJECTIVE = {"prediction_type": "v_prediction", "snr_gamma": 5.0, "noise_offset": 0.05}


def _builder(tokenizer, text_encoder, vae):
    from colo.apps.diffusion import DiffusionBatchBuilder, DiffusionObjective

    return DiffusionBatchBuilder(
        DiffusionObjective(**OBJECTIVE), tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, seed=SEED
    )


def single_process():
    from diffusers.training_utils import EMAModel

    from colo.apps.diffusion import DenoiserLoss

    _, tokenizer, text_encoder, vae, unet = components()
    builder = _builder(tokenizer, text_encoder, vae)
    model = DenoiserLoss(unet)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ema = EMAModel(unet.parameters(), **EMA)
    losses = []
    for step in range(NUM_STEPS):
        batch = step_images(step)
        loss = model(
            **builder(
                step=step,
                captions=batch["caption"],
                pixel_values=batch["pixel_values"],
                rows=slice(0, GLOBAL_BATCH),
                global_rows=GLOBAL_BATCH,
            )
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.step(unet.parameters())
        losses.append(loss.item())
    names = [f"unet.{name}" for name, _ in unet.named_parameters()]
    params = {name: p.detach().clone() for name, p in zip(names, model.unet.parameters())}
    return losses, params, dict(zip(names, [s.clone() for s in ema.shadow_params]))


def make_plugin(name: str, unet_bytes: int):
    from colo.apps.booster import DDP, Gemini, Zero

    if name == "ddp":
        return DDP()
    if name == "gemini":  # optimizer state on the host tier; no device budget below the UNet (see the README's note)
        return Gemini(placement="static", optim_fractions={"host": 1.0}, device_capacity="64MiB", chunk_numel=8192)
    return Zero(stage=int(name[-1]), chunk_numel=4096)


def _boosted_run(plugin_name):
    from colo.apps.booster import Booster
    from colo.apps.diffusion import DenoiserLoss, ShardedEMA

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _, tokenizer, text_encoder, vae, unet = components()
    builder = _builder(tokenizer, text_encoder, vae)  # frozen encoders: replicated, not boosted
    model = DenoiserLoss(unet)
    unet_bytes = sum(p.numel() * 4 for p in unet.parameters())
    booster = Booster(make_plugin(plugin_name, unet_bytes))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    ema = ShardedEMA(booster, **EMA)
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for step in range(NUM_STEPS):
        images = step_images(step)
        batch = builder(
            step=step,
            captions=images["caption"][rows],
            pixel_values=images["pixel_values"][rows],
            rows=rows,
            global_rows=GLOBAL_BATCH,
        )
        losses.append(booster.train_step(batch).loss)
        ema.step()
    optimizer = booster.engine.optimizer
    if hasattr(optimizer, "full_params"):
        params = optimizer.full_params()
    else:
        params = {name: p.detach().clone() for name, p in booster.unwrap().named_parameters()}
    shard_numel = sum(value.numel() for value, _ in ema.shadow.values())
    return losses, params, ema.full(), shard_numel, unet_bytes // 4


@pytest.fixture(scope="module")
def reference():
    return single_process()


@pytest.mark.parametrize("plugin_name", ["ddp", "zero2", "zero3", "gemini"])
def test_boosted_denoiser_and_sharded_ema_match_one_process(plugin_name, reference):
    expected_losses, expected_params, expected_ema = reference
    results = run_distributed(_boosted_run, plugin_name, world_size=2, timeout=180)
    for losses, params, ema, _, _ in results:
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert set(params) == set(expected_params) == set(ema)
        for name, value in expected_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-4, msg=name)
            torch.testing.assert_close(ema[name], expected_ema[name], rtol=1e-5, atol=1e-4, msg=f"ema {name}")
    held, unet_numel = [shard_numel for *_, shard_numel, _ in results], results[0][-1]
    if plugin_name == "ddp":  # every rank holds the whole average
        assert held == [unet_numel, unet_numel]
    else:  # each rank holds its own part of it, together the whole, nothing twice
        assert sum(held) == unet_numel and max(held) < unet_numel, held
    assert not torch.equal(expected_ema["unet.conv_in.weight"], expected_params["unet.conv_in.weight"])
