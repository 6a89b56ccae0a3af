"""`parallelize_dit_sequence` (Ulysses over the image tokens) with sp=2 trains like the unsharded
`DiffusionTransformer`.

Both ranks build the same seeded model and one copy is split by the plan: each rank keeps half of the 16 patch
tokens after the patch embedding, the self-attention runs on the whole sequence with 2 of the 4 heads (all-to-all
in and out), the cross-attention reads the whole caption (with a caption mask), and the prediction is gathered
before the unpatchify. Both train 5 AdamW steps on the same flow-matching batches (``x_t = (1 - s) x + s noise``,
velocity target ``noise - x``); the sp copy's gradients are averaged over the axis, as DDP / ZeRO average them over
``("dp", "sp")``. The loss, the averaged gradients and every parameter after each step agree.

Tolerances as test_dit_parallel.py's and for the same reasons: fp32; the sequence split changes the order of the
sums over tokens (weight gradients are summed per rank, then averaged), so losses and gradients are held to rtol
1e-5 / atol 1e-6 at the first step and atol 1e-5 later (weights then already differ by AdamW-amplified rounding);
parameters after AdamW to rtol 1e-5 / atol 1e-4. The key biases are left out of the parameter check: their exact
gradient is 0 (softmax ignores a score added to every key alike), so AdamW turns rounding into lr-sized steps of
either sign; the gradient check holds them at 0 within 1e-6. A split mistake (tokens in the wrong place, a wrong
gradient scale, the caption split) changes losses or gradients by O(1) relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.apps.models.dit import (
    DiffusionTransformer,
    DiTConfig,
    check_dit_sp_size,
    frame_positions,
    parallelize_dit_sequence,
)
from colo.comm import Mesh
from colo.comm.testing import run_distributed

STEPS, LR = 5, 1e-2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
LATER_GRAD_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
PARAM_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}
CONFIG = DiTConfig(
    num_attention_heads=4, attention_head_dim=12, num_layers=2, sample_size=8, patch_size=2,
    cross_attention_dim=48, caption_channels=24, use_additional_conditions=True, out_channels=4,
)  # fmt: skip


def _model() -> DiffusionTransformer:
    """The seeded model with every weight non-zero (PixArt's initialization zeroes the outputs)."""
    torch.manual_seed(0)
    return DiffusionTransformer(CONFIG)


def _batches(latent_shape: tuple[int, ...]):
    """Flow-matching batches: noisy latents, the caption (with padding), sigmas as timesteps, velocity targets."""
    generator = torch.Generator().manual_seed(5)
    batch = latent_shape[0]
    for _ in range(STEPS):
        clean = torch.randn(*latent_shape, generator=generator)
        noise = torch.randn(*latent_shape, generator=generator)
        sigmas = torch.rand(batch, generator=generator)
        sigma = sigmas.reshape(batch, *[1] * (len(latent_shape) - 1))
        noisy = (1 - sigma) * clean + sigma * noise
        caption = torch.randn(batch, 6, 24, generator=generator)
        mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2])[:batch]
        added = {"resolution": torch.tensor([[64.0, 64.0]] * batch), "aspect_ratio": torch.tensor([[1.0]] * batch)}
        kwargs = {"encoder_attention_mask": mask, "added_cond_kwargs": added}
        yield (noisy, caption, sigmas * 1000), kwargs, noise - clean


def _train_sp(latent_shape: tuple[int, ...]):
    mesh = Mesh(sp=2)
    group = mesh.group("sp")
    reference, model = _model(), _model()
    parallelize_dit_sequence(model, mesh=mesh)
    mismatches = []

    def compare(what, got, expected, tolerance):
        try:
            torch.testing.assert_close(got, expected, **tolerance)
        except AssertionError as error:
            mismatches.append(f"{what}: {error}")

    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (reference, model)]
    losses = []
    for step, (args, kwargs, target) in enumerate(_batches(latent_shape)):
        step_losses = []
        for module in (reference, model):
            loss = torch.nn.functional.mse_loss(module(*args, **kwargs), target)
            loss.backward()
            step_losses.append(loss.detach())
        for param in model.parameters():  # what DDP / ZeRO do over ("dp", "sp")
            dist.all_reduce(param.grad, group=group.process_group)
            param.grad /= group.size
        compare(f"loss step {step}", step_losses[1], step_losses[0], TOLERANCE)
        grad_tolerance = TOLERANCE if step == 0 else LATER_GRAD_TOLERANCE
        for name, param in model.named_parameters():
            compare(f"grad {name} step {step}", param.grad, reference.get_parameter(name).grad, grad_tolerance)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for name, param in model.named_parameters():
            if name.endswith("to_k.bias"):  # exact gradient 0: see the module docstring
                continue
            expected = reference.get_parameter(name).detach()
            compare(f"param {name} step {step}", param.detach(), expected, PARAM_TOLERANCE)
        losses.append(float(step_losses[1]))
    try:  # 3 tokens: refused on every rank before any communication
        added = {key: value[:1] for key, value in kwargs["added_cond_kwargs"].items()}
        model(torch.randn(1, 4, 2, 6), torch.randn(1, 6, 24), torch.ones(1), added_cond_kwargs=added)
        mismatches.append("a 3-token latent was not refused under sp=2")
    except ValueError as error:
        if "3 tokens" not in str(error) or "sp=2" not in str(error):
            mismatches.append(f"unexpected error: {error}")
    return mismatches, losses


def test_ulysses_sp2_trains_like_one_process():
    results = run_distributed(_train_sp, (3, 4, 8, 8), world_size=2, timeout=120)
    for mismatches, _ in results:
        assert not mismatches, "\n".join(mismatches[:5])
    assert results[0][1] == results[1][1]  # the gathered prediction: the same loss on both ranks


def test_video_latent_trains_under_ulysses_sp2_like_one_process():
    """A (batch, channels, frames, height, width) latent: 3 frames of 2 x 4 patches, 24 frame-major tokens, so the
    sp split falls inside the second frame; every token attends over all frames."""
    results = run_distributed(_train_sp, (2, 4, 3, 4, 8), world_size=2, timeout=120)
    for mismatches, _ in results:
        assert not mismatches, "\n".join(mismatches[:5])
    assert results[0][1] == results[1][1]


def test_video_frame_positions_are_diffusers_1d_sincos():
    from diffusers.models.embeddings import get_1d_sincos_pos_embed_from_grid

    expected = get_1d_sincos_pos_embed_from_grid(48, torch.arange(5), output_type="pt")
    torch.testing.assert_close(frame_positions(48, 5), expected.float(), rtol=1e-6, atol=1e-7)


def test_video_tokens_are_per_frame_patches_plus_frame_positions():
    """Frame t's tokens are the image path's tokens of frame t plus frame t's temporal position, frame-major; a
    token count sp does not divide is refused before any communication."""
    model = _model()
    video = torch.randn(2, 4, 3, 4, 8)
    tokens = model.pos_embed(video)
    per_frame = [model.pos_embed(video[:, :, t]) + frame_positions(48, 3)[t] for t in range(3)]
    torch.testing.assert_close(tokens, torch.cat(per_frame, dim=1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"\(batch, channels, frames, height, width\)"):
        model(torch.randn(2, 4, 1, 3, 4, 8), torch.randn(2, 6, 24), torch.ones(2))


def test_sp_size_must_divide_the_heads():
    with pytest.raises(ValueError, match=r"sp=3 does not divide DiTConfig.num_attention_heads=4 .* sp in \[1, 2, 4\]"):
        check_dit_sp_size(CONFIG, 3)
