"""`parallelize_dit` with tp=2 trains like the unsharded `DiffusionTransformer`.

Both ranks build the same seeded model, one copy is sharded by `dit_tp_plan` (column-parallel q / k / v and MLP in,
row-parallel attention out and MLP out, in every block's self- and cross-attention), and both train 3 AdamW steps
on the same flow-matching-shaped batches with a caption mask: the loss, every gradient (each rank's against its
slice of the reference gradient) and every parameter after each step agree.

Tolerances as test_llama_parallel.py's, for the same reasons: fp32, losses and gradients rtol 1e-5 / atol 1e-6; the
row-parallel projections sum partial products over the ranks and the column-parallel input gradients are summed
over ranks, so fp32 additions run in another order. Parameters after AdamW: rtol 1e-5 / atol 1e-4 (AdamW moves a
weight by ~lr whatever the gradient's size, so near-zero gradients amplify rounding); a sharding mistake changes
gradients by O(1) relative and fails the gradient check first. The key biases (``to_k.bias``) are left out of the
parameter check: softmax ignores a score added to every key alike, and ``q . b_k`` is one, so their exact gradient is
0 and what autograd returns is rounding (~1e-9) that AdamW turns into lr-sized steps of either sign; the gradient
check holds them at 0 within 1e-6 on both sides. Gradients of the first step are held to atol 1e-6; those of later
steps, taken at weights that already differ by that AdamW-amplified rounding (up to 1e-4), to atol 1e-5 (measured:
1.8e-6 on the timestep MLP, whose gradients average 3e-3; it sums every block's six modulations over every token).
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.models.dit import DiffusionTransformer, DiTConfig, check_dit_tp_size, parallelize_dit
from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import layout_of

STEPS, LR = 3, 1e-2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}
LATER_GRAD_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # after an AdamW step the weights differ too: see the docstring
CONFIG = DiTConfig(
    num_attention_heads=4, attention_head_dim=12, num_layers=2, sample_size=8, patch_size=2,
    cross_attention_dim=48, caption_channels=24, use_additional_conditions=True, out_channels=4,
)  # fmt: skip


def _model() -> DiffusionTransformer:
    """The seeded model with every weight non-zero (PixArt's initialization zeroes the outputs: no gradient would
    reach the cross-attention's q / k / v in the first step)."""
    torch.manual_seed(0)
    return DiffusionTransformer(CONFIG)


def _batches():
    generator = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        latents = torch.randn(3, 4, 8, 8, generator=generator)
        caption = torch.randn(3, 6, 24, generator=generator)
        timesteps = torch.rand(3, generator=generator) * 1000
        mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2])
        added = {"resolution": torch.tensor([[64.0, 64.0]] * 3), "aspect_ratio": torch.tensor([[1.0]] * 3)}
        target = torch.randn(3, 4, 8, 8, generator=generator)
        yield (latents, caption, timesteps), {"encoder_attention_mask": mask, "added_cond_kwargs": added}, target


def _train_tp():
    mesh = Mesh(tp=2)
    reference, model = _model(), _model()
    parallelize_dit(model, mesh=mesh)
    mismatches = []

    def compare(what, got, expected):
        tolerance = PARAM_TOLERANCE if what.startswith("param") else TOLERANCE
        if what.startswith("grad") and not what.endswith("step 0"):
            tolerance = LATER_GRAD_TOLERANCE
        try:
            torch.testing.assert_close(got, expected, **tolerance)
        except AssertionError as error:
            mismatches.append(f"{what}: {error}")

    sharded = sorted(
        name for name, param in model.named_parameters() if param.shape != reference.get_parameter(name).shape
    )
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (reference, model)]
    for step, (args, kwargs, target) in enumerate(_batches()):
        losses = []
        for module in (reference, model):
            loss = torch.nn.functional.mse_loss(module(*args, **kwargs), target)
            loss.backward()
            losses.append(loss.detach())
        compare(f"loss step {step}", losses[1], losses[0])
        for name, param in model.named_parameters():
            expected = layout_of(param).local_slice(reference.get_parameter(name).grad)
            compare(f"grad {name} step {step}", param.grad, expected)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for name, param in model.named_parameters():
            if name.endswith("to_k.bias"):  # exact gradient 0: see the module docstring
                continue
            expected = layout_of(param).local_slice(reference.get_parameter(name).detach())
            compare(f"param {name} step {step}", param.detach(), expected)
    return mismatches, sharded


def test_tp2_trains_like_one_process():
    results = run_distributed(_train_tp, world_size=2, timeout=120)
    for mismatches, _ in results:
        assert not mismatches, "\n".join(mismatches[:5])
    sharded = results[0][1]
    per_block = [name for name in sharded if name.startswith("transformer_blocks.0.")]
    # q / k / v / out weights and q / k / v biases of two attentions, the MLP's two weights and first bias
    assert len(per_block) == 2 * (4 + 3) + 3, per_block
    assert not any(name.startswith(("adaln_single", "caption_projection", "pos_embed", "proj_out")) for name in sharded)


def test_tp_size_must_divide_the_heads():
    with pytest.raises(ValueError, match=r"tp=3 does not divide DiTConfig.num_attention_heads=4 .* tp in \[1, 2, 4\]"):
        check_dit_tp_size(CONFIG, 3)
