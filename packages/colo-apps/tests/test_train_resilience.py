"""Failures of real `colo launch` jobs (torchrun, 2 ranks, gloo) against one uninterrupted reference run:

- a rank SIGKILLed mid-run under ``--max-restarts 1``: torchrun restarts the group, the trainer resumes from the
  newest complete checkpoint by itself and every loss after the resume equals the reference exactly (fp32);
- SIGTERM to ``colo launch``: every rank stops at the same step, checkpoints, the launch exits with 75, and the
  next launch resumes with equal losses;
- a rank that hangs: the watchdog writes every rank's stacks and the collective it waits in, and the job fails
  within the threshold plus the collective timeout;
- two torchrun agents joined by a c10d rendezvous form one job that trains like one host with the same world size:
  on loopback (the resume after SIGTERM runs that way) and in two network namespaces joined by a veth pair (where
  CAP_NET_ADMIN allows; skipped with the reason otherwise);
- errors knowable before training (a tensor-parallel size the heads do not split into, a data path that does not
  exist, an ``init_from`` without weights) end ``colo train`` and ``colo launch`` with exit code 2 and one line
  naming the field, before any process trains.

The end-to-end tests share one uninterrupted 12-step reference run. Faults are injected with ``COLO_FAULT``
(`colo.apps.train.faults`). Timeouts are in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from colo.comm import find_free_port
from colo.comm.testing import run_distributed

TOTAL_STEPS, EVERY = 12, 4
LAUNCH_TIMEOUT_S = 180


def _write_corpus(root) -> str:
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(4):
        lines = [f"def function_{index}_{n}(x):\n    return x * {n} + {index}  # line {n}\n" for n in range(60)]
        (corpus / f"doc{index}.py").write_text("".join(lines))
    return str(corpus)


def _config(corpus: str, output_dir: str, **plugin) -> dict:
    return {
        "name": "resilience-test",
        "output_dir": output_dir,
        "seed": 5,
        "model": {"preset": "tiny"},
        "plugin": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0, **plugin},
        "optimizer": {"lr": 3e-3},
        "schedule": {"total_steps": TOTAL_STEPS, "warmup_steps": 2, "min_lr": 3e-4},
        "data": {"paths": [corpus], "seq_len": 32, "global_batch_size": 4},
        "checkpoint": {"every_steps": EVERY, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "sample": {"max_new_tokens": 0},
    }


def _train_losses(config: dict) -> dict[int, float]:
    from colo.apps.train import train, validate_config

    return train(validate_config(config)).losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (2 ranks of the warm pool; losses do not depend on the launcher) and its corpus."""
    root = tmp_path_factory.mktemp("reference")
    corpus = _write_corpus(root)
    losses = run_distributed(_train_losses, _config(corpus, str(root / "run")), world_size=2, timeout=120)[0]
    assert sorted(losses) == list(range(1, TOTAL_STEPS + 1))
    return {"corpus": corpus, "losses": losses}


def _environment(fault: str | None = None, **extra: str) -> dict[str, str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    environment.pop("COLO_FAULT", None)
    if fault is not None:
        environment["COLO_FAULT"] = fault
    return environment


def _launch(config: dict, tmp_path, *launch_args: str, fault: str | None = None, env: dict | None = None):
    path = tmp_path / f"run-{len(list(tmp_path.glob('run-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "colo.apps.cli", "launch", *launch_args, "--", "train", str(path)]
    environment = _environment(fault, **(env or {}))
    return subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _finish(process: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launch, torchrun and the workers (a session of their own)
        output, _ = process.communicate()
        raise AssertionError(f"the launch did not finish within {timeout} s:\n{output}") from None
    return process.returncode, output


def _logged(output_dir) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [record for record in map(json.loads, open(path)) if "loss" in record]


def _assert_losses_equal(records: list[dict], reference: dict[int, float]) -> None:
    for record in records:  # fp32, same layout and data position: bit-for-bit, not a tolerance
        assert record["loss"] == reference[record["step"]], (record["step"], record["loss"], reference)


def _wait_for(condition, timeout: float, what: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the job ended before {what}:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def _checkpoints(output_dir) -> list[str]:
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "index.json")))


