#!/usr/bin/env python3
"""Checkpoint write and read throughput on 2 ranks: colo's sharded format vs torch.save/torch.load vs torch DCP.

Every rank holds the same tensor-parallel state: ``--num-tensors`` fp32 matrices sharded on dim 0 (colo: local
tensors with a ``Shard(0)`` layout; DCP: ``DTensor.from_local`` over the same shards; torch.save: each rank's local
tensors in its own file), ``--size-mb`` in all over both ranks. Each round, in a rotating order, every format
writes the state to a fresh directory under /tmp and reads it back into preallocated tensors (torch.load returns
new tensors instead: no copy is charged to it), then the directory is removed. A timing runs from a barrier to a
barrier, so it is the job's time, and throughput is the state's total bytes over it (GB = 1e9 bytes).

All three flush their files to disk on write: colo and DCP (``sync_files=True``, its default) fsync themselves,
and torch.save is followed by an fsync of its file. Before each read the files are evicted from the page cache
(``posix_fadvise(DONTNEED)`` after the fsync), so reads come from the disk, unless ``--warm-reads``.

colo's background save (`AsyncCheckpointer`) is timed too: how long ``save()`` blocks the caller (the copy to
staging buffers) against the whole save (``save()`` to the commit); the first background save also allocates its
staging buffers, later ones reuse them, so both are reported.

    python benchmarks/checkpoint_io.py [--size-mb 1024] [--repeats 3] [--num-tensors 32]

Writes ``benchmarks/results/checkpoint_io_cpu.json`` (medians over the rounds, and ratios colo / peer of
throughputs: > 1 means colo is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
NUM_RANKS = 2
FORMATS = ("colo", "torch_save", "dcp")


def _evict(directory: str) -> None:
    """Drop a directory's (already fsynced) files from the page cache, so the next read goes to the disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn, *args) -> float:
    """Seconds from a barrier before ``fn(*args)`` to a barrier after it, on every rank."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - start


def _on_rank(root: str, size_mb: int, num_tensors: int, repeats: int, warm_reads: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard

    from colo.comm import Mesh
    from colo.tensor import Layout, Shard, set_layout
    from colo.tensor.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    mesh = Mesh(tp=NUM_RANKS)
    device_mesh = init_device_mesh("cpu", (NUM_RANKS,), mesh_dim_names=("tp",))
    columns = 1024
    rows = max(NUM_RANKS, size_mb * 2**20 // (4 * columns * num_tensors)) // NUM_RANKS * NUM_RANKS
    global_shape = (rows, columns)
    layout = Layout(mesh, [Shard(0)], global_shape)
    generator = torch.Generator().manual_seed(rank)

    def sharded(fill: bool) -> dict[str, torch.Tensor]:
        shape = layout.local_shape()
        tensors = {
            f"layers.{i}.weight": torch.randn(shape, generator=generator) if fill else torch.empty(shape)
            for i in range(num_tensors)
        }
        return {name: set_layout(tensor, layout) for name, tensor in tensors.items()}

    state, targets = sharded(True), sharded(False)
    dtensors = {name: DTensor.from_local(t, device_mesh, [DShard(0)], run_check=False) for name, t in state.items()}
    dtensor_targets = {
        name: DTensor.from_local(t, device_mesh, [DShard(0)], run_check=False) for name, t in targets.items()
    }
    total_bytes = NUM_RANKS * sum(t.numel() * t.element_size() for t in state.values())

    def torch_save(directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        file = os.path.join(directory, f"rank-{rank}.pt")
        torch.save(state, file)
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    loaded = {}

    def torch_load(directory: str) -> None:
        loaded["state"] = torch.load(os.path.join(directory, f"rank-{rank}.pt"), weights_only=True)

    writers = {
        "colo": lambda d: save_checkpoint(d, state, group=mesh.group("tp")),
        "torch_save": torch_save,
        "dcp": lambda d: dcp.save(dtensors, checkpoint_id=d),
    }
    readers = {
        "colo": lambda d: load_checkpoint(d, targets),
        "torch_save": torch_load,
        "dcp": lambda d: dcp.load(dtensor_targets, checkpoint_id=d),
    }
    write_s: dict[str, list[float]] = {name: [] for name in FORMATS}
    read_s: dict[str, list[float]] = {name: [] for name in FORMATS}
    for round_index in range(repeats):
        order = FORMATS[round_index % len(FORMATS) :] + FORMATS[: round_index % len(FORMATS)]
        for name in order:
            directory = os.path.join(root, f"{name}-{round_index}")
            write_s[name].append(_timed(writers[name], directory))
            if not warm_reads and rank == 0:
                _evict(directory)
            read_s[name].append(_timed(readers[name], directory))
            if name == "colo":
                for target, source in zip(targets.values(), state.values()):
                    assert torch.equal(target, source), "colo read back different values"
            loaded.clear()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory)

    # background saves: time save() returning against the whole save
    call_s, total_s = [], []
    with AsyncCheckpointer(group=mesh.group("tp")) as checkpointer:
        for round_index in range(repeats + 1):
            directory = os.path.join(root, f"colo-background-{round_index}")
            dist.barrier()
            start = time.perf_counter()
            handle = checkpointer.save(directory, state)
            call_s.append(time.perf_counter() - start)
            handle.wait()
            dist.barrier()
            total_s.append(time.perf_counter() - start)
            if rank == 0:
                shutil.rmtree(directory)
    return {
        "total_bytes": total_bytes,
        "global_shape": list(global_shape),
        "write_s": write_s,
        "read_s": read_s,
        "background_call_s": call_s,
        "background_total_s": total_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="size of the whole state over both ranks (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--num-tensors", type=int, default=32)
    parser.add_argument("--warm-reads", action="store_true", help="read from the page cache (no eviction)")
    parser.add_argument("--json", default=str(RESULTS / "checkpoint_io_cpu.json"))
    args = parser.parse_args()

    from colo.comm import launch

    root = tempfile.mkdtemp(prefix="colo-checkpoint-io-", dir="/tmp")
    try:
        per_rank = launch(
            _on_rank, NUM_RANKS, root, args.size_mb, args.num_tensors, args.repeats, args.warm_reads,
            backend="gloo", threads=1, env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    run = per_rank[0]  # every timing spans barriers, so rank 0's is the job's
    gb = run["total_bytes"] / 1e9
    formats = {}
    for name in FORMATS:
        write, read = statistics.median(run["write_s"][name]), statistics.median(run["read_s"][name])
        formats[name] = {
            "write_s": write,
            "read_s": read,
            "write_gb_per_s": gb / write,
            "read_gb_per_s": gb / read,
            "write_s_rounds": run["write_s"][name],
            "read_s_rounds": run["read_s"][name],
        }
    ratios = {  # per-round throughput ratios colo / peer, then the median
        f"colo_vs_{peer}_{kind}": statistics.median(
            p / c for c, p in zip(run[f"{kind}_s"]["colo"], run[f"{kind}_s"][peer])
        )
        for peer in ("torch_save", "dcp")
        for kind in ("write", "read")
    }
    calls, totals = run["background_call_s"], run["background_total_s"]
    background = {
        "first_call_s": calls[0],
        "call_s": statistics.median(calls[1:]),
        "total_s": statistics.median(totals[1:]),
        "call_fraction_of_total": statistics.median(c / t for c, t in zip(calls[1:], totals[1:])),
        "foreground_write_s": formats["colo"]["write_s"],
        "call_s_rounds": calls,
        "total_s_rounds": totals,
    }
    result = {
        "benchmark": "checkpoint write/read throughput on 2 ranks: colo sharded format vs torch.save vs torch DCP",
        "environment": {
            "world_size": NUM_RANKS,
            "backend": "gloo",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "omp_threads_per_rank": 1,
            "directory": "/tmp",
            "reads": "page cache" if args.warm_reads else "evicted from the page cache before each read",
        },
        "state": {
            "total_bytes": run["total_bytes"],
            "num_tensors": args.num_tensors,
            "global_shape": run["global_shape"],
            "dtype": "float32",
            "layout": "Shard(0) over 2 ranks",
        },
        "repeats": args.repeats,
        "formats": formats,
        "throughput_ratios": ratios,
        "colo_background_save": background,
    }
    print(f"state {gb:.3f} GB over {NUM_RANKS} ranks, {args.num_tensors} tensors, medians of {args.repeats} rounds")
    print(f"{'format':>12}{'write GB/s':>12}{'read GB/s':>12}")
    for name, row in formats.items():
        print(f"{name:>12}{row['write_gb_per_s']:>12.3f}{row['read_gb_per_s']:>12.3f}")
    for name, ratio in ratios.items():
        print(f"{name:>28}: {ratio:.3f}")
    print(
        f"background save: save() blocks {background['call_s'] * 1e3:.1f} ms (first {calls[0] * 1e3:.1f} ms) of "
        f"{background['total_s'] * 1e3:.1f} ms in all (foreground save {formats['colo']['write_s'] * 1e3:.1f} ms)"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
