"""The distributed test harness: every colo distributed test runs its ranks through `run_distributed`.

Starting ranks is the suite's main cost (a fresh process imports torch and joins a process group), so the
harness keeps one warm gang of ranks per world size for the whole pytest session and ships each test's
function to it. A rank that raises, dies or hangs fails that test (with the failing rank's traceback) within
the timeout, and the gang is rebuilt for the next test.

Example::

    def _check_sum(scale):                       # module level: the ranks import it by name
        t = torch.full((4,), float(dist.get_rank()))
        all_reduce(t)
        return t * scale

    def test_sum():
        results = run_distributed(_check_sum, 2.0, world_size=4)
        for result in results:
            torch.testing.assert_close(result, torch.full((4,), 12.0))
"""

from .markers import requires_cuda, requires_gpus
from .modules import load_beside
from .pool import RankPool, get_pool, run_distributed, shutdown_pools

__all__ = ["RankPool", "get_pool", "load_beside", "requires_cuda", "requires_gpus", "run_distributed", "shutdown_pools"]
