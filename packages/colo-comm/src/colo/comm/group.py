"""`Group`: a process group together with its member ranks and the name used in errors and accounting."""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Groups created by colo, keyed so that every rank takes the same path through the cache: eager groups are
# created by every rank of the world (and cached on every rank, members or not), locally synchronised groups
# only by their members. Keeping the two apart means a rank never skips a `new_group` call its peers make.
_EAGER_GROUPS: dict[tuple[tuple[int, ...], float], tuple[object, tuple[int, ...]]] = {}
_LOCAL_GROUPS: dict[tuple[tuple[int, ...], float], tuple[object, tuple[int, ...]]] = {}


@dataclass(frozen=True)
class Group:
    """A process group as colo passes it around.

    Attributes:
        name: the mesh axis (``"tp"``), fused axes (``"dp+sp"``), ``"world"`` or ``"custom"``; the tracker
            accounts communication per name and errors quote it.
        process_group: the ``torch.distributed`` group (``None`` only for a rank outside it).
        ranks: the global ranks of the members, in group-rank order.
        timeout: seconds after which an operation on this group fails instead of hanging.
    """

    name: str
    process_group: object = field(repr=False, compare=False)
    ranks: tuple[int, ...]
    timeout: float

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self.ranks.index(dist.get_rank())

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the member at ``group_rank``."""
        if not 0 <= group_rank < self.size:
            raise ValueError(f"group rank {group_rank} is outside group {self.describe()} of size {self.size}")
        return self.ranks[group_rank]

    def describe(self) -> str:
        """A short description for messages: ``'tp' (ranks [0, 1])``."""
        ranks = list(self.ranks) if self.size <= 16 else f"{list(self.ranks[:8])}... ({self.size} ranks)"
        return f"'{self.name}' (ranks {ranks})"

    @property
    def backend(self) -> str:
        """The backend of the group's process group (``"gloo"``, ``"nccl"``, ...)."""
        return str(dist.get_backend(self.process_group))


DEFAULT_TIMEOUT_S = 300.0
"""Default seconds before a collective fails instead of hanging (override: ``timeout=`` or ``COLO_COMM_TIMEOUT``)."""

_timeout: dict[str, float] = {}  # "seconds": the job's collective timeout, set by init_distributed


def timeout_seconds(timeout: float | datetime.timedelta | None) -> float:
    """``timeout`` as positive seconds; ``None``: ``COLO_COMM_TIMEOUT`` or `DEFAULT_TIMEOUT_S`."""
    if timeout is None:
        timeout = float(os.environ.get("COLO_COMM_TIMEOUT", DEFAULT_TIMEOUT_S))
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    timeout = float(timeout)
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds")
    return timeout


def set_timeout(seconds: float) -> None:
    """Make ``seconds`` the timeout of the groups created from now on (`init_distributed` calls it)."""
    _timeout["seconds"] = timeout_seconds(seconds)


def reset_timeout() -> None:
    """Forget the job's timeout (`destroy_distributed`): back to ``COLO_COMM_TIMEOUT`` or the default."""
    _timeout.pop("seconds", None)


def current_timeout() -> float:
    """Seconds before a collective on colo's groups fails (the value given to `init_distributed`)."""
    return _timeout.get("seconds", timeout_seconds(None))


def default_timeout() -> float:
    """The timeout, in seconds, of the default process group (set by `init_distributed`)."""
    return current_timeout()


def world_group() -> Group:
    """The group of every rank of the job."""
    _require_initialized()
    return Group("world", dist.group.WORLD, tuple(range(dist.get_world_size())), default_timeout())


def as_group(group: Group | dist.ProcessGroup | None) -> Group:
    """Normalise what a caller passed as a group: a `Group`, a raw ``ProcessGroup`` or ``None`` (the world)."""
    if isinstance(group, Group):
        return group
    if group is None:
        return world_group()
    if isinstance(group, dist.ProcessGroup):
        ranks = tuple(dist.get_process_group_ranks(group))
        return Group("custom", group, ranks, default_timeout())
    raise TypeError(
        f"group must be a colo.comm.Group (from Mesh.group), a torch ProcessGroup or None, not {type(group).__name__}"
    )


