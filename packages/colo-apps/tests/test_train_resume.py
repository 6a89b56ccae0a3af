"""The trainer on 2 processes: a run stopped after a checkpoint and resumed with ``resume: auto`` reproduces the
uninterrupted run's losses exactly (fp32, same layout: same data position, optimizer, LR schedule and RNG), and
only the newest ``keep_last`` checkpoints remain. Plus the run's outputs: metrics JSONL, a sample, and the final
checkpoint loading into one process and converting to Hugging Face names."""

from __future__ import annotations

import json
import os

import pytest

from colo.comm.testing import run_distributed

TOTAL_STEPS, EVERY, STOP = 20, 5, 12


def write_corpus(root) -> str:
    """A few small text files (about 24 KB): enough for 20 steps of 8 x 32 tokens without repeating an epoch."""
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(6):
        lines = [f"def function_{index}_{n}(x):\n    return x * {n} + {index}  # line {n}\n" for n in range(80)]
        (corpus / f"doc{index}.py").write_text("".join(lines))
    return str(corpus)


def run_config(corpus: str, output_dir: str, plugin: dict, **schedule) -> dict:
    return {
        "name": "resume-test",
        "output_dir": output_dir,
        "seed": 3,
        "model": {"preset": "tiny"},
        "plugin": plugin,
        "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
        "schedule": {"total_steps": TOTAL_STEPS, "warmup_steps": 4, "min_lr": 3e-4, **schedule},
        "data": {"paths": [corpus], "seq_len": 32, "global_batch_size": 8},
        "checkpoint": {"every_steps": EVERY, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 5, "progress_bar": False, "tensorboard": False},
        "eval": {"every_steps": 10, "num_sequences": 8, "batch_size": 2},
        "sample": {"prompt": "def ", "max_new_tokens": 8},
    }


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {
        "losses": result.losses,
        "eval_losses": result.eval_losses,
        "start_step": result.start_step,
        "resumed_from": result.resumed_from,
        "sample": result.sample,
    }


PLUGINS = {
    "ddp": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0},
    "zero1": {"name": "zero", "stage": 1, "precision": "fp32", "max_grad_norm": 1.0},
}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, plugin):
    corpus = write_corpus(tmp_path)
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")

    straight = run_distributed(_train, run_config(corpus, straight_dir, PLUGINS[plugin]), world_size=2)[0]
    stopped = run_distributed(
        _train, run_config(corpus, resumed_dir, PLUGINS[plugin], stop_at_step=STOP), world_size=2
    )[0]
    resumed = run_distributed(_train, run_config(corpus, resumed_dir, PLUGINS[plugin]), world_size=2)[0]

    assert sorted(straight["losses"]) == list(range(1, TOTAL_STEPS + 1))
    assert straight["losses"][TOTAL_STEPS] < straight["losses"][1]
    assert sorted(stopped["losses"]) == list(range(1, STOP + 1))
    # the stop came 2 steps after the step-10 checkpoint: those steps are redone, from the checkpoint's state
    last_checkpoint = STOP // EVERY * EVERY
    assert resumed["start_step"] == last_checkpoint
    assert resumed["resumed_from"].endswith(f"step-{last_checkpoint:08d}")
    assert sorted(resumed["losses"]) == list(range(last_checkpoint + 1, TOTAL_STEPS + 1))
    # bit for bit (fp32, same layout): == on floats, not a tolerance
    for step, loss in stopped["losses"].items():
        assert loss == straight["losses"][step], step
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step
    assert resumed["eval_losses"][20] == straight["eval_losses"][20]
    assert resumed["sample"] == straight["sample"] and straight["sample"].startswith("def ")

    # keep_last=2: only the two newest checkpoints are left
    assert sorted(os.listdir(os.path.join(straight_dir, "checkpoints"))) == ["step-00000015", "step-00000020"]
    records = [json.loads(line) for line in open(os.path.join(straight_dir, "metrics.jsonl"))]
    logged = [r["step"] for r in records if "loss" in r]
    assert logged == [5, 10, 15, 20]
    assert [r["step"] for r in records if "eval_loss" in r] == [10, 20]


def test_final_checkpoint_loads_in_one_process_and_converts_to_hf(tmp_path):
    import safetensors.torch
    import torch

    from colo.apps.runs import export_llama_hf, load_llama

    corpus = write_corpus(tmp_path)
    output = str(tmp_path / "run")
    config = run_config(corpus, output, PLUGINS["zero1"], total_steps=5, warmup_steps=1)
    run_distributed(_train, config, world_size=2)
    checkpoint = os.path.join(output, "checkpoints", "step-00000005")

    model, run = load_llama(checkpoint)
    assert run["step"] == 5 and run["llama_config"]["hidden_size"] == 64
    files = export_llama_hf(checkpoint, tmp_path / "hf")
    tensors = safetensors.torch.load_file(files[0])
    assert "model.layers.0.self_attn.q_proj.weight" in tensors and "lm_head.weight" in tensors
    assert not any(name.startswith("optim/") for name in tensors)
    q_rows = model.config.num_attention_heads * model.config.head_dim
    torch.testing.assert_close(
        tensors["model.layers.1.self_attn.q_proj.weight"],
        model.layers["1"].self_attn.qkv_proj.weight[:q_rows],
        rtol=0,
        atol=0,
    )
    hf_config = json.load(open(os.path.join(tmp_path, "hf", "config.json")))
    assert hf_config["model_type"] == "llama" and hf_config["vocab_size"] == model.config.vocab_size


def test_background_saves_write_the_bytes_foreground_saves_write(tmp_path):
    # checkpoint.async_save (the default, used by the resume test above) against blocking saves: the same files with
    # the same bytes (tensors, CRCs, metadata but the config's own async_save field)
    corpus = write_corpus(tmp_path)
    outputs = {}
    for async_save in (True, False):
        output = str(tmp_path / f"async-{async_save}")
        config = run_config(corpus, output, PLUGINS["zero1"], total_steps=10)
        config["checkpoint"]["async_save"] = async_save
        run_distributed(_train, config, world_size=2)
        outputs[async_save] = os.path.join(output, "checkpoints")
    assert sorted(os.listdir(outputs[True])) == sorted(os.listdir(outputs[False])) == ["step-00000005", "step-00000010"]
    for step in os.listdir(outputs[True]):
        names = sorted(os.listdir(os.path.join(outputs[True], step)))
        assert names == sorted(os.listdir(os.path.join(outputs[False], step)))
        for name in names:
            background = open(os.path.join(outputs[True], step, name), "rb").read()
            foreground = open(os.path.join(outputs[False], step, name), "rb").read()
            if name.endswith(".json"):  # the run config inside differs in async_save (and its output_dir)
                background, foreground = (
                    json.dumps(_without_run_config(json.loads(text))) for text in (background, foreground)
                )
            assert background == foreground, (step, name)


def _without_run_config(value):
    if isinstance(value, dict):
        return {key: _without_run_config(item) for key, item in value.items() if key != "config"}
    if isinstance(value, list):
        return [_without_run_config(item) for item in value]
    return value
