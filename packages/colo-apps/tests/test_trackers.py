"""``logging.report_to: [wandb, mlflow]``: a run on 2 processes, stopped after a checkpoint and resumed, leaves one
W&B run (offline) and one MLflow run (a local file store) that hold the resolved config, every logged loss as
``metrics.jsonl`` has it and the final text sample; a failed run ends its tracker runs as failed; a missing package
is one error naming the pip extra; MLflow params over its length limit are truncated and said so; image samples
(a diffusion run's grids) reach both."""

from __future__ import annotations

import glob
import json
import os
import signal
import struct

import pytest

from colo.comm.testing import run_distributed

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

TOTAL_STEPS, STOP = 4, 2


def run_config(output_dir: str, **schedule) -> dict:
    """tiny-llama cut to a few steps on 200k tokens; every step logged, a checkpoint and an eval every 2 steps, an
    8-token greedy sample at the end."""
    from colo.apps.train import load_config

    config = load_config(preset="tiny-llama").model_dump(mode="json")
    config.update(output_dir=output_dir)
    config["schedule"].update(total_steps=TOTAL_STEPS, warmup_steps=2, **schedule)
    config["data"].update(max_tokens=200_000, seq_len=32, global_batch_size=4)
    config["checkpoint"].update(every_steps=2, keep_last=1)
    config["logging"].update(
        every_steps=1, progress_bar=False, tensorboard=False, report_to=["wandb", "mlflow"], project="colo-test"
    )
    config["eval"].update(every_steps=2, num_sequences=4, batch_size=2)
    config["sample"].update(prompts=[], max_new_tokens=8, beside_greedy_temperature=0)
    return config


TRACKER_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}


def _train(
    config: dict, tracking_uri: str, fail_at_step: int | None = None, sigterm_at_step: int | None = None
) -> dict:
    """Train with the trackers pointed at ``tracking_uri`` (W&B offline); ``fail_at_step``: the task's train step
    raises there; ``sigterm_at_step``: rank 0 gets a SIGTERM in that step (the run checkpoints and stops, preempted).
    The pool's processes are shared, so the environment is restored after."""
    from colo.apps.train import Trainer, validate_config

    saved = {name: os.environ.get(name) for name in [*TRACKER_ENV, "MLFLOW_TRACKING_URI"]}
    os.environ.update(TRACKER_ENV, MLFLOW_TRACKING_URI=tracking_uri)
    try:
        trainer = Trainer(validate_config(config))
        if fail_at_step is not None:
            train_step = trainer.task.train_step

            def failing_step(ctx, step):
                if step + 1 == fail_at_step:
                    raise RuntimeError("injected failure")
                return train_step(ctx, step)

            trainer.task.train_step = failing_step
            with pytest.raises(RuntimeError, match="injected failure"):
                trainer.fit()
            return {}
        if sigterm_at_step is not None:
            train_step = trainer.task.train_step

            def signalled_step(ctx, step):
                if step + 1 == sigterm_at_step and ctx.rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler: stop at the agreed step
                return train_step(ctx, step)

            trainer.task.train_step = signalled_step
            return {"preempted": trainer.fit().preempted}
        result = trainer.fit()
        return {"sample": result.sample, "losses": result.losses}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def jsonl_losses(output_dir: str) -> tuple[dict[int, float], dict[int, float]]:
    """``({step: loss}, {step: eval_loss})`` from ``metrics.jsonl``."""
    losses, eval_losses = {}, {}
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as file:
        for line in file:
            record = json.loads(line)
            if "loss" in record:
                losses[record["step"]] = record["loss"]
            if "eval_loss" in record:
                eval_losses[record["step"]] = record["eval_loss"]
    return losses, eval_losses


