"""Inside ``torch.compile`` every colo collective is one graph with the code around it (torch's functional
collectives, `colo.comm.traced`) and returns exactly what the eager call returns, on 2 ranks.

``fullgraph=True`` makes any graph break an error. Inputs are random floats and the comparison is bitwise: a gather,
a broadcast or an all-to-all moves bits, and each reduction reduces the same copies in the same order as eager's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colo.comm import (
    CommTracker,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    force_algorithm,
    reduce_scatter,
    traced,
    world_group,
)
from colo.comm.testing import run_distributed
from colo.comm.traced import TRACEABLE


def _collectives(x: torch.Tensor, uneven: torch.Tensor) -> dict[str, torch.Tensor]:
    group, rank = world_group(), dist.get_rank()
    received_rows = [1, 1] if rank == 0 else [3, 3]  # every rank sends 1 row to rank 0 and 3 to rank 1
    return {
        "all_reduce": all_reduce(x.clone(), group=group),
        "all_reduce avg": all_reduce(x.clone(), "avg", group=group),
        "all_reduce max, async": all_reduce(x.clone(), "max", group=group, async_op=True).wait(),
        "broadcast": broadcast(x.clone(), src=1, group=group),
        "all_gather": all_gather(x, group=group),
        "all_gather dim 1": all_gather(x, group=group, dim=1),
        "all_gather uneven": all_gather(uneven, group=group, sizes=[1, 2]),
        "all_gather out": all_gather(x, group=group, out=torch.empty(8, 6)),
        "reduce_scatter": reduce_scatter(x, group=group),
        "reduce_scatter dim 1": reduce_scatter(x, group=group, dim=1),
        "reduce_scatter avg, async": reduce_scatter(x, "avg", group=group, async_op=True).wait(),
        "all_to_all": all_to_all(x, group=group),
        "all_to_all uneven": all_to_all(x, group=group, input_split_sizes=[1, 3], output_split_sizes=received_rows),
    }


REDUCE_SCATTER_FORMS = ("native", "all_reduce", "all_to_all", "p2p")
"""Every form eager's algorithm table may choose for a reduce-scatter (`colo.comm.algorithms`)."""


def _traced_reduce_scatter_forms(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The compiled reduce-scatter in each form (a compiled call takes the one eager's table chooses for its size)."""
    return {form: traced.reduce_scatter(x, "sum", form, world_group()) for form in REDUCE_SCATTER_FORMS}


def _compiled_and_eager_results() -> list[str]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, uneven = torch.randn(4, 6, generator=generator), torch.randn(dist.get_rank() + 1, 3, generator=generator)
    eager = _collectives(x, uneven)
    for form in REDUCE_SCATTER_FORMS:
        with force_algorithm("reduce_scatter", form):
            eager[form] = reduce_scatter(x, group=world_group())
    torch._dynamo.reset()
    # dynamo's graph capture is what is tested here ("eager" runs the captured graph as it is); the Llama tests in
    # colo-apps compile tensor-parallel blocks with aot_eager (AOTAutograd's functionalization around these ops)
    compiled = torch.compile(
        lambda x, uneven: {**_collectives(x, uneven), **_traced_reduce_scatter_forms(x)},
        backend="eager",
        fullgraph=True,
    )
    with CommTracker() as tracker:
        traced_results = compiled(x, uneven)
    differing = [name for name in eager if not torch.equal(eager[name], traced_results[name])]
    if tracker.calls():
        differing.append(f"the tracker counted {tracker.calls()} compiled calls")
    return differing


@pytest.mark.skipif(not TRACEABLE, reason="compiled code uses the traced collectives from torch 2.13")
def test_compiled_collectives_are_one_graph_and_equal_the_eager_calls_bit_for_bit():
    for differing in run_distributed(_compiled_and_eager_results, world_size=2):
        assert differing == []
