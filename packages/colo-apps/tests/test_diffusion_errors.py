"""Bad input to the diffusion recipe gets a clear error naming the field and the fix."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")


def test_images_of_mixed_sizes_need_a_resize_setting(tmp_path):
    from PIL import Image

    from colo.apps.diffusion import ImageCaptionFolder

    for name, size in [("a.png", (16, 16)), ("b.png", (24, 16))]:
        Image.new("RGB", size, (255, 0, 0)).save(tmp_path / name)
    (tmp_path / "metadata.jsonl").write_text(
        "\n".join(json.dumps({"file_name": n, "text": "a red square"}) for n in ("a.png", "b.png"))
    )
    with pytest.raises(ValueError, match=r"mixed sizes: 16x16 \(a.png\), 24x16 \(b.png\); set diffusion.resize"):
        ImageCaptionFolder(tmp_path)
    resized = ImageCaptionFolder(tmp_path, resize=8)
    assert resized[1]["pixel_values"].shape == (3, 8, 8)
    assert torch.allclose(resized[1]["pixel_values"][0], torch.ones(8, 8))  # red stays red


def test_captions_longer_than_the_text_encoder_are_refused(tmp_path):
    from colo.apps.diffusion import caption_vocabulary, save_caption_tokenizer, tokenize_captions

    tokenizer = save_caption_tokenizer(caption_vocabulary(), tmp_path, max_length=8)
    ids = tokenize_captions(tokenizer, ["a red circle on blue"])
    assert ids.shape == (1, 8) and int((ids[0] != tokenizer.pad_token_id).sum()) == 6  # BOS + one token a word
    with pytest.raises(ValueError, match="more than the text encoder's maximum 8; shorten it"):
        tokenize_captions(tokenizer, ["a red circle on blue a red circle on blue"])


def test_bad_objective_and_sizes_name_the_field():
    from pydantic import ValidationError

    from colo.apps.diffusion import DiffusionObjective
    from colo.apps.train.config import RunConfig

    with pytest.raises(ValueError, match="prediction_type='flow' is unknown"):
        DiffusionObjective(prediction_type="flow")
    with pytest.raises(ValidationError, match="prediction_type"):
        RunConfig(data={"task": "diffusion"}, diffusion={"prediction_type": "sample"})
    with pytest.raises(ValidationError, match="not divisible by norm_num_groups=8"):
        RunConfig(data={"task": "diffusion"}, diffusion={"unet_channels": [12, 24]})
