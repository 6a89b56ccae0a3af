#!/usr/bin/env python3
"""Where one process's DiT training step goes on CPU: colo's `DiffusionTransformer` against diffusers'
``PixArtTransformer2DModel`` (same weights, `diffusion_dit_train.py`'s shape: 6 blocks of 384, 6 heads of 64, 8 x 8
latents, 8 images, 16 caption tokens of 32), forward + backward of a squared-output loss, one thread, fp32 (issue 45).

colo's DiT runs its attention and LayerNorms through `colo.kernels`, whose CPU path is the torch reference (attention
as explicit fp32 einsums and softmax, its backward recomputing the scores; LayerNorm in elementwise ops); diffusers
runs ``scaled_dot_product_attention`` (torch's fused CPU flash kernel) and ``nn.LayerNorm`` (aten's fused kernel).
To size that difference the script times, interleaved over ``--repeats`` with medians:

- ``colo``: the DiT as it is;
- ``colo_sdpa_attention``: the same weights with each block's attention core replaced by SDPA;
- ``colo_sdpa_aten_layer_norm``: that, and ``torch.nn.functional.layer_norm`` for colo.kernels' ``layer_norm``;
- ``diffusers``: ``PixArtTransformer2DModel``.

The outputs of all four agree to fp32 rounding (printed). With ``--profile`` it prints torch.profiler's table (ops
by self CPU time) of ``colo`` and ``diffusers`` over 3 steps. A measurement tool, not a colo code path: the
replacements are made here, on copies of the model.

Run::

    python benchmarks/diffusion_dit_cpu_paths.py [--repeats 7] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class SDPACore(nn.Module):
    """SDPA on colo's ``(batch, seq, heads, head_dim)`` layout (no masks: the benchmark's captions have none)."""

    def forward(self, q, k, v, *, document_ids=None):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class AtenLayerNorm(nn.Module):
    """Runs the wrapped DiT with its module's ``layer_norm`` bound to ``torch.nn.functional.layer_norm``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        from colo.apps.models.dit import model as dit_module

        original = dit_module.layer_norm
        dit_module.layer_norm = lambda x, weight, bias, eps: F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        try:
            return self.model(*inputs)
        finally:
            dit_module.layer_norm = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from diffusers import PixArtTransformer2DModel

    from colo.apps.diffusion.models import build_dit
    from colo.apps.models.dit import DiTConfig

    torch.set_num_threads(1)
    config = DiTConfig(
        num_attention_heads=6, attention_head_dim=64, num_layers=6, sample_size=8, patch_size=1,
        cross_attention_dim=384, caption_channels=32,
    )  # fmt: skip
    colo = build_dit(config, seed=3).train()
    with torch.no_grad():  # PixArt's initialization zeroes the output projection: perturb so outputs are not 0
        generator = torch.Generator().manual_seed(0)
        for param in colo.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    peer = PixArtTransformer2DModel(**config.diffusers_config())
    peer.load_state_dict(colo.state_dict(), strict=True)
    peer.train()
    sdpa = copy.deepcopy(colo)
    for block in sdpa.transformer_blocks:
        block.attn1.core, block.attn2.core = SDPACore(), SDPACore()
    aten = AtenLayerNorm(copy.deepcopy(sdpa))

    generator = torch.Generator().manual_seed(1)
    latents, captions = torch.randn(8, 4, 8, 8, generator=generator), torch.randn(8, 16, 32, generator=generator)
    timesteps = torch.rand(8, generator=generator) * 1000

    def colo_step(model):
        model.zero_grad(set_to_none=True)
        out = model(latents, captions, timesteps)
        out.square().mean().backward()
        return out

    def peer_step(model):
        model.zero_grad(set_to_none=True)
        out = model(
            latents, encoder_hidden_states=captions, timestep=timesteps,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False,
        )[0]  # fmt: skip
        out.square().mean().backward()
        return out

    rows = {
        "colo": (colo_step, colo),
        "colo_sdpa_attention": (colo_step, sdpa),
        "colo_sdpa_aten_layer_norm": (colo_step, aten),
        "diffusers": (peer_step, peer),
    }
    outputs = {name: step(model).detach() for name, (step, model) in rows.items()}
    print("max |output - colo's|:", {name: float((out - outputs["colo"]).abs().max()) for name, out in outputs.items()})
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in ("colo", "diffusers"):
            step, model = rows[name]
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                for _ in range(3):
                    step(model)
            print(f"===== {name}, 3 steps")
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    times = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, (step, model) in rows.items():
            begin = time.perf_counter()
            step(model)
            times[name].append(time.perf_counter() - begin)
    base = statistics.median(times["diffusers"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name}: median {median:.3f} s per step, {base / median:.2f}x diffusers' speed")


if __name__ == "__main__":
    main()
