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


def _trainer_outcomes(root):
    """On every rank: a pretrained text encoder with its tokenizer (tokenizer_from) builds the trainer; one whose
    vocabulary the caption tokenizer overruns, or whose width is not the UNet's, is refused."""
    import os

    from transformers import CLIPTokenizer

    from colo.apps.diffusion import build_text_encoder, caption_vocabulary, save_caption_tokenizer
    from colo.apps.diffusion.testing import tiny_config, tiny_run_config
    from colo.apps.train import Trainer

    def pretrained(name, words, hidden):
        tokenizer = save_caption_tokenizer(words, os.path.join(root, name, "tokenizer"), max_length=16)
        model_config = tiny_config()
        model_config.text_hidden_size = hidden
        encoder = build_text_encoder(model_config, tokenizer, seed=1)
        encoder.save_pretrained(os.path.join(root, name, "text_encoder"))

    if torch.distributed.get_rank() == 0:
        pretrained("wide", [*caption_vocabulary(), "zebra", "giraffe", "octagon"], 16)
        pretrained("small", ["a", "red"], 16)
        pretrained("width32", caption_vocabulary(), 32)
    torch.distributed.barrier()
    wide = CLIPTokenizer.from_pretrained(os.path.join(root, "wide", "tokenizer"))
    outcomes = {}
    for case, tokenizer_from in [("wide", True), ("small", False), ("width32", False)]:
        fields = {"text_encoder_from": os.path.join(root, case, "text_encoder"), "ema_decay": None}
        if tokenizer_from:
            fields["tokenizer_from"] = os.path.join(root, case, "tokenizer")
        config = tiny_run_config(os.path.join(root, f"run-{case}"), plugin={"name": "ddp"}, **fields)
        try:
            trainer = Trainer(config)
        except ValueError as error:
            outcomes[case] = str(error)
        else:
            outcomes[case] = trainer.task.tokenizer.get_vocab() == wide.get_vocab() and os.path.exists(
                os.path.join(config.output_dir, "tokenizer", "tokenizer_config.json")
            )
    return outcomes


def test_a_pretrained_text_encoder_takes_its_tokenizer_and_must_fit_the_unet(tmp_path):
    from colo.comm.testing import run_distributed

    outcomes, other = run_distributed(_trainer_outcomes, str(tmp_path), world_size=2, timeout=120)
    assert other == outcomes  # every rank reads the same directories and refuses alike
    assert outcomes["wide"] is True  # the run's tokenizer is the pretrained one (copied to output_dir/tokenizer)
    assert "but the text encoder" in outcomes["small"] and "set diffusion.tokenizer_from" in outcomes["small"]
    assert "hidden_size is 32 but the UNet's cross_attention_dim is 16" in outcomes["width32"]


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_every_trainable_objective_is_one_the_exported_pipeline_samples(prediction_type):
    """The export refuses objectives its pipeline cannot sample (export.SAMPLEABLE); every DDPM prediction type the
    run config accepts is one of them: this pins that (a new one must be added to both or be refused) and samples each
    through the pipeline the export writes. ``diffusion.objective: flow_matching`` is refused as a whole
    (test_diffusion_flow_matching.py)."""
    import typing

    from colo.apps.diffusion import DiffusionObjective
    from colo.apps.diffusion.config import DiffusionSection
    from colo.apps.diffusion.export import SAMPLEABLE
    from colo.apps.diffusion.objective import PREDICTION_TYPES
    from colo.apps.diffusion.sampling import build_pipeline
    from colo.apps.diffusion.testing import components

    accepted = typing.get_args(DiffusionSection.model_fields["prediction_type"].annotation)
    assert set(accepted) == set(PREDICTION_TYPES) == set(SAMPLEABLE)
    _, tokenizer, text_encoder, vae, unet = components()
    objective = DiffusionObjective(prediction_type=prediction_type)
    pipeline = build_pipeline(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, objective=objective)
    assert pipeline.scheduler.config.prediction_type == prediction_type
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(["a red circle on white"], num_inference_steps=2, height=16, width=16, output_type="pt").images
    assert images.shape == (1, 3, 16, 16) and torch.isfinite(images).all()
