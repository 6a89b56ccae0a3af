#!/usr/bin/env python3
"""Where a data-parallel step's time goes on 2 CPU ranks: colo ZeRO-1/2/3 next to torch DDP / FSDP2 and no sync.

The model, data and optimizer of ``benchmarks/zero_dp.py`` (BENCHMARKS.md's recipe), one shape per run. Each
row runs in fresh processes; per step, wall-clock phases on each rank (medians over the timed steps, then the
max over ranks):

- ``forward`` (model call with the loss), ``backward`` (``loss.backward()`` / ``zero.backward``), ``step``
  (optimizer step, for colo the whole ``ZeroOptimizer.step``), ``zero_grad``;
- for colo, inside those, by wrapping ``ZeroOptimizer``'s methods on the instance from outside (nothing in
  ``colo.zero`` is changed): ``grad_sync`` (``zero.grad_sync.finish``: issuing what is left and waiting for the
  reduce-scatters), ``optimizer`` (the torch AdamW step on the shards), ``refresh`` (``zero.param_sync.refresh``: the
  all-gather of the updated parameters, stages 1/2), ``reduce_scatter_issue`` (calls of ``reduce_scatter``,
  including its copies), and at stage 3 ``gather_forward`` / ``gather_backward`` (``ChunkGatherer.gather``,
  waiting on all-gathers);
- ``local``: both ranks train their own replica with no communication at all, the compute floor when two ranks
  share the machine;
- the minor page faults per step (``getrusage``): memory touched for the first time, which on the host costs a
  fault and a zero fill per 4 KiB page (what ZeRO's pooled buffers avoid).

``--comm`` times the collectives themselves on this machine (2 ranks, gloo), at the size of the whole model in
fp32 (colo's default chunk search packs this model into one chunk): ``torch.distributed.all_reduce``, native
``reduce_scatter_tensor`` and ``all_gather_into_tensor``, colo's ``reduce_scatter`` / ``all_gather`` (which pick
the algorithm per size), and the local copies a ZeRO step makes (``torch.zeros`` of a chunk, a clone).

``--chunk-numel`` passes ``ZeroConfig(chunk_numel=...)`` to the colo rows, to see what smaller chunks (overlap of
communication with backward, ZeRO-3 prefetch) would give. ``--torch-profile`` prints torch.profiler's top ops of
rank 0 for each row.

    python benchmarks/zero_profile.py [--shape overhead|compute] [--impls local ddp colo_zero2 ...] [--steps 6]
        [--chunk-numel N] [--comm] [--torch-profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_dp import LR, SHAPES, build_model, token_batch  # noqa: E402

IMPLS = ("local", "ddp", "fsdp2", "colo_zero1", "colo_zero2", "colo_zero3")


class PhaseTimer:
    """Seconds per named phase, accumulated within a step and recorded per step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.mode = "forward"

    def add(self, name: str, seconds: float, cpu_seconds: float | None = None) -> None:
        self.current[name] += seconds
        if cpu_seconds is not None:
            self.current[f"cpu:{name}"] += cpu_seconds

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            begin, cpu_begin = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - begin, time.process_time() - cpu_begin)

        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)


def _setup(impl: str, model: torch.nn.Module, timer: PhaseTimer, chunk_numel: int | None):
    """Returns ``(train_model, backward(loss), step(), zero_grad(), info)`` for the row."""
    import torch.distributed as dist

    optimizer_for = lambda params: torch.optim.AdamW(params, lr=LR, fused=True)
    if impl in ("local", "ddp", "fsdp2"):
        train_model = model
        if impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            train_model = DistributedDataParallel(model)
        elif impl == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = optimizer_for(model.parameters())
        return train_model, lambda loss: loss.backward(), optimizer.step, lambda: optimizer.zero_grad(True), {}

    import colo.zero.grad_sync as grad_sync_module
    from colo.comm import Mesh
    from colo.zero import ZeroOptimizer

    stage = int(impl[-1])
    mesh = Mesh(dp=dist.get_world_size())
    zero = ZeroOptimizer(model, optimizer_for(model.parameters()), mesh=mesh, stage=stage, chunk_numel=chunk_numel)
    zero.grad_sync.finish = timer.wrap("grad_sync", zero.grad_sync.finish)
    zero.param_sync.refresh = timer.wrap("refresh", zero.param_sync.refresh)
    zero.optimizer.step = timer.wrap("optimizer", zero.optimizer.step)
    grad_sync_module.reduce_scatter = timer.wrap("reduce_scatter_issue", grad_sync_module.reduce_scatter)
    if zero.gatherer is not None:
        gather = zero.gatherer.gather

        def timed_gather(chunk):
            begin, cpu_begin = time.perf_counter(), time.process_time()
            gather(chunk)
            timer.add(f"gather_{timer.mode}", time.perf_counter() - begin, time.process_time() - cpu_begin)

        zero.gatherer.gather = timed_gather
    info = {"num_chunks": len(zero.chunks), "chunk_numel": [chunk.numel for chunk in zero.chunks]}
    return model, zero.backward, zero.step, zero.zero_grad, info


