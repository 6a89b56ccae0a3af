"""`colo report`: the curves it draws are the values in each run's ``metrics.jsonl`` (a resumed step's later record
wins), in a PNG of the size the panels call for, embedded in a self-contained HTML page; a directory that is not a run
is an error naming the path (exit 2 from the CLI). The per-rank timing bars are the mean of the records'
``rank_timing`` tables; the timeline's bars are the colo ranges of the newest profiler window's last step, as the
trace holds them (synthetic traces, and one written by the trainer's `StepProfiler`); a run without either draws
neither. Synthetic run directories: no training."""

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
    assert result["rank_timing"] == result["timeline"] == {}  # no rank_timing records, no profile/: no per-rank row

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


# --- per-rank timing and profiler traces ------------------------------------------------------------------------


def _timing(forward, backward, optimizer, comm_wait):
    return {"forward_s": forward, "backward_s": backward, "optimizer_s": optimizer, "comm_wait_s": comm_wait}


def _rank_timing_run(run_dir):
    """3 ranks, rank 2 slow in forward; step 4 logged twice (a resume: the later record wins); an eval record
    without a table; and an older 2-rank record (a run first started on 2 ranks) that the mean leaves out."""
    lines = [_record(step=1, loss=5.0, rank_timing={"0": _timing(9, 9, 9, 9), "1": _timing(9, 9, 9, 9)})]
    for step, scale in ((2, 1.0), (4, 5.0), (4, 1.5), (6, 2.0)):
        table = {
            "0": _timing(0.10 * scale, 0.20, 0.01, 0.05),
            "1": _timing(0.11 * scale, 0.21, 0.01, 0.04),
            "2": _timing(0.30 * scale, 0.20, 0.02, 0.00),
        }
        lines.append(
            _record(step=step, loss=4.0, rank_timing=table, rank_timing_slowest=2, rank_timing_lag=0.5, skipped=False)
        )
    lines.append(_record(step=6, eval_loss=3.9))
    _write_jsonl(run_dir, lines)


def _event(name, start, duration, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 7, "tid": tid, "ts": start, "dur": duration}