@pytest.mark.slow
def test_a_sigkilled_rank_restarts_the_group_and_the_run_resumes_exactly(reference, tmp_path):
    output = tmp_path / "run"
    config = _config(reference["corpus"], str(output))
    # blocking saves: the step-4 checkpoint is committed before step 5 runs, so the kill at step 6 resumes from it
    # on any machine load (a background save would commit a moment later, and the resumed step would depend on it)
    config["checkpoint"]["async_save"] = False
    process = _launch(
        config, tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", fault="action=kill,rank=1,step=6"
    )
    code, log = _finish(process)
    assert code == 0, log
    assert "restarted (torchrun restart 1) after a failure: attempt 0: rank 1 (pid" in log, log
    assert "died without raising (the others had finished step 5): killed by a signal" in log
    assert "resumed from" in log and "step-00000004 at step 4" in log
    records = _logged(output)
    steps = [record["step"] for record in records]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 12]  # step 5 ran, then was redone after the restart
    _assert_losses_equal(records, reference["losses"])
    assert _checkpoints(output) == ["step-00000008", "step-00000012"]


@pytest.mark.slow
def test_sigterm_checkpoints_at_an_agreed_step_and_a_two_agent_launch_resumes(reference, tmp_path):
    output = tmp_path / "run"
    config = _config(reference["corpus"], str(output))
    # slow steps (0.2 s) leave time to send SIGTERM between the step-4 checkpoint and the end
    process = _launch(
        config, tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", fault="action=sleep,rank=all,seconds=0.2"
    )
    _wait_for(lambda: "step-00000004" in _checkpoints(output), LAUNCH_TIMEOUT_S, "step-4 checkpoint", process)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code, log = _finish(process, timeout=60)
    stopped_in = time.monotonic() - sent
    assert code == 75, log  # PREEMPTED_EXIT_CODE, and torchrun did not restart (--max-restarts 1 unused)
    assert stopped_in < 30, stopped_in  # within torchrun's grace
    assert "restarted" not in log and "colo launch: preempted (SIGTERM): every rank checkpointed step" in log
    first = _logged(output)
    stop = first[-1]["step"]
    assert EVERY < stop < TOTAL_STEPS and f"step-{stop:08d}" in _checkpoints(output), (stop, log)

    # the next launch resumes there, as two torchrun agents (one rank each) joined by a c10d rendezvous on loopback:
    # the multi-node form of the same 2-rank job, on any machine
    config_path = tmp_path / "two-agents.yaml"
    config_path.write_text(yaml.safe_dump(config))
    commands = _two_agent_commands(str(config_path), f"127.0.0.1:{find_free_port()}", ("127.0.0.1", "127.0.0.1"))
    logs = _run_two_agents(commands, [_environment()] * 2, [[], []])
    for code, log in logs:
        assert code == 0, log
    # the c10d rendezvous, not --node-rank, decides which agent's worker is global rank 0 (the one that prints)
    printed = logs[0][1] + logs[1][1]
    assert f"step-{stop:08d} at step {stop}" in printed and "2 process(es)" in printed, printed
    records = _logged(output)
    assert [record["step"] for record in records] == list(range(1, TOTAL_STEPS + 1))
    _assert_losses_equal(records, reference["losses"])


@pytest.mark.slow
def test_a_hung_rank_is_dumped_and_fails_the_job_within_the_threshold_plus_the_collective_timeout(reference, tmp_path):
    output = tmp_path / "run"
    watchdog_s, collective_timeout_s = 3.0, 20
    config = _config(reference["corpus"], str(output), name="zero", stage=1)
    config["plugin"].pop("max_grad_norm")
    config["resilience"] = {"watchdog_seconds": watchdog_s}
    process = _launch(
        config,
        tmp_path,
        "--nproc-per-node",
        "2",
        fault="action=hang,rank=1,step=3",
        env={"COLO_COMM_TIMEOUT": str(collective_timeout_s)},
    )
    _wait_for(lambda: len(_logged(output)) >= 2, LAUNCH_TIMEOUT_S, "step 2", process)
    hung_at = time.monotonic()
    code, log = _finish(process, timeout=120)
    failed_in = time.monotonic() - hung_at
    assert code != 0, log
    assert failed_in < watchdog_s + collective_timeout_s, failed_in
    waiting = (output / "hang" / "rank-0.txt").read_text()
    assert "no step finished for" in waiting and "after step 2" in waiting
    # rank 0 waits inside ZeRO's gradient reduction for rank 1: the op, group and sizes are named
    assert "still inside it" in waiting and "torch.float32" in waiting, waiting
    assert "Thread" in waiting and "trainer.py" in waiting  # faulthandler's stacks
    hung = (output / "hang" / "rank-1.txt").read_text()
    assert "faults.py" in hung and "before_step" in hung  # where rank 1 is stuck
    assert "rank 1 hung after step 2" in log, log


