"""colo.tensor: layouts over a mesh, redistribution, autograd communication ops and 1D tensor-parallel layers.

A distributed tensor is a plain ``torch.Tensor`` holding this rank's piece, with a `Layout` attached: one
placement (`Shard`, `Replicate`, `Partial`) per mesh axis and the global shape. `distribute`, `redistribute`
and `gather` move between layouts with the cheapest planned collectives (`plan_redistribute` reports them and
their volume); `to_dtensor` / `from_dtensor` convert to and from torch's DTensor. The parallel layers
(`ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`, `vocab_parallel_cross_entropy`) are
built from the autograd communication steps in `colo.tensor.comm_ops`; `parallelize(model, mesh, plan)` applies
them to a model from outside, by a plan of module-name patterns and styles (`Colwise`, `Rowwise`,
`VocabParallel`, `FusedQKV`, `PrepareInput`, `PrepareOutput`, `ShardedRNG`), also from the meta device.
`RNGTracker` / `seed_tensor_parallel` keep dropout reproducible and correct in sharded and replicated regions.
"""

from .activations import convert_activation
from .checkpoint import (
    CheckpointError,
    FlatShard,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from .comm_ops import (
    all_gather_reduce_scatter,
    all_gather_split,
    all_reduce_copy,
    all_to_all_resplit,
    copy_all_reduce,
    reduce_scatter_all_gather,
    split_all_gather,
)
from .dtensor import device_mesh_of, from_dtensor, to_dtensor
from .layers import ColumnParallelLinear, RowParallelLinear
from .layout import Layout, distribute, layout_of, set_layout
from .parallelize import match_modules, parallelize
from .placement import Partial, Placement, Replicate, Shard
from .qkv import QKVParallelLinear, valid_tp_sizes
from .random import MODEL_PARALLEL_STREAM, RNGTracker, model_parallel_seed, seed_tensor_parallel
from .redistribute import RedistributePlan, RedistributeStep, gather, plan_redistribute, redistribute
from .styles import (
    Colwise,
    FusedQKV,
    ParallelStyle,
    PrepareInput,
    PrepareOutput,
    Rowwise,
    ShardedRNG,
    StyleTarget,
    VocabParallel,
)
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "FlatShard",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "ColumnParallelLinear",
    "Colwise",
    "FusedQKV",
    "Layout",
    "MODEL_PARALLEL_STREAM",
    "ParallelStyle",
    "Partial",
    "Placement",
    "PrepareInput",
    "PrepareOutput",
    "QKVParallelLinear",
    "RNGTracker",
    "RedistributePlan",
    "RedistributeStep",
    "Replicate",
    "RowParallelLinear",
    "Rowwise",
    "Shard",
    "ShardedRNG",
    "StyleTarget",
    "VocabParallel",
    "VocabParallelEmbedding",
    "__version__",
    "all_gather_reduce_scatter",
    "all_gather_split",
    "all_reduce_copy",
    "all_to_all_resplit",
    "convert_activation",
    "copy_all_reduce",
    "device_mesh_of",
    "distribute",
    "from_dtensor",
    "gather",
    "layout_of",
    "match_modules",
    "model_parallel_seed",
    "parallelize",
    "plan_redistribute",
    "redistribute",
    "reduce_scatter_all_gather",
    "seed_tensor_parallel",
    "set_layout",
    "split_all_gather",
    "to_dtensor",
    "valid_tp_sizes",
    "vocab_parallel_cross_entropy",
]
