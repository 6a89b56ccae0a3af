"""`colo.apps.runs` opens a trainer checkpoint as a model: a reward model's checkpoint as the frozen Llama with its
scalar head holding exactly the saved weights; checkpoints that are not what the caller asked for are refused with
a message naming them; and the package stands below the trainer and the recipes (it imports neither)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from colo.apps import Llama, get_preset
from colo.apps.models.llama import llama_state_dict_to_hf
from colo.apps.runs import RUN_KEY, load_llama, load_reward_model, pretrained_llama_config
from colo.tensor.checkpoint import save_checkpoint


def _save(path, model: Llama, *, task: str) -> None:
    """``model`` as the trainer saves it: Hugging Face names, the run metadata under `RUN_KEY`."""
    state = llama_state_dict_to_hf({k: v.detach() for k, v in model.state_dict().items()}, model.config)
    run = {"llama_config": dataclasses.asdict(model.config), "tokenizer": None, "config": {"data": {"task": task}}}
    save_checkpoint(str(path), state, metadata={"step": 1, RUN_KEY: run})


def _reward_model() -> Llama:
    from colo.apps.rlhf import make_reward_model

    model = Llama(get_preset("tiny", initializer_range=0.1, vocab_size=320))
    model.init_weights(1)
    return make_reward_model(model, seed=3)


def test_a_reward_checkpoint_opens_frozen_with_its_saved_weights(tmp_path):
    original = _reward_model()
    _save(tmp_path / "rm", original, task="rm")
    rng = torch.get_rng_state()
    model = load_reward_model(tmp_path / "rm")
    assert torch.equal(torch.get_rng_state(), rng)  # building the model drew nothing from the global generator
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tuple(model.lm_head.weight.shape) == (1, model.config.hidden_size)
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    ids = torch.tensor([[7, 8, 9, 20, 21]])
    with torch.no_grad():  # the same weights through the same ops in one process: the same rewards, bit for bit
        torch.testing.assert_close(model(ids, return_logits=True).logits, original(ids, return_logits=True).logits,
                                   rtol=0, atol=0)  # fmt: skip


def test_a_language_model_checkpoint_is_not_a_reward_model(tmp_path):
    model = Llama(get_preset("tiny", vocab_size=320))
    _save(tmp_path / "lm", model, task="pretrain")
    with pytest.raises(ValueError, match=r"lm.* holds no reward head .*data.task='rm'"):
        load_reward_model(tmp_path / "lm")
    loaded, run = load_llama(tmp_path / "lm")
    assert run["config"]["data"]["task"] == "pretrain" and loaded.config == model.config


def test_a_checkpoint_without_run_metadata_is_named(tmp_path):
    save_checkpoint(str(tmp_path / "other"), {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"other has no 'run' metadata: it was not written by colo's trainer"):
        load_llama(tmp_path / "other")
    with pytest.raises(ValueError, match=r"model.init_from=.*other' has no 'run' metadata"):
        pretrained_llama_config(tmp_path / "other")


def test_runs_imports_neither_the_trainer_nor_a_recipe():
    probe = (
        "import sys, colo.apps.runs, colo.apps.generation; "
        "print(sorted(m for m in sys.modules if m.startswith(('colo.apps.train', 'colo.apps.rlhf', "
        "'colo.apps.diffusion', 'colo.apps.serving'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
