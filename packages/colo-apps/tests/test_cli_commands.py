"""The ``colo`` command: ``colo launch`` runs a real 2-process training job through torchrun (and the job writes
its checkpoint and sample); ``colo info`` reports the environment; ``colo config --schema`` prints valid JSON;
config errors exit with the field named; ``colo train --help`` lists the run config's fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from colo.apps.cli import app
from colo.apps.cli.app import main
from colo.apps.cli.launch import torchrun_command
from colo.apps.train.presets import PRESET_DESCRIPTIONS, RUN_PRESETS

runner = CliRunner()


def test_colo_launch_runs_a_two_process_training_job(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"print('hello {n}')\n" for n in range(600)))
    output = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "colo.apps.cli",
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "train",
        "--preset",
        "tiny-llama",
        "--set",
        f"output_dir={output}",
        "--set",
        f"data.paths=[{corpus}]",
        "--set",
        "model.preset=tiny",
        "--set",
        "data.seq_len=32",
        "--set",
        "data.global_batch_size=4",
        "--set",
        "data.max_tokens=null",
        "--set",
        "schedule.total_steps=4",
        "--set",
        "schedule.warmup_steps=1",
        "--set",
        "eval.every_steps=null",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "logging.every_steps=2",
        "--set",
        "sample.max_new_tokens=4",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 process(es)" in done.stdout and "step 4/4" in done.stdout and "sample (greedy" in done.stdout
    # the demo's end: each of the preset's prompts greedily and at a temperature beside it
    assert done.stdout.count("sample (greedy, KV cache):") == 3, done.stdout
    assert done.stdout.count("sample (temperature 0.8, top-p 0.95, KV cache):") == 3, done.stdout
    assert sorted(os.listdir(output / "checkpoints")) == ["step-00000002", "step-00000004"]

    generated = runner.invoke(
        app, ["generate", str(output / "checkpoints" / "step-00000004"), "--prompt", "pri", "--max-new-tokens", "3"]
    )
    assert generated.exit_code == 0, generated.output
    assert generated.output.startswith("pri")


def test_launch_command_is_loopback_torchrun():
    command = torchrun_command(["train", "--preset", "tiny-llama"], nproc_per_node=2)
    assert command[1:3] == ["-m", "colo.apps.cli.torchrun"]
    assert "--nproc-per-node=2" in command and "--local-addr=127.0.0.1" in command
    assert any(arg.startswith("--rdzv-endpoint=127.0.0.1:") for arg in command)
    assert command[-5:] == ["-m", "colo.apps.cli", "train", "--preset", "tiny-llama"]
    assert torchrun_command(["-m", "pkg.mod", "x"], nproc_per_node=1)[-3:] == ["-m", "pkg.mod", "x"]
    assert torchrun_command(["script.py"], nproc_per_node=1)[-1] == "script.py"
    result = runner.invoke(app, ["launch", "--nnodes", "2", "--", "train"])
    assert result.exit_code == 2 and "--rdzv-endpoint" in result.output


def test_launch_reports_a_bad_train_config_once_and_starts_nothing(monkeypatch, tmp_path):
    import colo.apps.cli.launch

    started = []
    monkeypatch.setattr(  # where colo launch starts torchrun
        colo.apps.cli.launch,
        "run_forwarding_signals",
        lambda command, **kwargs: (started.append(command), (0, None))[1],
    )

    def launch(*args):
        return runner.invoke(app, ["launch", "--nproc-per-node", "2", "--", *args])

    result = launch("train", "--preset", "tiny-llama", "--set", "optimizer.lr=-1")
    assert result.exit_code == 2
    assert result.output.count("optimizer.lr: Input should be greater than 0") == 1
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  task: sft\n")
    result = launch("train", str(config))
    assert result.exit_code == 2 and result.output.count("data.task='sft' needs data.paths") == 1
    result = launch("train", "--preset", "tiny-llama", "--sett", "x=1")
    assert result.exit_code == 2 and "No such option: --sett" in result.output
    assert started == []  # torchrun never ran

    # a valid config, `train --help` and other commands go to torchrun unchanged
    for args in (
        ["train", "--preset", "tiny-llama", "-s", "optimizer.lr=1e-3"],
        ["train", "--help"],
        ["-m", "pkg.mod", "--set", "optimizer.lr=-1"],
    ):
        result = launch(*args)
        assert result.exit_code == 0, result.output
        assert started[-1][-len(args) :] == args


def test_colo_info():
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert "torch" in result.output and "colo-apps" in result.output
    details = json.loads(runner.invoke(app, ["info", "--json"]).output)
    assert details["colo"]["colo-comm"] and "devices" in details["cuda"]


def test_colo_config_schema_and_resolved_config():
    result = runner.invoke(app, ["config", "--schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["title"] == "RunConfig" and "optimizer" in schema["properties"]
    resolved = runner.invoke(app, ["config", "--preset", "tiny-llama", "--set", "optimizer.lr=0.01"])
    assert resolved.exit_code == 0 and "lr: 0.01" in resolved.output


def test_config_errors_exit_with_the_field_named():
    result = runner.invoke(app, ["config", "--preset", "tiny-llama", "--set", "optimizer.lrr=1"])
    assert result.exit_code == 2
    assert "optimizer.lrr: unknown field" in result.output


def test_generate_from_a_checkpoint_whose_index_misses_a_field_exits_2_naming_the_file_tensor_and_field(tmp_path):
    import torch

    from colo.tensor.checkpoint import save_checkpoint

    checkpoint = tmp_path / "step-00000001"
    save_checkpoint(checkpoint, {"lm_head.weight": torch.zeros(4, 2)}, metadata={"step": 1})
    index = json.loads((checkpoint / "index.json").read_text())
    del index["tensors"]["lm_head.weight"]["shape"]
    (checkpoint / "index.json").write_text(json.dumps(index))
    result = runner.invoke(app, ["generate", str(checkpoint)])
    assert result.exit_code == 2, result.output
    assert "index.json, tensor 'lm_head.weight': the required field 'shape' is missing" in result.output


def test_train_help_lists_the_fields():
    done = subprocess.run(
        [sys.executable, "-m", "colo.apps.cli", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0
    assert "optimizer.weight_decay" in done.stdout and "checkpoint.keep_last" in done.stdout


def _help_of(command: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_train_and_config_help_list_every_preset_from_the_registry(capsys, monkeypatch):
    assert set(PRESET_DESCRIPTIONS) == set(RUN_PRESETS), "every run preset needs its one-line description"
    for command in ("train", "config"):
        text = _help_of(command, capsys, monkeypatch)
        for name in RUN_PRESETS:
            assert f"{name}: {PRESET_DESCRIPTIONS[name]}" in text, (command, name)
    listed = runner.invoke(app, ["config", "--list"])
    assert listed.exit_code == 0
    rows = [line.split(None, 1) for line in listed.output.splitlines()]
    assert rows == [[name, PRESET_DESCRIPTIONS[name]] for name in RUN_PRESETS]


def test_device_auto_on_a_one_gpu_machine_takes_the_gpu_only_for_one_process(monkeypatch):
    import torch

    from colo.apps.booster.plans import materialize_device
    from colo.apps.train.state import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert pick_device("auto") == torch.device("cuda", 0) == materialize_device()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # `make demo` there: both ranks on the CPU, with gloo
    assert pick_device("auto") == torch.device("cpu") == materialize_device()
    assert pick_device("cuda") == torch.device("cuda", 0)  # asked for explicitly: the ranks share the GPU


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["launch", "--nproc-per-node", "3", "--", "train", "--set", "plugin.name=hybrid", "--set", "plugin.tp=2"],
         "tp=2 x pp=1 x sp=1 = 2 does not divide the world size 3"),
        (["train", "--preset", "tiny-moe"], "ep=2 does not divide the world size 1"),
        (["train", "--set", "plugin.name=hybrid", "--set", "plugin.tp=2"], "does not divide the world size 1"),
        (["launch", "--nproc-per-node", "2", "--", "train", "--set", "data.global_batch_size=3"],
         "data.global_batch_size=3 does not split over the 2 data-parallel rank(s)"),
        (["launch", "--nproc-per-node", "2", "--", "train", "--set", "plugin.name=hybrid", "--set", "plugin.sp=2",
          "--set", "plugin.sp_mode=ulysses", "--set", "data.seq_len=127"], "data.seq_len=127"),
        (["launch", "--nproc-per-node", "2", "--", "train", "--set", "plugin.name=hybrid", "--set", "plugin.tp=2",
          "--set", "plugin.pp=2", "--set", "schedule.num_microbatches=2"], "= 4 does not divide the world size 2"),
    ],
)  # fmt: skip
def test_layouts_the_world_size_rules_out_are_one_line_and_exit_2_before_any_process_starts(args, words, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if args[0] == "train" and "--preset" not in args:
        args = [*args, "--preset", "tiny-llama"]
    elif "--preset" not in args:
        args = [*args[: args.index("train") + 1], "--preset", "tiny-llama", *args[args.index("train") + 1 :]]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colo: invalid run config: ") and words in lines[0], lines


def test_a_first_small_file_of_chats_trains_with_a_smaller_held_out_set(tmp_path):
    """The root README's SFT line on 40 chats: eval.num_sequences=64 would leave nothing to train on, so a tenth of
    the rows is held out instead and the header says so (it used to end in a traceback on every rank)."""
    chats = tmp_path / "chats.jsonl"
    records = [
        {"messages": [{"role": "user", "content": f"add {n} and 1"}, {"role": "assistant", "content": str(n + 1)}]}
        for n in range(40)
    ]
    chats.write_text("".join(json.dumps(record) + "\n" for record in records))
    sets = [
        f"output_dir={tmp_path / 'sft'}", "data.task=sft", f"data.paths=[{chats}]", "data.max_tokens=null",
        "model.preset=tiny", "data.seq_len=128", "schedule.total_steps=2", "schedule.warmup_steps=1",
        "eval.every_steps=2", "checkpoint.enabled=false", "sample.max_new_tokens=0", "logging.progress_bar=false",
    ]  # fmt: skip
    command = [sys.executable, "-m", "colo.apps.cli", "train", "--preset", "tiny-llama"]
    for value in sets:
        command += ["--set", value]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "eval.num_sequences=64 would leave fewer than one batch of the 40 rows, so 4 are held out" in done.stdout
    assert "4 held out" in done.stdout and "eval at step 2: held-out loss" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("task", "line3", "words"),
    [
        ("sft", '{"messages": [{"role": "user"', "line 3: not valid JSON"),
        ("dpo", '{"prompt": "p", "chosen": "c"}', "rejected"),
    ],
)
def test_data_errors_found_while_setting_up_are_one_line_and_exit_2(tmp_path, task, line3, words):
    good = (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
        if task == "sft"
        else {"prompt": "p", "chosen": "c", "rejected": "r"}
    )
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + line3 + "\n")
    preset = "tiny-llama" if task == "sft" else "tiny-dpo"
    sets = [f"output_dir={tmp_path / 'run'}", f"data.task={task}", f"data.paths=[{path}]", "model.preset=tiny"]
    if task == "sft":
        sets.append("data.max_tokens=null")
    command = [sys.executable, "-m", "colo.apps.cli", "train", "--preset", preset]
    for value in sets:
        command += ["--set", value]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "COLO_DEBUG"):
        env.pop(name, None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colo: ") and words in lines[0], done.stderr


def test_under_colo_launch_a_setup_time_data_error_also_exits_2(tmp_path):
    """A data error found while the ranks set up is one ``colo:`` line from rank 0, and ``colo launch`` exits 2 (as an
    unlaunched ``colo train`` does), not with torchrun's failure code 1, and without torchrun's logs and report of the
    failed ranks."""
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"messages": [{"role": "user"' + "\n")
    sets = [f"output_dir={tmp_path / 'run'}", "data.task=sft", f"data.paths=[{path}]", "data.max_tokens=null"]
    command = [sys.executable, "-m", "colo.apps.cli", "launch", "--nproc-per-node", "2", "--", "train"]
    command += ["--preset", "tiny-llama", *(part for value in sets for part in ("--set", value))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "COLO_DEBUG", "COLO_INPUT_ERROR_FILE"):
        env.pop(name, None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colo: ") and "line 2: not valid JSON" in lines[0], done.stderr
