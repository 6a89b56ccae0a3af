"""``colo launch``: the torchrun command line for a colo job, loopback by default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from colo.comm import find_free_port

COLO_COMMANDS = ("train", "generate", "convert", "info", "config")
"""First arguments that name a ``colo`` subcommand (run as ``-m colo.apps.cli ...`` in every process)."""


INPUT_ERROR_FILE_ENV = "COLO_INPUT_ERROR_FILE"
"""Set by ``colo launch`` for its workers: where rank 0 writes an input error found while a run is set up, so the
launcher exits 2, as an unlaunched ``colo train`` does, without torchrun's report of the failed ranks."""


def torchrun_command(
    args: list[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    local_addr: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The torchrun argv that runs ``args`` on every process: ``python -m colo.apps.cli.torchrun ...``, which is
    ``torch.distributed.run`` without its failure report when the ranks refused the run's input (`.torchrun`).

    Args:
        args: what each process runs: a colo subcommand (``["train", "--preset", "tiny-llama"]``), a module
            (``["-m", "pkg.mod", ...]``) or a script (``["train.py", ...]``).
        nproc_per_node: processes on this node.
        nnodes: nodes in the job.
        node_rank: this node's index (with ``nnodes > 1``).
        rdzv_endpoint: ``host:port`` of the rendezvous; single-node jobs default to a free loopback port, multi-node
            jobs must name one: the address of node 0, whose agent hosts the rendezvous store while the others
            connect to it (torchrun's own guess, comparing the endpoint with the machine's host name, fails where
            the name resolves to another interface, as inside a network namespace or a container, and lets
            several agents on one host race to host it).
        max_restarts: elastic restarts of the whole job after a process fails.
        local_addr: the address this node's agent advertises to the others (and rank 0's agent as the workers'
            ``MASTER_ADDR``); default loopback for single-node jobs, the host's name for multi-node ones.
        python: the interpreter.

    Raises:
        ValueError: no command, sizes that are not positive, or a multi-node job without ``rdzv_endpoint``.
    """
    if not args:
        raise ValueError("colo launch: give the command to run after --, e.g. colo launch -- train --preset tiny-llama")
    for name, value in (("--nproc-per-node", nproc_per_node), ("--nnodes", nnodes)):
        if value < 1:
            raise ValueError(f"colo launch: {name}={value} must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"colo launch: --node-rank={node_rank} must be in 0..{nnodes - 1}")
    if max_restarts < 0:
        raise ValueError(f"colo launch: --max-restarts={max_restarts} must be >= 0")
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise ValueError(
                "colo launch: a multi-node job needs --rdzv-endpoint HOST:PORT (the first node's address, reachable "
                "from every node); only single-node jobs default to loopback"
            )
        rdzv_endpoint = f"127.0.0.1:{find_free_port()}"
    command = [
        python,
        "-m",
        "colo.apps.cli.torchrun",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id=colo-{uuid.uuid4().hex[:8]}" if nnodes == 1 else "--rdzv-id=colo",
        f"--max-restarts={max_restarts}",
    ]
    if local_addr is not None or nnodes == 1:
        command.append(f"--local-addr={local_addr or '127.0.0.1'}")
    if nnodes > 1:  # node 0 hosts the rendezvous store, the others connect to it
        command.append(f"--rdzv-conf=is_host={int(node_rank == 0)}")
    if args[0] in COLO_COMMANDS:
        command += ["-m", "colo.apps.cli", *args]
    elif args[0] in ("-m", "--module"):
        if len(args) < 2:
            raise ValueError("colo launch: -m needs a module name")
        command += ["-m", *args[1:]]
    else:
        command += list(args)
    return command


def launch_environment(*, nproc_per_node: int, cuda: bool) -> dict[str, str]:
    """The environment of the launched processes: on CPU, ``OMP_NUM_THREADS`` = cores / processes (unless set) so
    the ranks do not oversubscribe the cores; Triton's interpreter without CUDA (colo's kernels then run their
    torch references or, when forced, the interpreter).

    Every restart attempt gets a fresh rendezvous store for its workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``):
    torchrun's default shares one store across attempts without a per-attempt prefix, so a restarted rank can read
    the listening address a killed rank of the previous attempt left there, and gloo's connection to it fails.
    """
    env = dict(os.environ)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if not cuda:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
        env.setdefault("TRITON_INTERPRET", "1")
    return env


def run_forwarding_signals(command: list[str], *, env: dict[str, str]) -> tuple[int, str | None]:
    """Run ``command`` (torchrun) and wait for it, forwarding SIGTERM and SIGINT to it instead of dying: torchrun
    passes the signal to its workers, which checkpoint and exit within its shutdown grace.

    Returns:
        ``(exit code, the name of the first signal forwarded or None)``.
    """
    process = subprocess.Popen(command, env=env)
    received: list[str] = []

    def forward(signum, frame) -> None:
        received.append(signal.Signals(signum).name)
        if process.poll() is None:
            process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = process.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, (received[0] if received else None)


def launch_outcome(code: int, signalled: str | None, *, run, max_restarts: int, since: float) -> int:
    """The exit code of ``colo launch`` and its last words, from torchrun's exit code and (for ``train``) the
    workers' attempt records (`colo.apps.train.resilience`).

    - every worker stopped on SIGTERM with a checkpoint: "preempted", `PREEMPTED_EXIT_CODE` (75);
    - a failure: which rank failed and why, and whether the ``--max-restarts`` budget is spent; torchrun's code.
    """
    if run is None:
        return code
    from ..train.resilience import PREEMPTED_EXIT_CODE, describe_attempt, latest_attempt, read_attempt

    world = None
    attempt = latest_attempt(run.output_dir, since=since)
    if attempt is not None:
        records = read_attempt(run.output_dir, attempt, None)
        present = [rank for rank, record in records.items() if record is not None]
        world = max(present) + 1 if present else None
        statuses = {records[rank]["status"] for rank in present}
        if statuses == {"preempted"}:
            step = max(records[rank]["step"] for rank in present)
            print(
                f"colo launch: preempted ({signalled or 'SIGTERM'}): every rank checkpointed step {step} in "
                f"{run.checkpoint_dir}; run the same command again to resume (exit code {PREEMPTED_EXIT_CODE})",
                file=sys.stderr,
                flush=True,
            )
            return PREEMPTED_EXIT_CODE
    if code == 0:
        return 0
    if signalled is not None:
        print(f"colo launch: stopped by {signalled} before the workers checkpointed", file=sys.stderr, flush=True)
        return code
    if attempt is None or world is None:
        print(f"colo launch: the job failed (torchrun exit code {code}) before training started", file=sys.stderr)
        return code
    budget = (
        f"and the restart budget (--max-restarts {max_restarts}) is spent"
        if max_restarts > 0
        else "(no restarts: --max-restarts 0)"
    )
    print(  # the last attempt with records: a restart that died before training started wrote none
        f"colo launch: the job failed {budget}; last recorded {describe_attempt(run.output_dir, attempt, world)}. "
        "Fix the "
        f"cause and run the same command again: it resumes from the newest checkpoint in {run.checkpoint_dir}",
        file=sys.stderr,
        flush=True,
    )
    return code
