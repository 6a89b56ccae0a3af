"""Profiling and per-rank timing in the trainer (``profile.*``, ``logging.rank_timing``), on 2 CPU ranks with the
tiny Llama under ZeRO-2 (so colo.comm's collectives run inside the step):

- each profiled rank writes one Chrome trace per window, holding colo's named ranges nested as a step runs them:
  forward and backward inside the profiler's step, a reduce-scatter (with its axis and bytes) inside backward or
  the optimizer step, the checkpoint save inside the step that saves;
- rank timing gathers every rank's phase times into ``metrics.jsonl`` and names the slowest rank in the log line;
- with both off, no profiler is ever built and no hook is registered.

No timing is asserted beyond "positive": CPU timings on a shared machine vary.
"""

from __future__ import annotations

import json

import pytest

from colo.comm.testing import run_distributed

STEPS = 2


def write_corpus(root) -> str:
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(2):
        lines = [f"def profile_{index}_{n}(x):\n    return x + {n} * {index}  # {n}\n" for n in range(60)]
        (corpus / f"doc{index}.py").write_text("".join(lines))
    return str(corpus)


def run_config(corpus: str, output_dir: str, *, observe: bool) -> dict:
    config = {
        "name": "profiled",
        "output_dir": output_dir,
        "seed": 3,
        "model": {"preset": "tiny"},
        "plugin": {"name": "zero", "stage": 2, "precision": "fp32"},
        "schedule": {"total_steps": STEPS, "warmup_steps": 1},
        "data": {"paths": [corpus], "seq_len": 32, "global_batch_size": 4},
        "checkpoint": {"every_steps": STEPS, "resume": "none", "async_save": False, "save_final": False},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "sample": {"max_new_tokens": 0},
    }
    if observe:
        config["profile"] = {"every_steps": STEPS, "warmup_steps": 0, "active_steps": 1, "ranks": None}
        config["logging"]["rank_timing"] = True
    return config


