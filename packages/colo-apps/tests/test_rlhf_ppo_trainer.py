"""``data.task: ppo`` in the one trainer: bad input named, the reward model read from a ``data.task: rm``
checkpoint, and a short 2-process run that logs PPO's metrics and resumes exactly (actor, critic, both optimizers and
the KL controller)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from colo.apps.train.metrics import step_line
from colo.comm.testing import run_distributed


def _save_reward_checkpoint(path: str, *, task: str = "rm", tokenizer=None):
    """A trainer-style checkpoint of a reward model (the HF names, the run metadata the trainer writes)."""
    from colo.apps import Llama, get_preset
    from colo.apps.models.llama.hf import llama_state_dict_to_hf
    from colo.apps.rlhf import make_reward_model
    from colo.apps.runs import RUN_KEY
    from colo.tensor.checkpoint import save_checkpoint

    model = Llama(get_preset("tiny", initializer_range=0.1, vocab_size=320))
    model.init_weights(1)
    make_reward_model(model, seed=3)
    state = llama_state_dict_to_hf({k: v.detach() for k, v in model.state_dict().items()}, model.config)
    run = {"llama_config": dataclasses.asdict(model.config), "tokenizer": tokenizer, "config": {"data": {"task": task}}}
    save_checkpoint(path, state, metadata={"step": 1, RUN_KEY: run})
    return model


def test_bad_ppo_runs_name_the_field(tmp_path):
    from colo.apps.rlhf.ppo_task import PPOTask
    from colo.apps.train import ConfigError, load_config

    config = load_config(preset="tiny-ppo")
    assert config.data.task == "ppo" and config.ppo.critic == "separate"
    cases = [
        (["ppo.critic_plugin={name: hybrid, tp: 2}"], "a hybrid critic runs on the actor's mesh"),
        (["ppo.critic_plugin={name: gemini}"], "name='gemini' cannot hold the critic"),
        (["ppo.critic_plugin={name: nothing}"], "ppo.critic_plugin=.* is not a plugin section"),
        (["ppo.critic=shared", "ppo.critic_plugin={name: ddp}"], "drop ppo.critic_plugin"),
        (["plugin.name=hybrid", "plugin.tp=2", "plugin.pp=2", "schedule.num_microbatches=2"], "set plugin.tp=1"),
        (["ppo.synthetic_prompts=0"], "needs data.paths"),
        (["ppo.sft_steps=600"], "leaves no PPO step"),
        (["ppo.reward_functions=[]"], "give the policy a reward"),
        (["ppo.dual_clip=0.5"], "dual_clip"),
        (["ppo.minibatches=3"], "do not split into ppo.minibatches=3"),
        (["lora.enabled=true"], "with LoRA is not supported"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(preset="tiny-ppo", overrides=overrides)
    with pytest.raises(ConfigError, match="only with data.task='ppo'"):
        load_config(preset="tiny-grpo", overrides=["ppo.kl_coef=0.1"])
    # a critic layout the trainer can build: ZeRO-3 beside the DDP actor
    from colo.apps.rlhf.specs import critic_plugin_section

    assert critic_plugin_section(load_config(preset="tiny-ppo", overrides=["ppo.critic_plugin={name: zero, stage: 3}"]))

    _save_reward_checkpoint(str(tmp_path / "other"), tokenizer=str(tmp_path / "their-tokenizer.json"))
    _save_reward_checkpoint(str(tmp_path / "sft"), task="sft")
    for path, message in [
        (tmp_path / "other", "was trained with tokenizer .*their-tokenizer.json.*this run uses data.tokenizer='byte'"),
        (tmp_path / "sft", "is a checkpoint of a data.task='sft' run"),
        (tmp_path / "missing", "is not a committed colo checkpoint"),
    ]:
        config = load_config(preset="tiny-ppo", overrides=[f"ppo.reward_model={path}"])
        with pytest.raises(ValueError, match=message):
            PPOTask(config)


def test_reward_model_scores_the_last_response_token(tmp_path):
    from colo.apps.generation import Rollout
    from colo.apps.rlhf.ppo_task import PPOTask, reward_model_scores
    from colo.apps.runs import load_reward_model
    from colo.apps.train import load_config

    original = _save_reward_checkpoint(str(tmp_path / "rm"))
    config = load_config(preset="tiny-ppo", overrides=[f"ppo.reward_model={tmp_path / 'rm'}"])
    PPOTask(config)  # same tokenizer: accepted
    model = load_reward_model(str(tmp_path / "rm"), device="cpu")
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    # row 0: prompt [7, 8, 9] + 2 response tokens; row 1: left-padded prompt [5] + 3 response tokens
    input_ids = torch.tensor([[7, 8, 9, 20, 21, 0], [0, 0, 5, 30, 31, 32]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rollout = Rollout(input_ids, attention, mask, torch.zeros(2, 3), 3, torch.arange(2), 1.0)
    scores = reward_model_scores(model, rollout)
    with torch.no_grad():
        first = original(torch.tensor([[7, 8, 9, 20, 21]]), return_logits=True).logits[0, -1, 0]
        second = original(torch.tensor([[5, 30, 31, 32]]), return_logits=True).logits[0, -1, 0]
    torch.testing.assert_close(scores, torch.stack([first, second]), rtol=1e-5, atol=1e-6)


# --- the trainer ---------------------------------------------------------------------------------------------------


def _short_config(output_dir: str, **changes) -> dict:
    from colo.apps.train import load_config

    overrides = [
        f"output_dir={output_dir}",
        "ppo.synthetic_prompts=48",
        "ppo.group_size=4",
        "ppo.sft_steps=2",
        "ppo.minibatches=2",
        "data.global_batch_size=4",
        "schedule.total_steps=6",
        "schedule.warmup_steps=1",
        "eval.every_steps=3",
        "eval.num_sequences=8",
        "logging.every_steps=1",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "sample.max_new_tokens=0",
        "checkpoint.every_steps=3",
        *[f"{key}={value}" for key, value in changes.items()],
    ]
    return load_config(preset="tiny-ppo", overrides=overrides).model_dump(mode="json")


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {"losses": result.losses, "start_step": result.start_step}


def _metrics(output_dir: str) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as lines:
        for line in lines:
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).update(record)
    return by_step


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_ppo_run_logs_its_metrics_and_resumes_exactly(tmp_path, critic):
    straight_dir, resumed_dir = str(tmp_path / "a"), str(tmp_path / "b")
    shared = {"ppo.critic": "shared", "ppo.critic_lr": "null"}
    changes = shared if critic == "shared" else {"ppo.critic_plugin": "{name: zero, stage: 3}"}
    straight = run_distributed(_train, _short_config(straight_dir, **changes), world_size=2, timeout=180)[0]
    assert sorted(straight["losses"]) == list(range(1, 7))
    records = _metrics(straight_dir)
    for step in (3, 4, 5, 6):  # the steps after the 2 SFT steps
        record = records[step]
        for name in ("value_loss", "explained_variance", "returns", "values", "kl", "kl_coef", "clip_fraction",
                     "entropy", "reward_mean", "score"):  # fmt: skip
            assert f"ppo/{name}" in record, (step, name)
        line = step_line(record, total_steps=6)  # what the run prints, under the metrics.jsonl names
        for name in ("reward_mean", "kl", "clip_fraction", "value_loss", "explained_variance"):
            assert f"| ppo/{name} " in line, line
    assert records[4]["ppo/kl_coef"] != records[3]["ppo/kl_coef"]  # the adaptive controller moved
    assert "eval_ppo/greedy_reward" in records[6]
    if critic == "separate":
        assert os.path.isdir(os.path.join(straight_dir, "checkpoints", "critic", "step-00000006"))

    run_distributed(_train, _short_config(resumed_dir, **changes, **{"schedule.stop_at_step": 5}), world_size=2,
                    timeout=180)  # fmt: skip
    resumed = run_distributed(_train, _short_config(resumed_dir, **changes), world_size=2, timeout=180)[0]
    assert resumed["start_step"] == 3
    again = _metrics(resumed_dir)
    for step in (4, 5, 6):  # bit for bit (fp32): actor, critic, optimizers and the KL controller restored
        assert resumed["losses"][step] == straight["losses"][step], step
        for name in ("kl_coef", "value_loss", "values", "returns"):
            assert again[step][f"ppo/{name}"] == records[step][f"ppo/{name}"], (step, name)


def _short_reward_model_run(output_dir: str, reward_model: str) -> dict:
    from colo.apps.train import Trainer, load_config

    config = load_config(preset="tiny-ppo", overrides=[
        f"output_dir={output_dir}", f"ppo.reward_model={reward_model}", "ppo.reward_functions=[]",
        "ppo.synthetic_prompts=24", "ppo.group_size=2", "ppo.sft_steps=1", "ppo.minibatches=1", "ppo.epochs=1",
        "data.global_batch_size=4", "schedule.total_steps=3", "schedule.warmup_steps=1",
        "eval.every_steps=3", "eval.num_sequences=4",
        "logging.every_steps=1", "logging.progress_bar=false", "logging.tensorboard=false", "sample.max_new_tokens=0",
        "checkpoint.enabled=false",
    ])  # fmt: skip
    trainer = Trainer(config)
    trainer.fit()
    return {"critic_layers": trainer.task.critic_booster.unwrap().config.num_hidden_layers}


def test_reward_model_run_scores_with_it_and_starts_the_critic_from_it(tmp_path):
    _save_reward_checkpoint(str(tmp_path / "rm"))
    result = run_distributed(_short_reward_model_run, str(tmp_path / "run"), str(tmp_path / "rm"), world_size=1,
                             timeout=120)[0]  # fmt: skip
    records = _metrics(str(tmp_path / "run"))
    assert records[2]["ppo/score"] != 0.0 and records[3]["ppo/score"] != 0.0  # the reward model's scores alone
    assert "ppo/critic_loss" in records[2]
    assert result["critic_layers"] == 2  # the reward model's 2 layers, not the policy's 4
