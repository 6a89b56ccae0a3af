"""What the run config and the number of processes decide before any process starts: the plugin's mesh over the
world (tp x pp x sp dividing it, ep dividing it), the global batch over the data-parallel ranks and microbatches,
and the sequence length over the sequence shards. `colo launch` knows the world size and `colo train` reads it
from torchrun's environment (1 unlaunched), so these are one line and exit code 2 instead of a traceback per rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .loading import ConfigError
from .task import task_spec

if TYPE_CHECKING:
    from .config import RunConfig


def check_world_size(config: RunConfig, world_size: int) -> None:
    """Raise `ConfigError` (``invalid run config: FIELD: what is wrong; what to change``) when the run cannot be laid
    out on ``world_size`` processes.

    Args:
        config: the validated run config.
        world_size: processes in the job (``--nproc-per-node`` x ``--nnodes``).
    """
    plugin = config.plugin.build(num_microbatches=config.schedule.num_microbatches, seed=config.seed)
    try:
        shape = plugin.mesh_shape(world_size)
    except ValueError as error:
        raise ConfigError(
            f"invalid run config: plugin: {error} (the job has {world_size} process(es): change the plugin's sizes "
            "or colo launch --nproc-per-node)"
        ) from None
    if not task_spec(config.data.task).batches_rows_of_seq_len:  # the others check their batches where built
        return
    replicas = math.prod(shape.get(axis, 1) for axis in plugin.sample_axes(None))
    batch, microbatches = config.data.global_batch_size, config.schedule.num_microbatches
    if batch % replicas or (batch // replicas) % microbatches:
        raise ConfigError(
            f"invalid run config: data.global_batch_size={batch} does not split over the {replicas} data-parallel "
            f"rank(s) of {world_size} process(es) x schedule.num_microbatches={microbatches}; use a multiple of "
            f"{replicas * microbatches}"
        )
    if config.plugin.name == "hybrid":
        from ..booster.llama_plan import LlamaPlan

        try:
            LlamaPlan.check_sequence_length(config.data.seq_len, plugin)
        except ValueError as error:
            raise ConfigError(f"invalid run config: data.seq_len={config.data.seq_len}: {error}") from None
