"""colo.tensor: layouts over a mesh, redistribution, autograd communication ops, 1D tensor and sequence parallelism.

A distributed tensor is a plain ``torch.Tensor`` holding this rank's piece, with a `Layout` attached: one
placement (`Shard`, `Replicate`, `Partial`) per mesh axis and the global shape. `distribute`, `redistribute`
and `gather` move between layouts with the cheapest planned collectives (`plan_redistribute` reports them and
their volume); `to_dtensor` / `from_dtensor` convert to and from torch's DTensor. The parallel layers
(`ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`, `vocab_parallel_cross_entropy`) are
built from the autograd communication steps in `colo.tensor.comm_ops`; `parallelize(model, mesh, plan)` applies
them to a model from outside, by a plan of module-name patterns and styles (`Colwise`, `Rowwise`,
`VocabParallel`, `FusedQKV`, `PrepareInput`, `PrepareOutput`, `ShardedRNG`), also from the meta device.
`RNGTracker` / `seed_tensor_parallel` keep dropout reproducible and correct in sharded and replicated regions.

Sequence parallelism, each mode switched on by the plan alone: Megatron-SP (``Colwise`` / ``FusedQKV`` with
``input_layout=Shard(1)``, ``Rowwise`` with ``output_layout=Shard(1)``, `SequenceParallel` on norms; the layers
are `SequenceParallelColumnLinear`, `SequenceParallelQKVLinear`, `SequenceParallelRowLinear`), Ulysses
(`UlyssesAttention`, `ulysses_attention`) and ring attention (`RingAttention`, `ring_attention`, zigzag
load-balanced for causal attention). `shard_sequence` / `gather_sequence` split and join a sequence in the
``"contiguous"`` or ``"zigzag"`` layout, padding lengths that do not divide.

2D / 2.5D / 3D tensor parallelism (`colo.tensor.tp2d`, `colo.tensor.tp3d`, on the grids of `colo.tensor.tp_grid`):
`grid_mesh(mode, tp, depth=...)` builds the mesh (sizes checked first, valid ones listed); `Linear2D` (SUMMA),
`QKVLinear2D`, `LayerNorm2D`, `RMSNorm2D`, `Embedding2D`, `VocabParallelEmbedding2D`, `cross_entropy_2d` run on a
q x q grid, or d stacked grids for 2.5D (Tesseract); `Linear3D`, `LayerNorm3D`, `Embedding3D`,
`VocabParallelEmbedding3D`, `attention_3d`, `cross_entropy_3d` on a q x q x q cube. `colo.tensor.grid_styles` has
their `parallelize` styles and `colo.tensor.tp_cost` the communication cost of every scheme per layer.

Checkpoints (`colo.tensor.checkpoint`): `save_checkpoint` / `load_checkpoint` in one sharded format for every
layout, `AsyncCheckpointer` for background saves, `export_hf` for a consolidated Hugging Face export.
"""

from .activations import convert_activation
from .checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    FlatShard,
    export_hf,
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
from .redistribute import gather, plan_redistribute, redistribute
from .redistribute_plan import RedistributePlan, RedistributeStep
from .ring_attention import RingAttentionCore, RingPlan, ring_attention, ring_attention_calls, ring_plan
from .sequence_parallel import (
    SequenceParallelColumnLinear,
    SequenceParallelQKVLinear,
    SequenceParallelRowLinear,
    all_gather_linear,
    sum_gradients_over,
)
from .sequence_styles import RingAttention, SequenceParallel, UlyssesAttention
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
from .tp2d import (
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    QKVLinear2D,
    RMSNorm2D,
    VocabParallelEmbedding2D,
    cross_entropy_2d,
    shard_batch,
)
from .tp3d import (
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    VocabParallelEmbedding3D,
    attention_3d,
    cross_entropy_3d,
    shard_3d,
)
from .tp_grid import GRID_AXES, TP_MODES, check_tp_size, grid_mesh, valid_grid_sizes
from .ulysses import ulysses_attention
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from .zigzag import SEQUENCE_LAYOUTS, gather_sequence, padded_seq_len, shard_positions, shard_sequence

__version__ = "0.1.0"

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "FlatShard",
    "export_hf",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "ColumnParallelLinear",
    "Embedding2D",
    "Embedding3D",
    "GRID_AXES",
    "LayerNorm2D",
    "LayerNorm3D",
    "Linear2D",
    "Linear3D",
    "QKVLinear2D",
    "RMSNorm2D",
    "TP_MODES",
    "VocabParallelEmbedding2D",
    "VocabParallelEmbedding3D",
    "attention_3d",
    "check_tp_size",
    "cross_entropy_2d",
    "cross_entropy_3d",
    "grid_mesh",
    "shard_3d",
    "shard_batch",
    "valid_grid_sizes",
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
    "RingAttention",
    "RingAttentionCore",
    "RowParallelLinear",
    "Rowwise",
    "SEQUENCE_LAYOUTS",
    "SequenceParallel",
    "SequenceParallelColumnLinear",
    "SequenceParallelQKVLinear",
    "SequenceParallelRowLinear",
    "Shard",
    "ShardedRNG",
    "StyleTarget",
    "UlyssesAttention",
    "VocabParallel",
    "VocabParallelEmbedding",
    "__version__",
    "all_gather_linear",
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
    "gather_sequence",
    "layout_of",
    "match_modules",
    "model_parallel_seed",
    "padded_seq_len",
    "parallelize",
    "plan_redistribute",
    "redistribute",
    "reduce_scatter_all_gather",
    "ring_attention",
    "ring_attention_calls",
    "ring_plan",
    "RingPlan",
    "seed_tensor_parallel",
    "set_layout",
    "shard_positions",
    "shard_sequence",
    "split_all_gather",
    "sum_gradients_over",
    "to_dtensor",
    "ulysses_attention",
    "valid_tp_sizes",
    "vocab_parallel_cross_entropy",
]
