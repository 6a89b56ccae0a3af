"""`colo report`: the curves it draws are the values in each run's ``metrics.jsonl`` (a resumed step's later record
wins), in a PNG of the size the panels call for, embedded in a self-contained HTML page; a directory that is not a run
is an error naming the path (exit 2 from the CLI). Synthetic run directories: no training."""

from __future__ import annotations

import base64
import json
import re
import struct

import pytest
from typer.testing import CliRunner

pytest.importorskip("matplotlib")

from colo.apps.report import PANELS, figure_size, write_report  # noqa: E402
from colo.tensor.checkpoint import CheckpointIndex  # noqa: E402


def _write_jsonl(run_dir, lines):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def _record(**fields):
    return json.dumps({"time": 0.0, **fields})


def _pretrain_run(run_dir):
    """Steps 2..10, killed after logging step 8 mid-line, resumed from step 4: steps 6 and 8 are logged twice."""
    lines = []
    for step in (2, 4, 6, 8):
        lines.append(
            _record(
                step=step,
                loss=5.0 - 0.1 * step,
                lr=1e-3 * step,
                grad_norm=2.0,
                tokens_per_second=1000.0 + step,
                mfu=None,
                memory_bytes=2**20 * (100 + step),
                skipped=False,
            )
        )
        if step == 4:
            lines.append(_record(step=4, eval_loss=4.5))
    lines.append('{"time": 0.0, "step": 10, "loss": 4.')  # the kill's partial line
    for step in (6, 8, 10):  # the resumed run: other values for 6 and 8
        lines.append(
            _record(
                step=step,
                loss=4.0 - 0.1 * step,
                lr=2e-3 * step,
                grad_norm=1.0,
                tokens_per_second=900.0,
                mfu=None,
                memory_bytes=2**20 * 200,
                skipped=False,
            )
        )
    lines.append(_record(step=10, eval_loss=3.5))
    _write_jsonl(run_dir, lines)
    index = CheckpointIndex(tensors={}, metadata={"step": 10, "run": {"config": {"name": "tiny-pretrain"}}})
    checkpoint = run_dir / "checkpoints" / "step-00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "index.json").write_text(index.to_json())


def _grpo_run(run_dir):
    _write_jsonl(
        run_dir,
        [
            _record(
                step=step,
                loss=0.5 / step,
                lr=1e-5,
                tokens_per_second=50.0,
                mfu=0.01 * step,
                memory_bytes=2**30,
                **{"grpo/reward_mean": 0.1 * step, "grpo/kl": 0.001 * step, "grpo/response_length": 20.0 + step},
            )
            for step in (1, 2, 3)
        ],
    )


def _diffusion_run(run_dir):
    from matplotlib.image import imsave

    _write_jsonl(
        run_dir,
        [_record(step=s, loss=0.2, lr=1e-4, images_per_s=3.0, memory_bytes=2**29, skipped=False) for s in (4, 8)],
    )
    (run_dir / "samples").mkdir()
    for step in (4, 8):
        imsave(run_dir / "samples" / f"step-{step:08d}.png", [[[step / 8, 0.0, 0.0]] * 4] * 2)


