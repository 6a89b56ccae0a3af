#!/usr/bin/env python3
"""Where a profiled training step's time goes: the GPU kernels with the most time and the colo ranges, from a torch
profiler Chrome trace (a colo run's ``OUTPUT_DIR/profile/rank-R-step-N.json``, written with ``profile.every_steps``).

    python scripts/trace_summary.py TRACE.json [--top 30] [--json OUT.json]

Prints (and writes as JSON) the GPU kernels grouped by name (total ms, calls, share of all kernel time), the busy
time of the GPU (kernels and memcpy/memset, overlaps merged) against the traced wall time, and the colo ranges
(``colo.forward``, ``colo.optimizer``, ...) by name with their total duration and count. A large trace that cannot
come back from a GPU machine reduces to this small summary there.
"""

from __future__ import annotations

import argparse
import collections
import json


def summarize(path: str, top: int) -> dict:
    with open(path) as handle:
        data = json.load(handle)
    events = data["traceEvents"] if isinstance(data, dict) else data
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    ranges: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    busy, wall = [], []
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        start, duration, name = event.get("ts"), event.get("dur"), str(event.get("name", ""))
        if not isinstance(start, (int, float)) or not isinstance(duration, (int, float)):
            continue
        wall.append((start, start + duration))
        category = event.get("cat", "")
        if category == "kernel":
            kernels[name].append(duration)
        if category in ("kernel", "gpu_memcpy", "gpu_memset"):
            busy.append((start, start + duration))
        if name.startswith("colo."):
            ranges[(name, category)].append(duration)
    merged_us, end = 0.0, float("-inf")
    for start, stop in sorted(busy):
        if stop > end:
            merged_us += stop - max(start, end)
            end = stop
    total_kernel_us = sum(sum(durations) for durations in kernels.values()) or 1.0
    rows = sorted(
        ({"name": name[:140], "ms": sum(d) / 1e3, "calls": len(d), "share": sum(d) / total_kernel_us}
         for name, d in kernels.items()),
        key=lambda row: -row["ms"],
    )  # fmt: skip
    span_us = (max(stop for _, stop in wall) - min(start for start, _ in wall)) if wall else 0.0
    return {
        "trace": path,
        "kernel_ms": total_kernel_us / 1e3,
        "gpu_busy_ms": merged_us / 1e3,
        "traced_wall_ms": span_us / 1e3,
        "kernels": rows[:top],
        "colo_ranges": [
            {"name": name, "category": category, "ms": sum(d) / 1e3, "count": len(d)}
            for (name, category), d in sorted(ranges.items(), key=lambda item: -sum(item[1]))
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    summary = summarize(args.trace, args.top)
    print(
        f"{summary['trace']}: kernels {summary['kernel_ms']:.1f} ms, GPU busy {summary['gpu_busy_ms']:.1f} ms "
        f"of {summary['traced_wall_ms']:.1f} ms traced"
    )
    for row in summary["kernels"]:
        print(f"{row['ms']:9.2f} ms {row['calls']:6d} {100 * row['share']:5.1f}%  {row['name'][:100]}")
    for row in summary["colo_ranges"]:
        print(f"{row['ms']:9.2f} ms {row['count']:6d}  {row['name']} ({row['category']})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)


if __name__ == "__main__":
    main()
