"""colo.pipeline: pipeline parallelism with schedules as data.

A schedule is, for each pipeline rank, a list of actions (forward ``F``, backward-for-input ``B``,
backward-for-weights ``W``, fused ``BW``, sends and receives) on (microbatch, model chunk). Generators build
the classic ones (`gpipe`, `one_f_one_b`, `interleaved_1f1b`, `zero_bubble_h1`); `validate` proves a schedule
complete and deadlock-free; `simulate` runs it on a cost model (makespan, bubble, peak live activations);
`render_text` / `render_png` draw its timeline; one `PipelineExecutor` runs any valid schedule; `partition`
splits a sequence of blocks into stages.

Example::

    from colo.comm import Mesh
    from colo.pipeline import PipelineExecutor, one_f_one_b, partition_uniform

    mesh = Mesh(pp=4)
    schedule = one_f_one_b(num_ranks=4, num_microbatches=8)
    parts = partition_uniform(blocks, num_stages=4)
    stage = parts[mesh.rank("pp")]
    executor = PipelineExecutor(stage, schedule=schedule, mesh=mesh, loss_fn=torch.nn.functional.cross_entropy)
    result = executor.step(tokens, targets)   # gradients in .grad, result.loss on every rank
    optimizer.step()
"""

from .actions import BACKWARD_OPS, BW, COMM_OPS, COMPUTE_OPS, Action, B, F, Schedule, W
from .backward import PendingWeightGrad, backward_input, backward_weight
from .executor import PipelineExecutor, PipelineStepResult
from .p2p import StageMeta, TensorMeta
from .partition import (
    build_stages,
    measure_block_times,
    partition_balanced,
    partition_by_parameters,
    partition_by_time,
    partition_uniform,
)
from .render import render_png, render_text
from .schedules import (
    GENERATORS,
    MicrobatchCountError,
    gpipe,
    interleaved_1f1b,
    loop_placement,
    make_schedule,
    one_f_one_b,
    with_communication,
    zero_bubble_h1,
)
from .simulate import CostModel, SimulationResult, TimelineEvent, simulate
from .validate import ScheduleError, ScheduleReport, peak_live_activations, validate

__version__ = "0.1.0"

__all__ = [
    "BACKWARD_OPS",
    "BW",
    "COMM_OPS",
    "COMPUTE_OPS",
    "GENERATORS",
    "Action",
    "B",
    "CostModel",
    "F",
    "PendingWeightGrad",
    "PipelineExecutor",
    "Schedule",
    "MicrobatchCountError",
    "ScheduleError",
    "ScheduleReport",
    "SimulationResult",
    "StageMeta",
    "PipelineStepResult",
    "TensorMeta",
    "TimelineEvent",
    "W",
    "__version__",
    "backward_input",
    "backward_weight",
    "build_stages",
    "gpipe",
    "interleaved_1f1b",
    "loop_placement",
    "make_schedule",
    "measure_block_times",
    "one_f_one_b",
    "partition_balanced",
    "partition_by_parameters",
    "partition_by_time",
    "partition_uniform",
    "peak_live_activations",
    "render_png",
    "render_text",
    "simulate",
    "validate",
    "with_communication",
    "zero_bubble_h1",
]
