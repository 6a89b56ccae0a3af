#!/usr/bin/env python3
"""colo.comm's wrappers against raw torch.distributed, side by side in one run, 4 KB to 16 MB messages.

Two runs, each alternating rounds of raw and colo calls (the same native implementation on both sides, so this
measures the wrapper: validation, accounting, handles) and reporting the median of the per-round ratios
colo / raw and of the per-round differences:

- 1 rank: the collectives are local copies, so the difference is the wrapper's own CPU cost per call;
- 2 ranks (gloo on loopback): the ratio a user sees. Goal: within 5% (ratio <= 1.05) from 1 MB up.

Writes JSON under benchmarks/results/ (``comm_overhead_cpu_<n>rank.json``).

    python benchmarks/comm_overhead.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colo.comm import bench

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    for nprocs in args.nprocs:
        bench.main([
            "--nprocs", str(nprocs), "--vs-raw", "--rounds", str(args.rounds),
            "--ops", "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast",
            "--min-bytes", "4K", "--max-bytes", "16M", "--json", str(RESULTS / f"comm_overhead_cpu_{nprocs}rank.json"),
        ])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
