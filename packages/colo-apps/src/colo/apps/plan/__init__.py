"""`colo plan`: a memory and step-time model of colo's training layouts, and a search for the fastest that fits.

- `colo.apps.plan.memory`: per-rank memory term by term (colo.zero's chunk packing, the buffers its optimizers
  keep, activations from the Llama layer's saved tensors, KV cache);
- `colo.apps.plan.comm`: per-step communication volumes per collective and mesh axis (CommTracker's units);
- `colo.apps.plan.cluster`: hardware descriptions and presets;
- `colo.apps.plan.time`: step time from FLOPs, link models, overlap and colo.pipeline's simulator;
- `colo.apps.plan.search`: the layouts to consider and the search;
- `colo.apps.plan.report`: the ranked table and the run config of the best layout.
"""

from .cluster import CLUSTERS, Cluster, get_cluster
from .comm import DispatchBounds, dispatch_bounds, step_communication
from .layout import Layout
from .memory import activation_memory, memory_breakdown, static_memory
from .search import NothingFits, PlanResult, Workload, candidate_layouts, evaluate, search
from .time import StepTime, step_time

__all__ = [
    "DispatchBounds",
    "dispatch_bounds",
    "CLUSTERS",
    "Cluster",
    "Layout",
    "NothingFits",
    "PlanResult",
    "StepTime",
    "Workload",
    "activation_memory",
    "candidate_layouts",
    "evaluate",
    "get_cluster",
    "memory_breakdown",
    "search",
    "static_memory",
    "step_communication",
    "step_time",
]
