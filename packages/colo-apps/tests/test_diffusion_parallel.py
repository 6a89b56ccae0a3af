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


def make_plugin(name: str, unet_bytes: int, precision: str = "fp32"):
    from colo.apps.booster import DDP, Gemini, Zero

    if name == "ddp":
        return DDP(precision=precision)
    if name == "gemini-below":  # every parameter homed on the host, a device arena of 70% of the UNet's bytes
        return Gemini(
            placement="static",
            param_fractions={"host": 1.0},
            optim_fractions={"host": 1.0},
            device_capacity=int(0.7 * unet_bytes),
            chunk_numel=8192,
            precision=precision,
        )
    if name == "gemini":  # optimizer state on the host tier
        return Gemini(
            placement="static",
            optim_fractions={"host": 1.0},
            device_capacity="64MiB",
            chunk_numel=8192,
            precision=precision,
        )
    return Zero(stage=int(name[-1]), chunk_numel=4096, precision=precision)


def _boosted_run(plugin_name, precision="fp32"):
    from colo.apps.booster import Booster
    from colo.apps.diffusion import DenoiserLoss, ShardedEMA

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _, tokenizer, text_encoder, vae, unet = components()
    builder = _builder(tokenizer, text_encoder, vae)  # frozen encoders: replicated, not boosted
    plugin = make_plugin(plugin_name, sum(p.numel() * 4 for p in unet.parameters()), precision)
    model = DenoiserLoss(unet, compute_dtype=None if precision == "fp32" else plugin.compute_dtype)
    unet_bytes = sum(p.numel() * 4 for p in unet.parameters())
    booster = Booster(plugin)
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)

    def batch_of(step):
        images = step_images(step)
        return builder(
            step=step,
            captions=images["caption"][rows],
            pixel_values=images["pixel_values"][rows],
            rows=rows,
            global_rows=GLOBAL_BATCH,
        )

    # below the UNet's size, Gemini must pack its chunks in the order the UNet runs (diffusers registers a block's
    # attentions before its resnets and mid_block after up_blocks): the Booster learns it from one forward
    example = batch_of(0) if plugin_name == "gemini-below" else None
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR), example_batch=example)
    ema = ShardedEMA(booster, **EMA)
    losses = []
    for step in range(NUM_STEPS):
        losses.append(booster.train_step(batch_of(step)).loss)
        ema.step()
    optimizer = booster.engine.optimizer
    if plugin_name == "gemini-below":
        device = optimizer.memory_report().tiers["device"]
        assert device.capacity < unet_bytes and device.high_water <= device.capacity, (device, unet_bytes)
    params = booster.full_state_dict()
    shard_numel = sum(value.numel() for value, _ in ema.shadow.values())
    return losses, params, ema.full(), ema.full(to_rank=0), shard_numel, unet_bytes // 4


@pytest.fixture(scope="module")
def reference():
    return single_process()


@pytest.mark.parametrize("plugin_name", ["ddp", "zero2", "zero3", "gemini", "gemini-below"])
def test_boosted_denoiser_and_sharded_ema_match_one_process(plugin_name, reference):
    expected_losses, expected_params, expected_ema = reference
    results = run_distributed(_boosted_run, plugin_name, world_size=2, timeout=180)
    for rank, (losses, params, ema, on_rank_0, _, _) in enumerate(results):
        if rank == 0:  # assembled on rank 0 alone: the same average
            assert set(on_rank_0) == set(ema) and all(torch.equal(on_rank_0[n], v) for n, v in ema.items())
        else:
            assert on_rank_0 == {}
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


@pytest.mark.parametrize("plugin_name", ["ddp", "zero2", "zero3", "gemini"])
def test_bf16_compute_follows_the_fp32_single_process(plugin_name, reference):
    """bf16 compute (fp32 masters) dp2: the fp32 batch enters the UNet in bf16 (`DenoiserLoss(compute_dtype=...)`,
    as the trainer builds it; without it ZeRO's and Gemini's bf16 weights meet fp32 inputs in the timestep
    embedding's first linear: a dtype error) and the run stays within bf16's rounding of the fp32 single process
    over 5 steps: losses rtol 5e-3, fp32 masters atol 1e-2 (measured: losses <= 8.5e-4 relative, masters <= 4.0e-3;
    DDP's autocast 5.5e-4 / 3.8e-3)."""
    expected_losses, expected_params, _ = reference
    for losses, params, *_ in run_distributed(_boosted_run, plugin_name, "bf16", world_size=2, timeout=180):
        assert losses == pytest.approx(expected_losses, rel=5e-3)
        assert losses != pytest.approx(expected_losses, rel=1e-6)  # bf16 did run (fp32 is within ~1e-7 here)
        for name, value in expected_params.items():
            assert params[name].dtype == torch.float32
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-2, msg=name)