def _hook_counts(model) -> dict[str, int]:
    """How many hooks of each kind the model's modules and parameters hold."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    counts = {kind: sum(len(getattr(module, kind)) for module in model.modules()) for kind in kinds}
    counts["tensor"] = sum(len(param._backward_hooks or {}) for param in model.parameters())
    return counts


def _global_hook_counts() -> dict[str, int]:
    from torch.nn.modules import module

    names = [name for name in dir(module) if name.startswith("_global_") and name.endswith("hooks")]
    return {name: len(getattr(module, name)) for name in names}


def _train(config: dict, *, forbid_profiler: bool = False):
    import torch

    from colo.apps.train import Trainer, profiling, validate_config

    def refuse(*args, **kwargs):
        raise AssertionError("a profiler was built with profiling off")

    originals = torch.profiler.profile.__init__, profiling.StepProfiler.__init__
    if forbid_profiler:  # profiling off must never build a profiler (restored after: the ranks serve later tests)
        torch.profiler.profile.__init__ = profiling.StepProfiler.__init__ = refuse
    try:
        global_hooks = _global_hook_counts()
        trainer = Trainer(validate_config(config))
        before = _hook_counts(trainer.model)
        lines, show = [], trainer.log.print
        trainer.log.print = lambda message: (lines.append(message), show(message))
        trainer.fit()
    finally:
        torch.profiler.profile.__init__, profiling.StepProfiler.__init__ = originals
    return {
        "hooks_before": before,
        "hooks_after": _hook_counts(trainer.model),
        "global_hooks": (global_hooks, _global_hook_counts()),
        "profiler": type(trainer.profiler).__name__,
        "timer": trainer.booster.engine.timer is not None,
        "lines": lines,
    }


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    root = tmp_path_factory.mktemp("observed")
    run_dir = root / "run"
    results = run_distributed(_train, run_config(write_corpus(root), str(run_dir), observe=True), world_size=2)
    return run_dir, results


def _ranges(path) -> list[dict]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _inside(inner: dict, outer: dict) -> bool:
    return (
        inner["pid"] == outer["pid"]
        and inner["tid"] == outer["tid"]
        and outer["ts"] <= inner["ts"]
        and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    )


def test_each_rank_writes_a_trace_with_colos_regions_nested_as_a_step_runs_them(observed):
    run_dir, _ = observed
    traces = sorted(p.name for p in (run_dir / "profile").iterdir())
    assert traces == [f"rank-0-step-{STEPS}.json", f"rank-1-step-{STEPS}.json"]
    ranges = _ranges(run_dir / "profile" / f"rank-1-step-{STEPS}.json")
    named = lambda prefix: [e for e in ranges if e["name"].startswith(prefix)]  # noqa: E731

    (step,) = named(f"ProfilerStep#{STEPS - 1}")  # the traced window is the run's step STEPS (torch counts from 0)
    forward, backward, optimizer = named("colo.forward"), named("colo.backward"), named("colo.optimizer_step")
    assert forward and backward and optimizer
    for phase in forward + backward + optimizer:
        assert _inside(phase, step), phase["name"]
    # ZeRO-2 reduce-scatters gradients over dp: each collective named with its axis and size, inside the backward
    # (issued from the gradient hooks) or the optimizer step (the waits for the last ones)
    scatters = named("colo.reduce_scatter[dp] ")
    assert scatters and all("iB" in e["name"] or e["name"].endswith(" B") for e in scatters)
    for scatter in scatters:
        assert any(_inside(scatter, outer) for outer in backward + optimizer), scatter["name"]
    assert any(_inside(e, step) for e in named("colo.all_reduce[dp]"))  # the loss averaged over dp
    (save,) = named("colo.checkpoint save")
    assert _inside(save, step)


def test_rank_timing_gathers_every_ranks_phases_and_names_the_slowest(observed):
    run_dir, results = observed
    assert [r["timer"] for r in results] == [True, True]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        table = record["rank_timing"]
        assert sorted(table) == ["0", "1"]
        for times in table.values():
            assert sorted(times) == ["backward_s", "comm_wait_s", "forward_s", "optimizer_s"]
            assert times["forward_s"] > 0 and times["backward_s"] > 0 and times["optimizer_s"] > 0
            assert times["comm_wait_s"] >= 0
        assert record["rank_timing_slowest"] in (0, 1)
        assert record["rank_timing_lag"] >= 0
    step_lines = [line for line in results[0]["lines"] if line.startswith("step ")]
    assert len(step_lines) == STEPS
    for line, record in zip(step_lines, records):
        assert f"| slowest rank {record['rank_timing_slowest']} +" in line, line


def test_the_log_line_names_the_slowest_rank(tmp_path):
    from colo.apps.train.rank_timing import timing_text

    assert timing_text({"rank_timing_slowest": 1, "rank_timing_lag": 0.234}) == " | slowest rank 1 +23%"
    assert timing_text({"loss": 1.0}) == ""


def test_profiling_off_builds_no_profiler_and_registers_no_hook(observed, tmp_path):
    config = run_config(write_corpus(tmp_path), str(tmp_path / "run"), observe=False)
    off = run_distributed(_train, config, forbid_profiler=True, world_size=2)
    _, on = observed
    for rank in range(2):
        assert off[rank]["profiler"] == "NoProfiler" and not off[rank]["timer"]
        assert off[rank]["hooks_after"] == off[rank]["hooks_before"]
        global_before, global_after = off[rank]["global_hooks"]
        assert global_after == global_before
        # profiling and timing on add no hook either: the model carries the hooks ZeRO needs, nothing more
        assert on[rank]["hooks_after"] == off[rank]["hooks_after"]
    assert not (tmp_path / "run" / "profile").exists()


def test_a_pipeline_traces_its_actions_and_times_them(tmp_path):
    config = run_config(write_corpus(tmp_path), str(tmp_path / "run"), observe=True)
    config["plugin"] = {"name": "hybrid", "pp": 2, "zero_stage": 0, "precision": "fp32"}
    config["schedule"]["num_microbatches"] = 2
    config["checkpoint"] = {"enabled": False}
    run_distributed(_train, config, world_size=2)
    for rank in range(2):
        ranges = _ranges(tmp_path / "run" / "profile" / f"rank-{rank}-step-{STEPS}.json")
        names = {e["name"] for e in ranges}
        # 1F1B on 2 stages: both microbatches' forward and backward on each stage, and the activations' exchange
        assert {"colo.pp F mb0 chunk0", "colo.pp F mb1 chunk0"} <= names, sorted(names)
        assert any(name.startswith("colo.pp B") for name in names), sorted(names)
        assert any(name.startswith("colo.pp comm ") for name in names), sorted(names)
        assert any(name.startswith("colo.batch_send_recv[pp] ") for name in names), sorted(names)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for times in records[-1]["rank_timing"].values():
        assert times["forward_s"] > 0 and times["backward_s"] > 0 and times["comm_wait_s"] > 0


@pytest.mark.filterwarnings("ignore:.*Profiler clears events")  # torch, windows back to back
def test_a_run_ending_at_a_window_keeps_its_trace(tmp_path):
    """With windows back to back (active_steps == every_steps), the next window records from the step after the
    last one; a run ending there must not overwrite the last window's trace with that empty one at exit."""
    import torch

    from colo.apps.train.config import ProfileSection
    from colo.apps.train.profiling import StepProfiler
    from colo.comm.regions import region

    settings = ProfileSection(every_steps=2, warmup_steps=0, active_steps=2)
    with StepProfiler(settings, output_dir=str(tmp_path), rank=0, device=torch.device("cpu")) as profiler:
        profiler.start(0)
        for step in (1, 2):
            with region("colo.forward"):
                torch.ones(4).sum()
            profiler.step(step)
    names = [e["name"] for e in _ranges(tmp_path / "profile" / "rank-0-step-2.json")]
    assert names.count("colo.forward") == 2 and {"ProfilerStep#0", "ProfilerStep#1"} <= set(names)


def test_memory_history_is_refused_off_cuda():
    import torch

    from colo.apps.train.config import ProfileSection
    from colo.apps.train.profiling import build_profiler

    settings = ProfileSection(every_steps=4, memory_history=True)
    with pytest.raises(ValueError, match="profile.memory_history"):
        build_profiler(settings, output_dir="unused", rank=0, device=torch.device("cpu"))
