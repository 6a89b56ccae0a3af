"""Collective bandwidth on a mesh, nccl-tests style, plus the algorithm calibration and colo-vs-raw overhead.

    python -m colo.comm.bench --nprocs 4 --mesh dp=2,tp=2              # the bandwidth table
    python -m colo.comm.bench --nprocs 2 --calibrate table.json        # measure the algorithm crossovers
    python -m colo.comm.bench --nprocs 2 --vs-raw --json overhead.json # colo wrappers against raw torch.distributed
    torchrun --nproc-per-node 8 -m colo.comm.bench --mesh dp=2,tp=4    # under torchrun (NCCL on GPUs)

Sizes follow nccl-tests: ``size`` is the whole buffer (the all-reduce buffer, the all-gather output, the
reduce-scatter input). ``algbw = size / time`` and ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for
all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter and all_to_all, and 1 for broadcast. Times are the
slowest rank's mean over an adaptive number of iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"16M"`` -> 16777216, ``"100"`` -> 100."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``."""
    shape = {}
    for item in filter(None, text.split(",")):
        if "=" not in item:
            raise ValueError(f"--mesh item {item!r} must look like axis=size, e.g. --mesh dp=2,tp=2")
        name, size = item.split("=", 1)
        shape[name.strip()] = int(size)
    return shape


def size_range(low: int, high: int, factor: int = 4) -> list[int]:
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


# --- one measurement -------------------------------------------------------------------------------------------


def _sync_device() -> None:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def _world_max(value: float) -> float:
    from .collectives import all_reduce

    tensor = torch.tensor([value], dtype=torch.float64, device=_device())
    return float(all_reduce(tensor, "max").item())


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


TARGET_S = {"target_s": 0.05}
"""Seconds each measurement aims to take (``--quick`` lowers it, for smoke tests)."""


def time_call(call: Callable[[], object], *, target_s: float | None = None, max_iters: int = 200) -> float:
    """Mean seconds per call, the slowest rank's, over an iteration count every rank agrees on."""
    from .collectives import barrier

    call()
    call()
    _sync_device()
    start = time.perf_counter()
    call()
    _sync_device()
    first = max(time.perf_counter() - start, 1e-6)
    target_s = TARGET_S["target_s"] if target_s is None else min(target_s, TARGET_S["target_s"])
    iters = int(_world_max(min(max_iters, max(3, target_s / first))))
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync_device()
    return _world_max((time.perf_counter() - start) / iters)