def _write_trace(path, events):
    """A Chrome trace as torch writes it: metadata, torch's ops (not drawn), a flow event, then the ranges."""
    noise = [
        {"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "python"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": 1, "ts": 1010.0, "dur": 5.0},
        {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "pid": 7, "tid": 1, "ts": 1011.0, "id": 1},
    ]
    trace = {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": noise + events, "traceName": str(path)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, indent=2))


def _traced_step(offset, rank):
    """The ranges of one profiled step starting at ``offset`` us: nested as a ZeRO step runs them, with a pipeline
    action, a checkpoint save, and a range of another thread overlapping the optimizer step."""
    slow = 300.0 * rank
    return [
        _event("colo.forward", offset + 10, 1000 + slow),
        _event("colo.all_gather[dp] 1.0 MiB", offset + 20, 50),
        _event("colo.pp F mb0 chunk0", offset + 100, 400),
        _event("colo.backward", offset + 1100 + slow, 2000),
        _event("colo.reduce_scatter[dp] 2.0 MiB (async)", offset + 1200 + slow, 30),
        _event("colo.wait reduce_scatter[dp]", offset + 1500 + slow, 200),
        _event("colo.optimizer_step", offset + 3200 + slow, 500),
        _event("colo.loss all-reduce", offset + 3300 + slow, 100),
        _event("colo.wait all_gather[dp]", offset + 3350 + slow, 450, tid=2),  # runs past both
        _event("colo.checkpoint save", offset + 4000 + slow, 600),
    ]


def _traced_run(run_dir):
    """Two ranks, windows ending at steps 2 and 5: the newest (5) traced steps 4 and 5 (ProfilerStep#3 and #4) and
    then closed an empty ProfilerStep#5 (a run stopping at the window's end); rank 2 profiled only the old window."""
    _write_jsonl(run_dir, [_record(step=s, loss=4.0) for s in (1, 2, 3, 4, 5)])
    for rank in (0, 1):
        _write_trace(run_dir / "profile" / f"rank-{rank}-step-2.json", _traced_step(0.0, rank))
        steps = [_event("ProfilerStep#3", 1000.0, 5000), _event("ProfilerStep#4", 6000.0, 5000)]
        steps.append(_event("ProfilerStep#5", 11000.0, 20))
        events = steps + _traced_step(1000.0, 0) + _traced_step(6000.0, rank)
        _write_trace(run_dir / "profile" / f"rank-{rank}-step-5.json", events)
    _write_trace(run_dir / "profile" / "rank-2-step-2.json", _traced_step(0.0, 2))


def _trace_ranges_of_last_step(path):
    """The colo ranges of the last ProfilerStep of ``path`` holding any, as ``(name, start ms, duration ms)`` from
    its start, read the plain way (the whole file with json.load)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    colo = [e for e in events if e["name"].startswith("colo.")]
    for step in sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: -e["ts"]):
        inside = [e for e in colo if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
        if inside:
            return step, sorted((e["name"], (e["ts"] - step["ts"]) / 1e3, e["dur"] / 1e3) for e in inside)
    raise AssertionError(f"{path} has no step holding a colo range")


def test_per_rank_timing_panel_draws_the_mean_of_the_records(tmp_path):
    _rank_timing_run(tmp_path / "timed")
    result = write_report([str(tmp_path / "timed")], str(tmp_path / "report.png"))
    drawn = result["rank_timing"]["timed"]

    # the records with the last record's ranks, a step's later record winning: steps 2, 4 (scale 1.5), 6
    records = {}
    for line in (tmp_path / "timed" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "rank_timing" in record and len(record["rank_timing"]) == 3:
            records[record["step"]] = record["rank_timing"]
    assert drawn["steps"] == sorted(records) == [2, 4, 6] and drawn["ranks"] == [0, 1, 2]
    for phase in ("forward_s", "backward_s", "optimizer_s", "comm_wait_s"):
        expected = [1e3 * sum(records[s][str(r)][phase] for s in records) / len(records) for r in (0, 1, 2)]
        assert drawn["ms"][phase] == pytest.approx(expected, rel=1e-12), phase
    # rank 2 spends the most in forward + backward + optimizer, in every record; the median rank is rank 1
    assert drawn["slowest"] == 2 and drawn["slowest_records"] == {0: 0, 1: 0, 2: 3}
    busy = [sum(drawn["ms"][p][r] for p in ("forward_s", "backward_s", "optimizer_s")) for r in (0, 1, 2)]
    assert drawn["lag"] == pytest.approx(busy[2] / busy[1] - 1)
    assert result["timeline"] == {}  # no profile/ directory: no timeline
    assert _png_size(tmp_path / "report.png") == result["size"] == figure_size(3, with_samples=False, rank_rows=(3,))


def test_timeline_draws_each_ranks_colo_ranges_of_the_newest_windows_last_step(tmp_path):
    _traced_run(tmp_path / "traced")
    result = write_report([str(tmp_path / "traced")], str(tmp_path / "report.png"))
    timeline = result["timeline"]["traced"]

    # the newest window (step 5) of the ranks that wrote one; its last step holding ranges, ProfilerStep#4
    assert timeline["step"] == 5 and set(timeline["ranks"]) == {0, 1}
    for rank, drawn in timeline["ranks"].items():
        path = tmp_path / "traced" / "profile" / f"rank-{rank}-step-5.json"
        step, expected = _trace_ranges_of_last_step(path)
        assert step["name"] == "ProfilerStep#4" and drawn["profiler_step"] == 4 and drawn["path"] == str(path)
        assert drawn["duration_ms"] == step["dur"] / 1e3
        bars = sorted((b["name"], b["start_ms"], b["duration_ms"]) for b in drawn["bars"])
        assert [name for name, *_ in bars] == [name for name, *_ in expected]
        assert [t for _, *times in bars for t in times] == pytest.approx([t for _, *ts in expected for t in ts])
        depths = {b["name"]: b["depth"] for b in drawn["bars"]}
        kinds = {b["name"]: b["kind"] for b in drawn["bars"]}
        assert depths == {
            "colo.forward": 0, "colo.all_gather[dp] 1.0 MiB": 1, "colo.pp F mb0 chunk0": 1,
            "colo.backward": 0, "colo.reduce_scatter[dp] 2.0 MiB (async)": 1, "colo.wait reduce_scatter[dp]": 1,
            "colo.optimizer_step": 0, "colo.loss all-reduce": 1,
            # another thread's wait, inside neither: a lane below both, so no bar covers another
            "colo.wait all_gather[dp]": 2,
            "colo.checkpoint save": 0,
        }  # fmt: skip
        assert kinds["colo.forward"] == "forward" and kinds["colo.pp F mb0 chunk0"] == "pipeline"
        assert kinds["colo.checkpoint save"] == "checkpoint" and kinds["colo.loss all-reduce"] == "communication"
        assert kinds["colo.all_gather[dp] 1.0 MiB"] == kinds["colo.wait reduce_scatter[dp]"] == "communication"
    assert result["rank_timing"] == {}  # no rank_timing records: no timing panel
    assert result["size"] == figure_size(1, with_samples=False, rank_rows=(2,))


def test_a_trace_is_read_as_a_stream_of_events(tmp_path, monkeypatch):
    from colo.apps.report import traces

    _traced_run(tmp_path / "traced")
    path = str(tmp_path / "traced" / "profile" / "rank-1-step-5.json")
    whole = traces.read_rank_step(path)
    monkeypatch.setattr(traces, "_CHUNK_CHARS", 37)  # events and the traceEvents key cut across chunks
    assert traces.read_rank_step(path) == whole

    bare = tmp_path / "bare.json"  # the JSON array form of the format, without ProfilerStep: the whole trace
    bare.write_text(json.dumps(_traced_step(0.0, 0)))
    assert [r.start_ms for r in traces.read_rank_step(str(bare)).ranges][:2] == [0.0, 0.01]
    (tmp_path / "cut.json").write_text(json.dumps({"traceEvents": _traced_step(0.0, 0)})[:-40])
    with pytest.raises(ValueError, match="cut.json"):
        traces.read_rank_step(str(tmp_path / "cut.json"))
    (tmp_path / "other.json").write_text(json.dumps({"traceEvents": [_event("aten::mm", 0, 1)]}))
    with pytest.raises(ValueError, match="holds no colo"):
        traces.read_rank_step(str(tmp_path / "other.json"))


@pytest.mark.filterwarnings("ignore:.*Profiler clears events")
def test_a_trace_written_by_the_trainers_profiler_is_drawn_as_recorded(tmp_path):
    """Not synthetic: `StepProfiler` (the trainer's) records colo's regions around real ops for two steps and
    writes the trace as a run does (as two ranks' files, from one process: a 2-process run costs ~12 s)."""
    import torch

    from colo.apps.train.config import ProfileSection
    from colo.apps.train.profiling import StepProfiler
    from colo.comm.regions import region

    run_dir = tmp_path / "profiled"
    _write_jsonl(run_dir, [_record(step=s, loss=1.0) for s in (1, 2)])
    weight = torch.randn(64, 64, requires_grad=True)
    for rank in (0, 1):
        settings = ProfileSection(every_steps=2, warmup_steps=0, active_steps=2, ranks=None)
        with StepProfiler(settings, output_dir=str(run_dir), rank=rank, device=torch.device("cpu")) as profiler:
            profiler.start(0)
            for step in (1, 2):
                with region("colo.forward"):
                    loss = (torch.randn(8, 64) @ weight).square().mean()
                with region("colo.backward"):
                    loss.backward()
                    with region("colo.all_reduce[dp] 16.0 KiB"):
                        weight.grad.mul_(0.5)
                with region("colo.optimizer_step"), torch.no_grad():
                    weight.sub_(0.1 * weight.grad)
                    weight.grad = None
                profiler.step(step)

    timeline = write_report([str(run_dir)], str(tmp_path / "report.png"))["timeline"]["profiled"]
    assert timeline["step"] == 2 and set(timeline["ranks"]) == {0, 1}
    for rank, drawn in timeline["ranks"].items():
        step, expected = _trace_ranges_of_last_step(run_dir / "profile" / f"rank-{rank}-step-2.json")
        assert step["name"] == "ProfilerStep#1" and drawn["profiler_step"] == 1  # the run's step 2
        bars = sorted((b["name"], b["start_ms"], b["duration_ms"]) for b in drawn["bars"])
        assert [name for name, *_ in bars] == [name for name, *_ in expected]
        assert [t for _, *times in bars for t in times] == pytest.approx([t for _, *ts in expected for t in ts])
        assert [b["name"] for b in drawn["bars"]] == [
            "colo.forward", "colo.backward", "colo.all_reduce[dp] 16.0 KiB", "colo.optimizer_step",
        ]  # fmt: skip
        assert [b["depth"] for b in drawn["bars"]] == [0, 0, 1, 0]