def profile_row(impl: str, batch: int, seq: int, num_steps: int, num_warmup: int, chunk_numel, torch_profile: bool):
    """One rank: phase times per timed step (and rank 0's torch.profiler table when asked)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build_model(0)
    timer = PhaseTimer()
    train_model, backward, step, zero_grad, info = _setup(impl, model, timer, chunk_numel)
    profiler = None
    faults: list[int] = []
    for index in range(num_warmup + num_steps):
        if index == num_warmup:
            dist.barrier()
            timer.steps.clear()
            if torch_profile:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
        tokens = token_batch(0, index, rank, batch, seq)
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        clocks = [(time.perf_counter(), time.process_time())]
        timer.mode = "forward"
        loss = train_model(input_ids=tokens, labels=tokens, use_cache=False).loss
        clocks.append((time.perf_counter(), time.process_time()))
        timer.mode = "backward"
        backward(loss)
        clocks.append((time.perf_counter(), time.process_time()))
        step()
        clocks.append((time.perf_counter(), time.process_time()))
        zero_grad()
        clocks.append((time.perf_counter(), time.process_time()))
        for name, (begin, end) in zip(("forward", "backward", "step", "zero_grad"), itertools.pairwise(clocks)):
            timer.add(name, end[0] - begin[0], end[1] - begin[1])
        timer.add("total", clocks[-1][0] - clocks[0][0], clocks[-1][1] - clocks[0][1])
        if index >= num_warmup:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
        timer.end_step()
    table = None
    if profiler is not None:
        profiler.__exit__(None, None, None)
        if rank == 0:
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    names = sorted({name for step in timer.steps for name in step})
    medians = {name: statistics.median(step.get(name, 0.0) for step in timer.steps) for name in names}
    info = {**info, "page_faults_per_step": statistics.median(faults)}
    return {"rank": rank, "phases_s": medians, "info": info, "profile": table}


def comm_row(numel: int, repeats: int) -> dict:
    """Median seconds of the collectives and copies a ZeRO step makes, for a flat fp32 buffer of ``numel``."""
    import torch.distributed as dist

    from colo.comm import all_gather, reduce_scatter

    torch.set_num_threads(1)
    world = dist.get_world_size()
    full = torch.randn(numel)
    shard = full[: numel // world].clone()
    shard_out, full_out = torch.empty_like(shard), torch.empty_like(full)  # preallocated, as DDP's buckets are
    cases = {
        "torch all_reduce (full)": lambda: dist.all_reduce(full),
        "torch reduce_scatter_tensor (full -> shard)": lambda: dist.reduce_scatter_tensor(shard_out, full),
        "torch all_gather_into_tensor (shard -> full)": lambda: dist.all_gather_into_tensor(full_out, shard),
        "colo reduce_scatter (full -> shard)": lambda: reduce_scatter(full, "sum"),
        "colo all_gather (shard -> full)": lambda: all_gather(shard),
        "torch.zeros(full)": lambda: torch.zeros(numel),
        "clone(full)": lambda: full.clone(),
    }
    result = {}
    for name, fn in cases.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        result[name] = statistics.median(times)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="overhead")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk-numel", type=int, default=None)
    parser.add_argument("--comm", action="store_true", help="also time the collectives at the model's size")
    parser.add_argument("--comm-repeats", type=int, default=7)
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    from colo.comm import launch

    env = {"OMP_NUM_THREADS": "1"}
    batch, seq = SHAPES[args.shape]
    output: dict = {"shape": args.shape, "batch": batch, "seq": seq, "chunk_numel": args.chunk_numel, "rows": {}}
    if args.comm:
        numel = sum(p.numel() for p in build_model(0).parameters())
        per_rank = launch(comm_row, 2, numel, args.comm_repeats, backend="gloo", threads=1, env=env)
        output["comm_ms"] = {name: 1e3 * max(r[name] for r in per_rank) for name in per_rank[0]}
        print(f"collectives at {numel * 4 / 2**20:.0f} MiB (fp32 model), 2 ranks, gloo, median of {args.comm_repeats}:")
        for name, ms in output["comm_ms"].items():
            print(f"  {name:<46}{ms:8.1f} ms")
    for impl in args.impls:
        per_rank = launch(
            profile_row, 2, impl, batch, seq, args.steps, args.warmup, args.chunk_numel, args.torch_profile,
            backend="gloo", threads=1, env=env,
        )  # fmt: skip
        phases = {name: 1e3 * max(r["phases_s"].get(name, 0.0) for r in per_rank) for name in per_rank[0]["phases_s"]}
        output["rows"][impl] = {"phases_ms": phases, **per_rank[0]["info"]}
        output["rows"][impl]["page_faults_per_step"] = max(r["info"]["page_faults_per_step"] for r in per_rank)
        if per_rank[0]["profile"]:
            print(f"--- {impl}: torch.profiler, rank 0\n{per_rank[0]['profile']}")
    order = ["total", "forward", "backward", "step", "zero_grad"]
    names = {name for row in output["rows"].values() for name in row["phases_ms"] if not name.startswith("cpu:")}
    columns = order + sorted(names - set(order))
    width = max(len(name) for name in columns) + 2
    for kind, prefix in (("wall", ""), ("CPU (process_time: every thread of the rank, gloo's included)", "cpu:")):
        print(f"\n{args.shape}-bound ({batch}x{seq} tokens/rank/step), {kind} ms per step (median over steps, max "
              "over ranks):")  # fmt: skip
        print(f"{'':<12}" + "".join(f"{name:>{width}}" for name in columns))
        for impl, row in output["rows"].items():
            cells = "".join(f"{row['phases_ms'].get(prefix + name, float('nan')):>{width}.1f}" for name in columns)
            print(f"{impl:<12}{cells}")
    print("\nminor page faults per step (fresh memory touched; median over steps, max over ranks): " + ", ".join(
        f"{impl} {row['page_faults_per_step']:.0f}" for impl, row in output["rows"].items()
    ))  # fmt: skip
    for impl, row in output["rows"].items():
        if "num_chunks" in row:
            print(f"{impl}: {row['num_chunks']} chunk(s) of {row['chunk_numel']} elements")
    if args.json:
        Path(args.json).write_text(json.dumps(output, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