def new_group(ranks, *, name: str, timeout: float | None = None, local_synchronization: bool = False) -> Group:
    """Create (or reuse) the process group of ``ranks``.

    Without ``local_synchronization`` every rank of the world must call this with the same ``ranks`` in the same
    order (torch's rule); with it, only the members call it. Groups are cached per process, so building several
    meshes of the same shape does not open new connections each time.

    Args:
        ranks: global ranks of the members, in group-rank order.
        name: the name errors and the `CommTracker` use for this group.
        timeout: seconds before an operation on the group fails; defaults to the default group's timeout.
        local_synchronization: only members take part in creating the group.

    Returns:
        The `Group`; its ``process_group`` is ``None`` on ranks outside it.
    """
    _require_initialized()
    ranks = tuple(int(r) for r in ranks)
    timeout = float(timeout if timeout is not None else default_timeout())
    world = dist.get_world_size()
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < world for r in ranks):
        raise ValueError(f"group ranks {list(ranks)} must be distinct ranks of a world of size {world}")
    if ranks == tuple(range(world)):
        return Group(name, dist.group.WORLD, ranks, timeout)
    key = (ranks, timeout)
    cache = _LOCAL_GROUPS if local_synchronization else _EAGER_GROUPS
    if key not in cache:
        if local_synchronization and dist.get_rank() not in ranks:
            raise ValueError(f"rank {dist.get_rank()} is not in group {list(ranks)}; only members create it")
        with _member_agreed_name(ranks, timeout) if local_synchronization else contextlib.nullcontext():
            cache[key] = create_process_group(
                ranks, timeout=datetime.timedelta(seconds=timeout), use_local_synchronization=local_synchronization
            )
    process_group, group_ranks = cache[key]
    if process_group in (None, dist.GroupMember.NON_GROUP_MEMBER):
        process_group = None
    return Group(name, process_group, group_ranks, timeout)


@functools.cache
def new_group_keeps_rank_order() -> bool:
    """Whether this torch's ``dist.new_group`` can keep the caller's rank order (its ``sort_ranks`` argument,
    torch 2.12 and newer); older releases always order a group's ranks ascending."""
    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def create_process_group(ranks, **options) -> tuple[object, tuple[int, ...]]:
    """``dist.new_group(ranks, **options)`` on every torch colo supports, and the members in group-rank order.

    The members keep the order of ``ranks`` where the torch can keep it (`new_group_keeps_rank_order`); on older
    releases the group's ranks are ascending, and the returned order says so. Either way the returned order is the
    one the process group numbers its ranks in, which is what `Group.ranks` must hold.

    Returns:
        ``(process group, the members in group-rank order)``.
    """
    ranks = tuple(int(r) for r in ranks)
    ascending = tuple(sorted(ranks))
    if ranks == ascending:
        return dist.new_group(list(ranks), **options), ranks
    if new_group_keeps_rank_order():
        return dist.new_group(list(ranks), sort_ranks=False, **options), ranks
    return dist.new_group(list(ascending), **options), ascending


@contextlib.contextmanager
def _member_agreed_name(ranks: tuple[int, ...], timeout: float) -> Iterator[None]:
    """Name a locally synchronised group from its ranks alone, so every member derives the same name.

    torch names such a group by hashing its ranks together with how many groups *this process* knows, and that
    count differs between ranks as soon as some ranks created a group the others did not (which is what local
    synchronisation is for): two members would then wait on different rendezvous keys and hang. colo creates each
    (ranks, timeout) group once per process (the cache), so the ranks and the timeout identify it among members.
    """
    c10d = torch.distributed.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is None:  # a torch without the hook: keep its own naming
        yield
        return
    digest = hashlib.sha1(f"colo|{'_'.join(map(str, ranks))}|{timeout}".encode(), usedforsecurity=False).hexdigest()

    def agreed_name(group_ranks, use_hashed_name):
        return digest if use_hashed_name else original(group_ranks, use_hashed_name)

    c10d._process_group_name = agreed_name
    try:
        yield
    finally:
        c10d._process_group_name = original


def clear_group_cache() -> None:
    """Forget cached groups (called when the default process group is destroyed)."""
    _EAGER_GROUPS.clear()
    _LOCAL_GROUPS.clear()


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call colo.comm.init_distributed() first "
            "(run the script under torchrun, or start ranks with colo.comm.launch)"
        )
