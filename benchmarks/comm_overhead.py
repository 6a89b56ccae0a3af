#!/usr/bin/env python3
"""colo.comm's wrappers against raw torch.distributed, side by side in one run (2 local ranks, 4 KB to 16 MB).

Each op and size alternates rounds of raw and colo calls (the same native implementation on both sides, so this
measures the wrapper: validation, accounting, handles) and reports the median of the per-round time ratios
colo / raw. Goal: within 5% (ratio <= 1.05) from 1 MB up. Writes JSON under benchmarks/results/.

    python benchmarks/comm_overhead.py [--nprocs 2] [--json benchmarks/results/comm_overhead_cpu.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colo.comm import bench

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=str(RESULTS / "comm_overhead_cpu.json"))
    args = parser.parse_args()
    return bench.main(
        [
            "--nprocs",
            str(args.nprocs),
            "--vs-raw",
            "--rounds",
            str(args.rounds),
            "--ops",
            "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "16M",
            "--json",
            args.json,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
