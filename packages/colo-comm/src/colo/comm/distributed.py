"""Process-group initialisation from torchrun's environment (or a single process), and teardown."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .group import clear_group_cache, current_timeout, reset_timeout, set_timeout, timeout_seconds

_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits in the job, as returned by `init_distributed`.

    Attributes:
        rank: global rank.
        world_size: number of ranks in the job.
        local_rank: rank within this node (selects the CUDA device).
        backend: ``"gloo"`` or ``"nccl"``.
        device: the device this rank computes on (``cuda:<local_rank>`` with NCCL, else ``cpu``).
        timeout: seconds before a collective fails instead of hanging.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    timeout: float


def local_world_size() -> int:
    """Processes on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside a launched job)."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def gpus_per_local_rank(num_local_ranks: int | None = None) -> bool:
    """Whether CUDA is visible and every one of ``num_local_ranks`` processes on this node (default: this job's
    `local_world_size`) can have a GPU of its own, which NCCL requires."""
    if not torch.cuda.is_available():
        return False
    count = local_world_size() if num_local_ranks is None else num_local_ranks
    return count <= torch.cuda.device_count()


def default_device() -> torch.device:
    """The device this process computes on unless told otherwise: with ``torch.distributed`` initialised, the
    current CUDA device when the default group runs NCCL and the CPU otherwise (a gloo job on a GPU machine, such
    as 2 processes on one GPU, computes on the CPU); before that, what the ``"auto"`` backend would pick."""
    if dist.is_available() and dist.is_initialized():
        cuda = str(dist.get_backend()) == "nccl"
    else:
        cuda = gpus_per_local_rank()
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def pick_backend(backend: str = "auto") -> str:
    """Resolve ``"auto"`` to NCCL when each local process has a GPU of its own, else gloo (so 2 processes on a
    one-GPU machine run on the CPU rather than fail); ``COLO_BACKEND`` overrides ``"auto"``.

    Raises:
        ValueError: an unknown backend, or ``"nccl"`` without CUDA or with more local processes than GPUs.
    """
    if backend == "auto":
        backend = os.environ.get("COLO_BACKEND", "auto")
    if backend == "auto":
        return "nccl" if gpus_per_local_rank() and dist.is_nccl_available() else "gloo"
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of 'auto', 'gloo', 'nccl'")
    if backend == "nccl":
        check_nccl_fits(local_world_size())
    return backend


def check_nccl_fits(num_local_ranks: int) -> None:
    """Refuse NCCL (before any process starts, where the caller knows the count) when CUDA is missing or
    ``num_local_ranks`` processes would share a GPU.

    Raises:
        ValueError: naming the process count, the GPU count and the fix.
    """
    if not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and no CUDA device is visible; use backend='gloo' on CPU")
    gpus = torch.cuda.device_count()
    if num_local_ranks > gpus:
        raise ValueError(
            f"backend='nccl' with {num_local_ranks} processes on this node but {gpus} GPU(s): NCCL needs a GPU per "
            f"process; use --nproc-per-node {gpus} (nprocs={gpus}) or fewer, or backend='gloo' (or 'auto', which "
            "picks gloo on the CPU then)"
        )


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (callers retry if another process takes it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


def init_distributed(backend: str = "auto", *, timeout: float | datetime.timedelta | None = None) -> DistributedInfo:
    """Initialise torch.distributed for this process, from torchrun's environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as torchrun (and
    `colo.comm.launch`) set them. Without them it starts a single-process job on loopback, so the same script
    runs unlaunched. Idempotent: a second call returns the current state (and refuses a different backend).

    Args:
        backend: ``"auto"`` (NCCL when each local process has a GPU of its own, gloo otherwise; ``COLO_BACKEND``
            overrides), ``"gloo"`` or ``"nccl"``.
        timeout: seconds (or a timedelta) after which a collective fails instead of hanging; default
            ``COLO_COMM_TIMEOUT`` or 300 s. Every group created through colo inherits it.

    Returns:
        A `DistributedInfo` for this rank. With NCCL the current CUDA device is set to ``LOCAL_RANK``.
    """
    resolved = pick_backend(backend)
    if dist.is_initialized():
        current = str(dist.get_backend())
        if backend != "auto" and current != resolved:
            raise RuntimeError(
                f"torch.distributed is already initialized with backend {current!r}; call destroy_distributed() "
                f"before initialising with {resolved!r}"
            )
        return _info(current)

    seconds = timeout_seconds(timeout)
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"{name} is not set; launch with torchrun or colo.comm.launch, which set it")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")

    if resolved == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        resolved,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=seconds),
    )
    set_timeout(seconds)
    return _info(resolved)


def _info(backend: str) -> DistributedInfo:
    local_rank = _env_int("LOCAL_RANK", 0)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistributedInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device, current_timeout())


def destroy_distributed() -> None:
    """Tear down the default process group and every group colo created; a no-op when not initialized."""
    clear_group_cache()
    reset_timeout()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