def _two_agent_commands(config_path: str, endpoint: str, addresses: tuple[str, str]) -> list[list[str]]:
    return [
        [
            sys.executable,
            "-m",
            "colo.apps.cli",
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            endpoint,
            "--local-addr",
            addresses[node],
            "--",
            "train",
            config_path,
        ]
        for node in (0, 1)
    ]


def _run_two_agents(commands: list[list[str]], envs: list[dict], prefixes: list[list[str]]) -> list[tuple[int, str]]:
    processes = [
        subprocess.Popen(
            prefix + command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for prefix, command, env in zip(prefixes, commands, envs)
    ]
    try:
        return [_finish(process) for process in processes]
    finally:  # one agent failing must not leave the other waiting in the rendezvous
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"colo-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace (CAP_NET_ADMIN missing?): {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.mark.slow
def test_two_hosts_in_network_namespaces_over_a_veth_pair_train_like_one_host(reference, tmp_path):
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    tag = f"c{os.getpid() % 100000}"
    namespaces, links = (f"{tag}a", f"{tag}b"), (f"{tag}va", f"{tag}vb")
    addresses = ("10.231.0.1", "10.231.0.2")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for namespace in namespaces:
            ip("netns", "add", namespace)
            ip("-n", namespace, "link", "set", "lo", "up")
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for namespace, link, address in zip(namespaces, links, addresses):
            ip("link", "set", link, "netns", namespace)
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", namespace, "link", "set", link, "up")

        output = tmp_path / "run"
        config_path = tmp_path / "run.yaml"
        config_path.write_text(yaml.safe_dump(_config(reference["corpus"], str(output))))
        commands = _two_agent_commands(str(config_path), f"{addresses[0]}:29731", addresses)
        # gloo binds the namespace's veth, not the host's name (which resolves outside it)
        envs = [_environment(GLOO_SOCKET_IFNAME=link) for link in links]
        prefixes = [["ip", "netns", "exec", namespace] for namespace in namespaces]
        for code, log in _run_two_agents(commands, envs, prefixes):
            assert code == 0, log
        records = _logged(output)
        assert [record["step"] for record in records] == list(range(1, TOTAL_STEPS + 1))
        _assert_losses_equal(records, reference["losses"])
        assert _checkpoints(output) == ["step-00000008", "step-00000012"]
    finally:
        for namespace in namespaces:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", links[0]], capture_output=True)


# --- fast checks: no training process starts ------------------------------------------------------------------------

_PRE_START_ERRORS = {
    "tp": (["--set", "plugin.name=hybrid", "--set", "plugin.tp=3"], "plugin.tp=3: tp=3 cannot shard "),
    "data": (["--set", "data.paths=[{root}/missing]"], "data.paths[0]='{root}/missing': it does not exist"),
    "init_from": (["--set", "model.init_from={root}/no-weights"], "model.init_from='{root}/no-weights' has config"),
}


@pytest.mark.parametrize("command", [["train"], ["launch", "--nproc-per-node", "2", "--", "train"]])
@pytest.mark.parametrize("error", sorted(_PRE_START_ERRORS))
def test_errors_knowable_before_training_exit_2_naming_the_field_before_any_process_starts(
    command, error, tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    import colo.apps.cli.launch
    import colo.apps.train
    from colo.apps.cli import app

    (tmp_path / "corpus.txt").write_text("print('hello')\n" * 50)
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text("{}")

    def must_not_run(*args, **kwargs):
        raise AssertionError("a process started (torchrun or the trainer) despite the invalid run config")

    monkeypatch.setattr(colo.apps.cli.launch, "run_forwarding_signals", must_not_run)
    monkeypatch.setattr(colo.apps.train, "train", must_not_run)
    overrides, expected = _PRE_START_ERRORS[error]
    base = ["--preset", "tiny-llama", "--set", "model.preset=tiny", "--set", f"data.paths=[{tmp_path}/corpus.txt]"]
    result = CliRunner().invoke(app, [*command, *base, *(arg.format(root=tmp_path) for arg in overrides)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("colo: invalid run config: " + expected.format(root=tmp_path)), result.output
    assert len(result.output.strip().splitlines()) == 1, result.output  # one line, no traceback


def test_multi_node_launch_lets_node_0_host_the_rendezvous_and_workers_get_a_store_per_attempt():
    from colo.apps.cli.launch import launch_environment, torchrun_command

    def command(node_rank: int) -> list[str]:
        return torchrun_command(
            ["train"],
            nproc_per_node=1,
            nnodes=2,
            node_rank=node_rank,
            rdzv_endpoint="10.0.0.1:29500",
            local_addr=("10.0.0.1", "10.0.0.2")[node_rank],
        )

    assert "--rdzv-conf=is_host=1" in command(0) and "--local-addr=10.0.0.1" in command(0)
    assert "--rdzv-conf=is_host=0" in command(1) and "--local-addr=10.0.0.2" in command(1)
    assert not any(arg.startswith("--rdzv-conf") for arg in torchrun_command(["train"], nproc_per_node=2))
    assert launch_environment(nproc_per_node=2, cuda=False)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_fault_spec_parses_and_names_a_bad_part(monkeypatch):
    from colo.apps.train.faults import Fault, Faults, fault_from_environment, parse_fault

    assert parse_fault("action=kill,rank=1,step=6") == Fault("kill", rank=1, step=6)
    assert parse_fault("action=sleep, rank=all, attempt=all, seconds=0.2") == Fault(
        "sleep", rank=None, attempt=None, seconds=0.2
    )
    monkeypatch.setenv("COLO_FAULT", "action=sleep,rank=all,seconds=0.5; action=kill,rank=1,step=9")
    assert fault_from_environment() == Faults((Fault("sleep", rank=None, seconds=0.5), Fault("kill", rank=1, step=9)))
    monkeypatch.delenv("COLO_FAULT")
    assert fault_from_environment() is None
    with pytest.raises(ValueError, match="'when=3' is not one of"):
        parse_fault("action=kill,when=3")
    with pytest.raises(ValueError, match="action must be one of"):
        parse_fault("action=explode")


def test_describe_attempt_names_the_killed_rank_first_and_its_peers_after(tmp_path):
    from colo.apps.train.resilience import describe_attempt, read_attempt

    attempts = tmp_path / "attempts"
    attempts.mkdir()
    records = [
        {"rank": 0, "status": "failed", "step": 5, "pid": 10, "host": "a", "error": "CommError: Connection reset"},
        {"rank": 1, "status": "running", "step": 0, "pid": 11, "host": "b"},
        {"rank": 2, "status": "done", "step": 12, "pid": 12, "host": "b"},
    ]
    for record in records:
        (attempts / f"attempt-0-rank-{record['rank']}.json").write_text(json.dumps({"attempt": 0, **record}))
    assert sorted(read_attempt(str(tmp_path), 0, None)) == [0, 1, 2]
    line = describe_attempt(str(tmp_path), 0, 4)
    assert line.startswith("attempt 0: rank 1 (pid 11 on b) died without raising (the others had finished step 12)")
    assert line.index("rank 3 left no record") < line.index("rank 0 raised CommError")  # the peer noticing is last


def _agree_twice(output_dir: str):
    import torch.distributed as dist

    from colo.apps.train.resilience import RunGuard

    rank = dist.get_rank()
    guard = RunGuard(output_dir, rank=rank, world_size=2, device=torch.device("cpu"), every_minutes=0.01)
    time.sleep(0.7)  # past checkpoint.every_minutes=0.01 (0.6 s) on rank 0's clock
    due = guard.agree(1)
    guard.saved()
    if rank == 1:
        guard.signalled = "SIGTERM"  # what its handler sets
    stop = guard.agree(2)
    metrics = guard.straggler_metrics()
    guard.finished("preempted")
    return due, stop, metrics


def test_ranks_agree_on_a_time_based_save_and_on_a_stop_one_rank_saw(tmp_path):
    results = run_distributed(_agree_twice, str(tmp_path), world_size=2, timeout=60)
    for due, stop, metrics in results:  # the same answers on both ranks
        assert (due.stop, due.save) == (False, True)  # rank 0's clock decided
        assert (stop.stop, stop.save) == (True, False)  # rank 1's SIGTERM, right after a save
        assert len(stop.busy_seconds) == 2 and metrics["slowest_rank"] in (0, 1)
        assert metrics["step_busy_max_s"] >= metrics["step_busy_min_s"] > 0
    assert {json.loads(path.read_text())["status"] for path in (tmp_path / "attempts").iterdir()} == {"preempted"}


def test_sigterm_sets_the_stop_flag_and_the_handler_is_restored(tmp_path):
    from colo.apps.train.resilience import RunGuard

    before = signal.getsignal(signal.SIGTERM)
    guard = RunGuard(str(tmp_path), rank=0, world_size=1, device=torch.device("cpu"))
    try:
        assert not guard.agree(1).stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.agree(2).stop and guard.signalled == "SIGTERM"
    finally:
        guard.finished("preempted")
    assert signal.getsignal(signal.SIGTERM) is before
