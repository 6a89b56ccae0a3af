"""colo.comm: launch, the named-axis `Mesh`, collectives and p2p with async handles, and communication accounting.

Everything in colo communicates through this package: meshes are passed in (never read from a global),
collectives take a `Group` from ``mesh.group(...)``, and a `CommTracker` counts what moved, per op and axis.

Example::

    from colo.comm import Mesh, all_reduce, init_distributed

    init_distributed()                       # under torchrun, or a single process without it
    mesh = Mesh(dp=2, tp=2)
    all_reduce(grad, op="avg", group=mesh.group("dp"))
"""

from .algorithms import choose_algorithm, force_algorithm, load_algorithm_table
from .collectives import all_gather, all_reduce, all_to_all, barrier, broadcast, reduce_scatter
from .distributed import (
    DistributedInfo,
    default_device,
    destroy_distributed,
    find_free_port,
    gpus_per_local_rank,
    init_distributed,
    pick_backend,
)
from .errors import CommError, CommTimeoutError, RankFailure, RankTimeout
from .group import Group, as_group, create_process_group, new_group, world_group
from .handle import Handle, last_collective
from .launch import launch
from .mesh import Mesh
from .objects import all_gather_object, broadcast_object, gather_object
from .p2p import P2POp, batch_send_recv, irecv, isend, recv, send
from .scratch import release_scratch
from .tracker import CommRecord, CommTracker

__version__ = "0.1.0"

__all__ = [
    "release_scratch",
    "CommError",
    "CommRecord",
    "CommTimeoutError",
    "CommTracker",
    "DistributedInfo",
    "Group",
    "Handle",
    "Mesh",
    "P2POp",
    "RankFailure",
    "RankTimeout",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "as_group",
    "barrier",
    "batch_send_recv",
    "broadcast",
    "broadcast_object",
    "choose_algorithm",
    "create_process_group",
    "default_device",
    "destroy_distributed",
    "find_free_port",
    "force_algorithm",
    "gather_object",
    "gpus_per_local_rank",
    "init_distributed",
    "irecv",
    "isend",
    "last_collective",
    "launch",
    "load_algorithm_table",
    "new_group",
    "pick_backend",
    "recv",
    "reduce_scatter",
    "send",
    "world_group",
]
