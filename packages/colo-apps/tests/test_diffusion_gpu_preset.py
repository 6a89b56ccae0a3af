"""The ``sd15-diffusion`` GPU preset: its run config validates for 8 GPUs and builds Stable Diffusion 1.5's UNet
(SD-1.5's published ``unet/config.json``, 859,520,964 parameters) on the meta device, so no memory is taken.
Not run here: it needs GPUs and SD-1.5's text encoder, tokenizer and VAE in local directories."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

SD15_UNET_PARAMETERS = 859_520_964  # runwayml/stable-diffusion-v1-5 unet: the published count
SD15_UNET_CONFIG = {  # the fields of SD-1.5's unet/config.json (diffusers' names)
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 768,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "act_fn": "silu",
    "center_input_sample": False,
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "use_linear_projection": False,
}


def test_the_sd15_preset_builds_sd15s_unet_for_8_gpus():
    from colo.apps.diffusion import build_unet
    from colo.apps.train import load_config

    config = load_config(preset="sd15-diffusion")
    plugin, section = config.plugin, config.diffusion
    assert (plugin.name, plugin.stage, plugin.precision) == ("zero", 2, "bf16")  # ZeRO-2 over dp8, bf16 compute
    assert config.data.global_batch_size % (8 * config.schedule.num_microbatches) == 0  # divides over 8 ranks
    assert config.data.task == "diffusion" and section.image_size == 512 and section.resize == 512
    for field in ("text_encoder_from", "tokenizer_from", "vae_from"):  # pretrained, local: nothing downloads
        assert getattr(section, field), field
    assert section.gradient_checkpointing  # 8 images of 512 px per GPU and microbatch

    model_config = section.model_config_object()
    with torch.device("meta"):
        unet = build_unet(model_config, seed=config.seed + 3)
    built = dict(unet.config)
    assert {name: built[name] for name in SD15_UNET_CONFIG} == SD15_UNET_CONFIG
    assert all(p.device.type == "meta" for p in unet.parameters())
    assert sum(p.numel() for p in unet.parameters()) == SD15_UNET_PARAMETERS
    # the latents the preset's VAE makes of 512 x 512 images are what the UNet takes; its text width is CLIP-L's
    assert model_config.latent_size == built["sample_size"] == 64
    assert section.text_hidden_size == built["cross_attention_dim"] == 768
    assert section.max_caption_tokens == 77  # CLIP's context; the pretrained tokenizer brings its own


def test_unknown_unet_config_fields_are_refused():
    from colo.apps.diffusion import build_unet
    from colo.apps.train.config import RunConfig

    config = RunConfig(data={"task": "diffusion"}, diffusion={"unet_config": {"block_channels": [32, 64]}})
    with pytest.raises(ValueError, match=r"diffusion.unet_config names \['block_channels'\], which are not"):
        build_unet(config.diffusion.model_config_object())
