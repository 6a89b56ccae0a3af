#!/usr/bin/env python3
"""What the test harness costs: starting a pool of ranks, and one small distributed call on a warm pool.

python benchmarks/harness_cost.py [--calls 50]
"""

from __future__ import annotations

import argparse
import time

import torch

from colo.comm import all_reduce
from colo.comm.testing import RankPool


def _small_collective() -> float:
    return all_reduce(torch.ones(4)).sum().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    for world_size in args.world_sizes:
        pool = RankPool(world_size)
        begin = time.perf_counter()
        pool.run(_small_collective)
        start_s = time.perf_counter() - begin
        begin = time.perf_counter()
        for _ in range(args.calls):
            pool.run(_small_collective)
        per_call_ms = (time.perf_counter() - begin) / args.calls * 1000
        pool.close()
        print(f"{world_size} ranks: pool start {start_s:.2f} s, warm small test {per_call_ms:.2f} ms per call")


if __name__ == "__main__":
    main()