def _checkpointed_run(checkpointing):
    """ZeRO-3 dp2, 3 steps, the UNet from the trainer's `initial_unet` with ``diffusion.gradient_checkpointing``;
    counts the calls of one resnet block (recomputed in backward when checkpointing)."""
    from colo.apps.booster import Booster
    from colo.apps.diffusion import DenoiserLoss
    from colo.apps.diffusion.components import initial_unet
    from colo.apps.diffusion.testing import tiny_run_config

    rank = torch.distributed.get_rank()
    config = tiny_run_config("unused", gradient_checkpointing=checkpointing)
    _, tokenizer, text_encoder, vae, _ = components()
    unet = initial_unet(config)
    calls = []
    unet.down_blocks[1].resnets[0].register_forward_pre_hook(lambda *_: calls.append(1))  # (recompute stops early)
    builder = _builder(tokenizer, text_encoder, vae)
    booster = Booster(make_plugin("zero3", 0))
    booster.boost(DenoiserLoss(unet), torch.optim.AdamW(unet.parameters(), lr=LR))
    rows = slice(rank * 2, rank * 2 + 2)
    losses = []
    for step in range(3):
        images = step_images(step)
        batch = builder(
            step=step,
            captions=images["caption"][rows],
            pixel_values=images["pixel_values"][rows],
            rows=rows,
            global_rows=GLOBAL_BATCH,
        )
        losses.append(booster.train_step(batch).loss)
    return losses, booster.full_state_dict(), len(calls)


def test_gradient_checkpointing_recomputes_and_changes_nothing_under_zero3():
    plain = run_distributed(_checkpointed_run, False, world_size=2, timeout=180)
    checkpointed = run_distributed(_checkpointed_run, True, world_size=2, timeout=180)
    for (losses, params, calls), (ckpt_losses, ckpt_params, ckpt_calls) in zip(plain, checkpointed):
        assert ckpt_losses == losses  # fp32, same order of operations: bit for bit
        assert all(torch.equal(ckpt_params[name], value) for name, value in params.items())
        assert calls == 3 and ckpt_calls == 6  # one forward per step, plus its recompute in backward


def _gathered_piece_payload() -> dict:
    """`gather_pieces` on pieces that are views into one flat buffer (this rank's master shard holding its half of
    four 2 x 1024 tensors): the bytes its all-gather pickles, and the whole tensors it assembles."""
    import pickle

    import torch.distributed as dist

    from colo.apps.diffusion.ema import gather_pieces
    from colo.comm import Mesh

    group = Mesh(dp=2).group("dp")
    rank = group.rank
    flat = torch.arange(4 * 1024, dtype=torch.float32) + 10_000 * rank
    pieces = [
        (f"w{i}", flat[1024 * i : 1024 * (i + 1)], {"flat_start": 1024 * rank, "global_shape": [2, 1024]})
        for i in range(4)
    ]
    sent = []
    original = dist.all_gather_object

    def counting(output, obj, group=None):
        sent.append(len(pickle.dumps(obj)))
        return original(output, obj, group=group)

    dist.all_gather_object = counting
    try:
        whole = gather_pieces(pieces, group=group)
    finally:
        dist.all_gather_object = original
    return {"sent": sent[0], "buffer": flat.numel() * 4, "whole": whole}


def test_gathered_pieces_send_their_own_values_not_the_flat_buffer_they_view():
    for result in run_distributed(_gathered_piece_payload, world_size=2, timeout=60):
        # the four pieces are the whole buffer: sent once (16 KiB + framing), not once per piece (64 KiB)
        assert result["buffer"] <= result["sent"] < 1.1 * result["buffer"], result["sent"]
        for i in range(4):
            expected = torch.stack([torch.arange(1024.0) + 1024 * i + 10_000 * r for r in range(2)])
            torch.testing.assert_close(result["whole"][f"w{i}"], expected, rtol=0, atol=0)
