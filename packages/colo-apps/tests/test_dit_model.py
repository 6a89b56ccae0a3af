"""colo's diffusion transformer equals diffusers' ``PixArtTransformer2DModel`` on the same weights, and its presets
have PixArt-alpha's shapes."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from colo.apps.models.dit import DiffusionTransformer, DiTConfig, get_preset  # noqa: E402


def _pair(config: DiTConfig, seed: int = 0):
    """diffusers' model (its own random init) and colo's with the same weights, loaded strictly."""
    torch.manual_seed(seed)
    reference = diffusers.PixArtTransformer2DModel(**config.diffusers_config()).eval()
    ours = DiffusionTransformer(config)
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


@pytest.mark.parametrize("micro_conditions", [False, True], ids=["plain", "micro-conditions"])
def test_dit_equals_pixart_transformer(micro_conditions):
    """Same weights, latents (non-square, so the positional embedding is interpolated), fractional timesteps, caption
    states and a caption mask (one caption full, one half padded, one with a single kept token): outputs and input
    gradients equal diffusers' (fp32; differences are summation order: the kernels' attention vs SDPA)."""
    config = DiTConfig(
        num_attention_heads=2,
        attention_head_dim=24,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=48,
        caption_channels=20,
        out_channels=8,
        use_additional_conditions=micro_conditions,
    )
    reference, ours = _pair(config)
    assert set(ours.state_dict()) == set(reference.state_dict())
    assert DiTConfig.from_diffusers(dict(reference.config)) == config  # and back from diffusers' saved config
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(3, 4, 8, 6, generator=generator)
    caption = torch.randn(3, 7, 20, generator=generator)
    timesteps = torch.tensor([1.0, 500.5, 999.0])
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [1] + [0] * 6])
    added = None
    if micro_conditions:
        added = {"resolution": torch.tensor([[64.0, 48.0]] * 3), "aspect_ratio": torch.tensor([[0.75]] * 3)}
    inputs = [latents.clone().requires_grad_(), latents.clone().requires_grad_()]
    expected = reference(
        inputs[0], encoder_hidden_states=caption, timestep=timesteps, encoder_attention_mask=mask,
        added_cond_kwargs=added, return_dict=False,
    )[0]  # fmt: skip
    got = ours(inputs[1], caption, timesteps, encoder_attention_mask=mask, added_cond_kwargs=added)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    expected.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad, rtol=1e-5, atol=1e-5)
    # the mask matters: without it the half-padded caption's output changes
    unmasked = ours(latents, caption, timesteps, added_cond_kwargs=added)
    assert (unmasked[1] - got[1]).abs().max() > 1e-3
    torch.testing.assert_close(unmasked[0], got[0], rtol=1e-5, atol=2e-6)


def test_dit_without_caption_projection_and_initialization():
    """``caption_channels=None`` (cross-attention reads the text states as they are) equals diffusers too; PixArt's
    initialization zeroes the output, the cross-attention outputs, and only those."""
    config = DiTConfig(
        num_attention_heads=2, attention_head_dim=16, num_layers=1, sample_size=4, patch_size=1,
        cross_attention_dim=12, caption_channels=None,
    )  # fmt: skip
    reference, ours = _pair(config, seed=3)
    latents, caption = torch.randn(2, 4, 4, 4), torch.randn(2, 5, 12)
    with torch.no_grad():
        timesteps = torch.tensor([7, 7])
        expected = reference(latents, encoder_hidden_states=caption, timestep=timesteps, return_dict=False)[0]
        torch.testing.assert_close(ours(latents, caption, torch.tensor(7)), expected, rtol=1e-5, atol=2e-6)
        torch.manual_seed(0)
        ours.initialize_weights()
        assert ours(latents, caption, torch.tensor(7)).abs().max() == 0
    assert ours.proj_out.weight.abs().max() == 0 and ours.transformer_blocks[0].attn2.to_out[0].weight.abs().max() == 0
    assert 0.01 < ours.adaln_single.linear.weight.std() < 0.03
    assert ours.transformer_blocks[0].attn1.to_q.weight.abs().max() > 0


def test_dit_rejects_bad_input():
    with pytest.raises(ValueError, match="patch_size=3 must divide sample_size=8"):
        DiTConfig(sample_size=8, patch_size=3)
    with pytest.raises(ValueError, match="cross_attention_dim=64 must equal the hidden size 1152"):
        DiTConfig(cross_attention_dim=64)
    model = DiffusionTransformer(
        DiTConfig(num_attention_heads=1, attention_head_dim=16, num_layers=1, sample_size=4, cross_attention_dim=16,
                  caption_channels=8)
    )  # fmt: skip
    with pytest.raises(ValueError, match="pad captions on the right"):
        model(torch.randn(1, 4, 4, 4), torch.randn(1, 3, 8), torch.tensor([1.0]),
              encoder_attention_mask=torch.tensor([[0, 1, 1]]))  # fmt: skip


@pytest.mark.parametrize("name", ["pixart-alpha-1024", "pixart-alpha-512"])
def test_pixart_alpha_presets_on_meta(name):
    """The GPU presets build on the meta device (no memory) with diffusers' names and shapes: PixArt-alpha XL/2,
    28 x 1152, 16 heads, patch 2, ~600M parameters (4 output channels: flow matching learns no variance)."""
    config = get_preset(name)
    with torch.device("meta"):
        ours = DiffusionTransformer(config)
        reference = diffusers.PixArtTransformer2DModel(**config.diffusers_config())
    shapes = {name: tuple(p.shape) for name, p in ours.state_dict().items()}
    assert shapes == {name: tuple(p.shape) for name, p in reference.state_dict().items()}
    count = sum(p.numel() for p in ours.parameters())
    assert config.hidden_size == 1152 and config.num_layers == 28
    assert 590e6 < count < 620e6, count


def test_dit_on_the_triton_kernels_equals_pixart_transformer():
    """The kernels' Triton path (flash attention with the caption's document mask, non-causal, queries and keys of
    different lengths; LayerNorm), run by Triton's interpreter on CPU, gives diffusers' output and input gradient."""
    from colo.kernels import triton_available, use_backend

    if not triton_available():
        pytest.skip("triton is not installed")
    config = DiTConfig(
        num_attention_heads=2, attention_head_dim=16, num_layers=1, sample_size=4, patch_size=1,
        cross_attention_dim=32, caption_channels=8,
    )  # fmt: skip
    reference, ours = _pair(config)
    latents, caption = torch.randn(2, 4, 4, 4), torch.randn(2, 5, 8)
    timesteps, mask = torch.tensor([3.0, 700.0]), torch.tensor([[1, 1, 1, 0, 0], [1] * 5])
    inputs = [latents.clone().requires_grad_(), latents.clone().requires_grad_()]
    expected = reference(
        inputs[0], encoder_hidden_states=caption, timestep=timesteps, encoder_attention_mask=mask, return_dict=False
    )[0]
    with use_backend("triton"):
        got = ours(inputs[1], caption, timesteps, encoder_attention_mask=mask)
        got.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad, rtol=1e-5, atol=1e-5)