def wandb_records(path: str):
    """The protobuf records of an offline W&B run file (``run-ID.wandb``): LevelDB's log format (32 KiB blocks of
    ``crc32 | length | type`` framed chunks) after a 7-byte ``:W&B`` header, each record a ``wandb_internal.Record``;
    W&B's own reader of it is no longer Python."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as file:
        data = file.read()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a W&B transaction log (header {data[:7]!r})"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(path: str) -> dict:
    """What one offline run file holds: its id, name and config, ``{step: row}`` of its history and exit code."""
    run = {"history": {}, "config": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, name=record.run.display_name, project=record.run.project)
            run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"][row["_step"]] = row
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
        elif kind == "preempting":
            run["preempting"] = True
    return run


def test_wandb_and_mlflow_runs_hold_the_config_metrics_and_sample_across_a_resume(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    output_dir, tracking_uri = str(tmp_path / "run"), f"file://{tmp_path / 'mlruns'}"
    run_distributed(_train, run_config(output_dir, stop_at_step=STOP), tracking_uri, world_size=2)
    resumed = run_distributed(_train, run_config(output_dir), tracking_uri, world_size=2)[0]
    losses, eval_losses = jsonl_losses(output_dir)
    # steps 1-2, then 3-4 from the step-2 checkpoint
    assert sorted(resumed["losses"]) == [3, 4] and sorted(losses) == list(range(1, TOTAL_STEPS + 1))
    with open(os.path.join(output_dir, "trackers.json"), encoding="utf-8") as file:
        ids = json.load(file)

    # MLflow: one run in the experiment, reopened by the resumed run; params are the flattened config
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("colo-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.run_name == "tiny-llama"
    assert run.info.status == "FINISHED"
    assert run.data.params["name"] == "tiny-llama" and run.data.params["schedule/total_steps"] == str(TOTAL_STEPS)
    assert run.data.params["logging/report_to"] == '["wandb", "mlflow"]'
    history = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, "loss")}
    assert history == losses  # the same floats: JSON and MLflow both keep a double
    evals = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, "eval_loss")}
    assert evals == eval_losses and sorted(evals) == [2, 4]
    artifacts = client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts"))
    with open(os.path.join(artifacts, "config.json"), encoding="utf-8") as file:
        assert json.load(file) == run_config(output_dir, stop_at_step=STOP)  # the config the run started with
    sample = os.path.join(artifacts, "samples", f"sample_0-greedy-step-{TOTAL_STEPS:08d}.txt")
    with open(sample, encoding="utf-8") as file:
        assert file.read() == resumed["sample"]

    # W&B: two offline segments of one run id (the resumed one continues it), together holding every step
    segments = sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb")))
    assert len(segments) == 2
    first, second = (wandb_run(path) for path in segments)
    assert first["id"] == second["id"] == ids["wandb"]
    assert first["name"] == "tiny-llama" and first["project"] == "colo-test"
    first["config"].pop("_wandb", None)  # W&B's own bookkeeping
    assert first["config"] == run_config(output_dir, stop_at_step=STOP)
    assert first["exit_code"] == second["exit_code"] == 0
    rows = {**first["history"], **second["history"]}
    assert {step: row["loss"] for step, row in rows.items() if "loss" in row} == losses
    assert {step: row["eval_loss"] for step, row in rows.items() if "eval_loss" in row} == eval_losses
    assert rows[TOTAL_STEPS]["sample/0-greedy/_type"] == "html-file"


def test_a_failed_run_ends_its_tracker_runs_as_failed(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    output_dir, tracking_uri = str(tmp_path / "run"), f"file://{tmp_path / 'mlruns'}"
    config = run_config(output_dir)
    config["checkpoint"]["enabled"] = False
    run_distributed(_train, config, tracking_uri, 3, world_size=2)
    (run,) = MlflowClient(tracking_uri=tracking_uri).search_runs(
        [MlflowClient(tracking_uri=tracking_uri).get_experiment_by_name("colo-test").experiment_id]
    )
    assert run.info.status == "FAILED"
    (segment,) = glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb"))
    wandb = wandb_run(segment)
    assert wandb["exit_code"] == 1 and sorted(wandb["history"]) == [1, 2]


def test_a_preempted_run_ends_its_tracker_runs_as_preempted(tmp_path, monkeypatch):
    """A SIGTERM: the run checkpoints and stops; its tracker runs end as preempted (MLflow KILLED, W&B marked
    preempting with exit code 75), not as finished."""
    from mlflow.tracking import MlflowClient

    from colo.apps.train.resilience import PREEMPTED_EXIT_CODE

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    output_dir, tracking_uri = str(tmp_path / "run"), f"file://{tmp_path / 'mlruns'}"
    outcomes = run_distributed(_train, run_config(output_dir), tracking_uri, None, 2, world_size=2)
    assert [outcome["preempted"] for outcome in outcomes] == [True, True]
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("colo-test").experiment_id])
    assert run.info.status == "KILLED"
    (segment,) = glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb"))
    wandb = wandb_run(segment)
    assert wandb["exit_code"] == PREEMPTED_EXIT_CODE and wandb.get("preempting"), wandb


def test_a_missing_tracker_package_is_one_error_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from colo.apps.train import ConfigError, Trainer, validate_config
    from colo.apps.train.preflight import check_before_start

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    config = validate_config(run_config(str(tmp_path / "run")))
    message = r"logging.report_to lists 'wandb', but the wandb package is not installed: pip install 'colo-apps\[wandb"
    with pytest.raises(ConfigError, match=f"invalid run config: {message}"):
        check_before_start(config)  # what colo train and colo launch run first: one line, exit 2
    with pytest.raises(ImportError, match=message):
        Trainer(config)  # raised on every rank before the process group starts


def sample_grid(path) -> str:
    """A small PNG, as a diffusion run's sample grid."""
    from PIL import Image

    Image.new("RGB", (8, 4), color=(200, 30, 30)).save(path)
    return str(path)


def test_mlflow_truncates_long_params_and_says_so_and_keeps_image_samples(tmp_path, monkeypatch):
    """Against MLflow's default kind of store, SQLite (the mlflow extra's sqlalchemy + alembic)."""
    from mlflow.tracking import MlflowClient

    from colo.apps.train.trackers import MlflowTracker

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts in ./mlruns
    tracker = MlflowTracker(project="colo-test")
    config = {"name": "long", "sample": {"prompts": ["x" * 7000]}, "model": {"dim": 64}}
    notes = tracker.start(config, run_name="long", output_dir=str(tmp_path), resuming=False)
    tracker.log({"loss": 1.5, "grpo/kl": 0.25}, step=1)
    tracker.log_image("samples", sample_grid(tmp_path / "step-00000001.png"), step=1)
    tracker.finish("finished")
    assert len(notes) == 1 and "sample/prompts" in notes[0] and "truncated" in notes[0]
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(tracker.run_id)
    assert len(run.data.params["sample/prompts"]) == 6000 and run.data.params["sample/prompts"].endswith("...")
    assert run.data.params["model/dim"] == "64" and run.data.metrics == {"loss": 1.5, "grpo/kl": 0.25}
    assert [item.path for item in client.list_artifacts(tracker.run_id, "samples")] == ["samples/step-00000001.png"]


def test_wandb_keeps_image_samples(tmp_path, monkeypatch):
    from colo.apps.train.trackers import WandbTracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(project="colo-test")
    tracker.start({"name": "grid"}, run_name="grid", output_dir=str(tmp_path), resuming=False)
    tracker.log_image("samples", sample_grid(tmp_path / "step-00000003.png"), step=3)
    tracker.finish("finished")
    (segment,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    row = wandb_run(segment)["history"][3]
    assert row["samples/_type"] == "image-file" and (row["samples/width"], row["samples/height"]) == (8, 4)
