"""``colo launch``: the torchrun command line for a colo job, loopback by default."""

from __future__ import annotations

import os
import sys
import uuid

from colo.comm import find_free_port

COLO_COMMANDS = ("train", "generate", "convert", "info", "config")
"""First arguments that name a ``colo`` subcommand (run as ``-m colo.apps.cli ...`` in every process)."""


def torchrun_command(
    args: list[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    python: str = sys.executable,
) -> list[str]:
    """The ``python -m torch.distributed.run ...`` argv that runs ``args`` on every process.

    Args:
        args: what each process runs: a colo subcommand (``["train", "--preset", "tiny-llama"]``), a module
            (``["-m", "pkg.mod", ...]``) or a script (``["train.py", ...]``).
        nproc_per_node: processes on this node.
        nnodes: nodes in the job.
        node_rank: this node's index (with ``nnodes > 1``).
        rdzv_endpoint: ``host:port`` of the rendezvous; single-node jobs default to a free loopback port, multi-node
            jobs must name one (the first node's address).
        max_restarts: elastic restarts of the whole job after a process fails.
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
        "torch.distributed.run",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id=colo-{uuid.uuid4().hex[:8]}" if nnodes == 1 else "--rdzv-id=colo",
        f"--max-restarts={max_restarts}",
    ]
    if nnodes == 1:
        command.append("--local-addr=127.0.0.1")
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
    torch references or, when forced, the interpreter)."""
    env = dict(os.environ)
    if not cuda:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
        env.setdefault("TRITON_INTERPRET", "1")
    return env