def _jsonl_series(run_dir, key):
    """``(steps, values)`` of ``key`` in ``run_dir/metrics.jsonl`` read the plain way: a later line of a step
    overwrites an earlier one; lines that are not JSON are skipped."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get(key) is not None:
            by_step[record["step"]] = record[key]
    return sorted(by_step), [by_step[s] for s in sorted(by_step)]


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def runs(tmp_path):
    _pretrain_run(tmp_path / "pretrain")
    _grpo_run(tmp_path / "grpo")
    _diffusion_run(tmp_path / "diffusion")
    return tmp_path


def test_report_draws_each_runs_metrics_jsonl(runs, tmp_path):
    labels = ["pretrain", "grpo", "diffusion"]
    result = write_report([str(runs / label) for label in labels], str(tmp_path / "out" / "report.png"))

    # the resumed run's records win for steps 6 and 8; the kill's partial line is skipped, not fatal
    loss = result["panels"]["loss"]["pretrain"]
    assert loss["steps"] == [2, 4, 6, 8, 10]
    assert loss["values"] == pytest.approx([4.8, 4.6, 3.4, 3.2, 3.0], abs=1e-12)
    assert result["runs"]["pretrain"].skipped_lines == 1
    assert result["panels"]["eval_loss"]["pretrain"] == {"key": "eval_loss", "steps": [4, 10], "values": [4.5, 3.5]}

    # every drawn curve is its run's metrics.jsonl, exactly
    expected_panels = {
        "loss", "eval_loss", "lr", "grad_norm", "tokens_per_second", "images_per_s", "mfu", "memory",
        "reward", "kl", "response_length",
    }  # fmt: skip
    assert set(result["panels"]) == expected_panels  # no preference run: no accuracy panel
    for name, curves in result["panels"].items():
        for label, curve in curves.items():
            steps, values = _jsonl_series(runs / label, curve["key"])
            assert (curve["steps"], curve["values"]) == (steps, values), (name, label)
    assert set(result["panels"]["mfu"]) == {"grpo"}  # MFU null on CPU: the pretrain run has no MFU curve
    assert set(result["panels"]["reward"]) == {"grpo"} and result["panels"]["kl"]["grpo"]["key"] == "grpo/kl"
    assert set(result["panels"]["images_per_s"]) == {"diffusion"}

    # the newest sample grid beside the curves; the PNG has the size of 11 panels (3 a row) and the grid column
    assert result["samples"] == {"diffusion": {"step": 8, "path": str(runs / "diffusion/samples/step-00000008.png")}}
    assert result["size"] == figure_size(len(expected_panels), with_samples=True) == (1600, 1200)
    png = tmp_path / "out" / "report.png"
    assert _png_size(png) == result["size"]

    # the page is one file: the PNG inline, each run's config name (from its newest checkpoint) and last values
    page = (tmp_path / "out" / "report.html").read_text()
    assert result["html"] == str(tmp_path / "out" / "report.html")
    assert base64.b64encode(png.read_bytes()).decode() in page
    assert "<td>tiny-pretrain</td>" in page and "<td>3.5</td>" in page  # the last eval loss
    assert "colo report: pretrain, grpo, diffusion" in page


def test_panels_cover_what_the_trainer_logs():
    keys = {key for panel in PANELS for key in panel.keys}
    assert {"loss", "eval_loss", "lr", "tokens_per_second", "mfu", "memory_bytes"} <= keys
    assert {"grpo/reward_mean", "grpo/kl", "grpo/response_length", "ppo/reward_mean", "ppo/kl"} <= keys


def test_a_directory_without_metrics_is_an_error_naming_it(tmp_path):
    (tmp_path / "not-a-run").mkdir()
    missing = tmp_path / "not-a-run" / "metrics.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{missing} does not exist")):
        write_report([str(tmp_path / "not-a-run")], str(tmp_path / "report.png"))
    _write_jsonl(tmp_path / "empty", ["not json"])
    with pytest.raises(ValueError, match="holds no metrics"):
        write_report([str(tmp_path / "empty")], str(tmp_path / "report.png"))
    with pytest.raises(ValueError, match="should end in .png"):
        write_report([str(tmp_path / "empty")], str(tmp_path / "report.svg"))


def test_cli_exits_0_with_the_report_and_2_naming_a_bad_run(runs, tmp_path):
    from colo.apps.cli.app import app

    out = tmp_path / "cli" / "r.png"
    result = CliRunner().invoke(app, ["report", str(runs / "pretrain"), str(runs / "grpo"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert str(out) in result.output and out.with_suffix(".html").is_file()
    assert _png_size(out) == figure_size(10, with_samples=False)  # no images/s panel: no diffusion run

    result = CliRunner().invoke(app, ["report", str(runs / "pretrain"), str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert f"{tmp_path / 'missing'} is not a directory" in result.output