def _colo_call(op: str, nbytes: int, group, dtype: torch.dtype, algorithm: str | None) -> Callable[[], object]:
    from . import collectives
    from .algorithms import force_algorithm

    n = group.size
    element = torch.tensor([], dtype=dtype).element_size()
    count = max(n, (nbytes // element) // n * n)
    device = _device()
    if op == "all_reduce":
        buffer = torch.zeros(count, dtype=dtype, device=device)
        return lambda: collectives.all_reduce(buffer, group=group)
    if op in ("all_gather", "reduce_scatter"):
        if op == "all_gather":
            data = torch.zeros(count // n, dtype=dtype, device=device)
            function = collectives.all_gather
        else:
            data = torch.zeros(count, dtype=dtype, device=device)
            function = collectives.reduce_scatter
        if algorithm is None:
            return lambda: function(data, group=group)

        def forced() -> object:
            with force_algorithm(op, algorithm):
                return function(data, group=group)

        return forced
    if op == "all_to_all":
        data = torch.zeros(count, dtype=dtype, device=device)
        return lambda: collectives.all_to_all(data, group=group)
    if op == "broadcast":
        buffer = torch.zeros(count, dtype=dtype, device=device)
        return lambda: collectives.broadcast(buffer, src=0, group=group)
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


def _raw_call(op: str, nbytes: int, group, dtype: torch.dtype) -> Callable[[], object]:
    """The same collective through torch.distributed directly (what colo wraps)."""
    from .collectives import _all_gather_flat, _reduce_scatter_flat

    n, pg = group.size, group.process_group
    element = torch.tensor([], dtype=dtype).element_size()
    count = max(n, (nbytes // element) // n * n)
    device = _device()
    if op == "all_reduce":
        buffer = torch.zeros(count, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buffer, group=pg)
    if op == "all_gather":
        piece = torch.zeros(count // n, dtype=dtype, device=device)

        def gather() -> object:
            out = torch.empty(count, dtype=dtype, device=device)
            return _all_gather_flat(out, piece, group=pg)

        return gather
    if op == "reduce_scatter":
        full = torch.zeros(count, dtype=dtype, device=device)

        def scatter() -> object:
            out = torch.empty(count // n, dtype=dtype, device=device)
            return _reduce_scatter_flat(out, full, group=pg)

        return scatter
    if op == "all_to_all":
        data = torch.zeros(count, dtype=dtype, device=device)

        def exchange() -> object:
            out = torch.empty_like(data)
            return dist.all_to_all_single(out, data, group=pg)

        return exchange
    if op == "broadcast":
        buffer = torch.zeros(count, dtype=dtype, device=device)
        return lambda: dist.broadcast(buffer, src=group.ranks[0], group=pg)
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


# --- the three modes -------------------------------------------------------------------------------------------


def _axes_to_measure(mesh) -> list[tuple[str, ...]]:
    axes = [(name,) for name, size in mesh.shape.items() if size > 1]
    if len(axes) > 1:
        axes.append(tuple(mesh.axis_names))
    return axes or [tuple(mesh.axis_names)]


def bandwidth_rows(mesh, ops, sizes, dtype) -> list[dict]:
    """Bandwidth of each op per size on each mesh axis (and all axes fused)."""
    from .algorithms import choose_algorithm

    rows = []
    for axes in _axes_to_measure(mesh):
        group = mesh.group(*axes)
        n = group.size
        for op in ops:
            for nbytes in sizes:
                seconds = time_call(_colo_call(op, nbytes, group, dtype, None))
                algorithm = choose_algorithm(op, group.backend, nbytes)
                algbw = nbytes / seconds / 1e9
                rows.append(
                    {
                        "axis": group.name,
                        "group_size": n,
                        "op": op,
                        "bytes": nbytes,
                        "dtype": str(dtype).split(".")[-1],
                        "algorithm": algorithm,
                        "time_us": seconds * 1e6,
                        "algbw_gbps": algbw,
                        "busbw_gbps": algbw * BUS_FACTOR[op](n),
                    }
                )
    return rows


def calibration_rows(group, sizes, dtype, rounds: int = 1) -> tuple[list[dict], dict]:
    """Time every implementation of each op with alternatives, per size; return the rows and the table.

    The table switches to the non-native implementation from the smallest size at which it is fastest for that
    size and every larger one measured (so one noisy small size does not flip the choice).
    """
    from .algorithms import ALTERNATIVES

    rows = []
    table: dict[str, list[list]] = {}
    for op, names in ALTERNATIVES.items():
        fastest = []
        for nbytes in sizes:
            calls = {name: _colo_call(op, nbytes, group, dtype, name) for name in names}
            samples: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(rounds):  # alternate the implementations, then take medians: robust to a noisy machine
                for name, call in calls.items():
                    samples[name].append(time_call(call))
            timings = {name: statistics.median(values) for name, values in samples.items()}
            best = min(timings, key=timings.get)
            fastest.append((nbytes, best))
            rows.append(
                {"op": op, "bytes": nbytes, **{f"{k}_us": v * 1e6 for k, v in timings.items()}, "fastest": best}
            )
        entries: list[list] = [[0, "native"]]
        for index, (nbytes, _) in enumerate(fastest):
            if all(best != "native" for _, best in fastest[index:]):
                entries = [[0 if index == 0 else nbytes, fastest[index][1]]]
                if index:
                    entries.insert(0, [0, "native"])
                break
        table[op] = entries
    return rows, {group.backend: table}


def overhead_rows(group, ops, sizes, dtype, rounds: int) -> list[dict]:
    """colo's wrappers against raw torch.distributed, alternating rounds; median of per-round time ratios."""
    rows = []
    for op in ops:
        for nbytes in sizes:
            raw = _raw_call(op, nbytes, group, dtype)
            # the same (native) implementation on both sides: this measures the wrapper, not the algorithm choice
            colo = _colo_call(op, nbytes, group, dtype, "native" if op in ("all_gather", "reduce_scatter") else None)
            ratios, raw_times, colo_times = [], [], []
            for _ in range(rounds):
                raw_s = time_call(raw, target_s=0.02)
                colo_s = time_call(colo, target_s=0.02)
                raw_times.append(raw_s)
                colo_times.append(colo_s)
                ratios.append(colo_s / raw_s)
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "raw_us": statistics.median(raw_times) * 1e6,
                    "colo_us": statistics.median(colo_times) * 1e6,
                    "ratio": statistics.median(ratios),
                }
            )
    return rows


def _print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    rows = _with_size_labels(rows)
    print(f"\n# {title}")
    print(
        "".join(
            f"{header:>{width}}" for header, _, width in ((h, k, w.split(".")[0].lstrip("<>")) for h, k, w in columns)
        )
    )
    for row in rows:
        print("".join(format(row[key], spec) for _, key, spec in columns))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _with_size_labels(rows: list[dict]) -> list[dict]:
    return [dict(row, size=format_size(row["bytes"])) for row in rows]


def _environment() -> dict:
    return {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name() if dist.get_backend() == "nccl" else f"cpu ({_cpu_model()})",
        "omp_threads": torch.get_num_threads(),
    }


def run(args: argparse.Namespace) -> dict:
    """The benchmark on this rank (torch.distributed already initialised); returns the results on every rank."""
    from .mesh import Mesh

    if args.quick:
        TARGET_S["target_s"] = 0.002
    dtype = getattr(torch, args.dtype)
    sizes = size_range(parse_size(args.min_bytes), parse_size(args.max_bytes))
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"--ops {unknown[0]!r} is unknown; choose from {','.join(OPS)}")
    shape = parse_mesh(args.mesh) if args.mesh else {"world": dist.get_world_size()}
    mesh = Mesh(**shape)
    result = {"environment": _environment(), "mesh": shape}
    rank0 = dist.get_rank() == 0
    if args.calibrate:
        group = mesh.group(*mesh.axis_names)
        rows, table = calibration_rows(group, sizes, dtype, args.rounds)
        result.update(calibration=rows, table=table)
        if rank0:
            _print_table(
                f"implementations per op (us), {group.size} ranks",
                rows,
                [
                    ("op", "op", ">16"),
                    ("size", "size", ">12"),
                    *[(f"{k}", f"{k}_us", ">14.1f") for k in ("native", "all_reduce")],
                    ("fastest", "fastest", ">12"),
                ],
            )
            print(f"\ntable: {json.dumps(table)}")
    elif args.vs_raw:
        group = mesh.group(*mesh.axis_names)
        rows = overhead_rows(group, ops, sizes, dtype, args.rounds)
        result["overhead"] = rows
        if rank0:
            _print_table(
                f"colo wrappers vs raw torch.distributed, {group.size} ranks, median of {args.rounds} "
                "alternating rounds",
                rows,
                [
                    ("op", "op", ">16"),
                    ("size", "size", ">12"),
                    ("raw us", "raw_us", ">12.1f"),
                    ("colo us", "colo_us", ">12.1f"),
                    ("colo/raw", "ratio", ">10.3f"),
                ],
            )
    else:
        rows = bandwidth_rows(mesh, ops, sizes, dtype)
        result["bandwidth"] = rows
        if rank0:
            env = result["environment"]
            _print_table(
                f"colo.comm bandwidth: mesh {shape}, {env['backend']}, {env['world_size']} ranks, {env['device']}",
                rows,
                [
                    ("axis", "axis", ">8"),
                    ("op", "op", ">16"),
                    ("size", "size", ">11"),
                    ("dtype", "dtype", ">9"),
                    ("algorithm", "algorithm", ">12"),
                    ("time(us)", "time_us", ">12.1f"),
                    ("algbw(GB/s)", "algbw_gbps", ">13.3f"),
                    ("busbw(GB/s)", "busbw_gbps", ">13.3f"),
                ],
            )
    return result


def _run_on_rank(argv: list[str]) -> dict:
    return run(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m colo.comm.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start when not under torchrun")
    parser.add_argument("--mesh", default="", help="mesh shape, outer to inner, e.g. dp=2,tp=2 (default: one axis)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--min-bytes", default="4K", help="smallest buffer (default 4K)")
    parser.add_argument("--max-bytes", default="16M", help="largest buffer (default 16M); sizes step by x4")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--calibrate", metavar="PATH", help="time each op's implementations; write the table here")
    parser.add_argument("--vs-raw", action="store_true", help="compare colo's wrappers with raw torch.distributed")
    parser.add_argument(
        "--rounds", type=int, default=7, help="alternating rounds for --vs-raw and --calibrate (medians)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="few iterations per measurement (a smoke test)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        from .distributed import init_distributed

        init_distributed(args.backend)
        result = run(args)
        if dist.get_rank() != 0:
            return 0
    else:
        from .launch import launch

        threads = 1 if (os.cpu_count() or 1) <= args.nprocs * 2 else None
        result = launch(_run_on_rank, args.nprocs, argv, backend=args.backend, threads=threads)[0]
    if args.calibrate:
        Path(args.calibrate).write_text(json.dumps({"table": result["table"], "measured": result}, indent=2))
        print(f"wrote {args.calibrate}; use it with COLO_COMM_ALGORITHMS={args.calibrate}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
