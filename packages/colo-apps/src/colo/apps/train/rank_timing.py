"""Per-rank timing (``logging.rank_timing``): every rank times its steps' phases (`colo.apps.booster.timing`),
and at every logged step one small all-gather brings each rank's per-step means to every rank; the log line names
the slowest rank and its lag, ``metrics.jsonl`` holds the whole table."""

from __future__ import annotations

import statistics

import torch

from colo.comm import all_gather, world_group

from ..booster.replicas import comm_device
from ..booster.timing import PHASES, StepTimer

BUSY = ("forward_s", "backward_s", "optimizer_s")
"""The phases that make a rank slow (communication wait is what the others spend waiting for it)."""


class RankTiming:
    """Times this rank's steps through the booster and gathers every rank's times when asked.

    Args:
        booster: the run's `Booster` (its steps are timed from now on).
        device: the compute device.
    """

    def __init__(self, booster, *, device: torch.device) -> None:
        self.timer = StepTimer(device)
        booster.set_step_timer(self.timer)
        self.group = world_group()
        self.steps = 0

    def step_done(self) -> None:
        """Count a step (the gathered times are per-step means over the steps since the last gather)."""
        self.steps += 1

    def gather(self) -> dict:
        """Every rank calls it: one all-gather of each rank's per-step mean seconds per phase since the last call.

        Returns:
            ``{"rank_timing": {rank: {"forward_s", "backward_s", "optimizer_s", "comm_wait_s"}},
            "rank_timing_slowest": r, "rank_timing_lag": lag}`` where the slowest rank spends the most time in
            forward + backward + optimizer, ``lag`` being how much more than the median rank, as a fraction (0.23:
            23% more).
        """
        taken = self.timer.take()
        steps, self.steps = max(self.steps, 1), 0
        keys = [f"{kind}_s" for kind in PHASES]
        mine = torch.tensor([taken[key] / steps for key in keys], dtype=torch.float64, device=comm_device(self.group))
        rows = all_gather(mine.reshape(1, -1), group=self.group).cpu().tolist()
        table = {str(rank): dict(zip(keys, row)) for rank, row in enumerate(rows)}
        busy = [sum(times[key] for key in BUSY) for times in table.values()]
        slowest = max(range(len(busy)), key=busy.__getitem__)
        median = statistics.median(busy)
        lag = busy[slowest] / median - 1.0 if median > 0 else 0.0
        return {"rank_timing": table, "rank_timing_slowest": slowest, "rank_timing_lag": lag}


def timing_text(record: dict) -> str:
    """The log line's part: ``" | slowest rank 1 +23%"`` (empty for a record without rank timing)."""
    if "rank_timing_slowest" not in record:
        return ""
    return f" | slowest rank {record['rank_timing_slowest']} {record['rank_timing_lag']:+.0%}"
