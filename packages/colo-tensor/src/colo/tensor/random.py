"""Random streams for tensor-parallel regions (the RNG-tracker idea of Megatron-LM).

Dropout must agree with the unsharded model where values are replicated and must differ where they are
sharded. Outside a sharded region every rank of the tensor-parallel axis holds the same activation, so every
rank must draw the same mask: they use the device's default generator, seeded identically (`seed_tensor_parallel`
seeds it with the base seed). Inside a sharded region each rank holds a different slice (its attention heads,
its MLP features), so the ranks must draw different masks, or the same pattern would repeat across slices:
there the model runs under ``tracker.fork("model_parallel")``, which swaps in a stream seeded with
``base seed + offset + tp rank`` and swaps the default state back afterwards, so the replicated stream is not
advanced by what happens inside.

Both streams are reproducible from the base seed; a single process can rebuild any rank's masks by seeding a
stream with `model_parallel_seed` (the tests build the single-process reference that way).

Example::

    tracker = seed_tensor_parallel(1234, mesh=mesh)          # default stream: 1234 on every tp rank
    y = F.dropout(replicated, 0.1)                           # same mask on every tp rank
    with tracker.fork():                                     # this rank's own stream
        probs = F.dropout(local_heads_probs, 0.1)

In a model, `ShardedRNG` (a `parallelize` style) runs a module's forward inside the fork. A forward that is
recomputed (activation checkpointing) must replay the same draws: save the default generator state and
`RNGTracker.get_states` before the first forward and restore both before recomputing it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from colo.comm import Mesh

MODEL_PARALLEL_STREAM = "model_parallel"
"""The name of the per-tp-rank stream used inside sharded regions."""

MODEL_PARALLEL_SEED_OFFSET = 104_729
"""Added to the base seed (with the tp rank) to seed the model-parallel stream, so it never equals the default
stream's seed."""


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """The seed of tp rank ``tp_rank``'s model-parallel stream for base seed ``seed``."""
    return int(seed) + MODEL_PARALLEL_SEED_OFFSET + int(tp_rank)


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.cuda.get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


def _check_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"RNGTracker(device={str(device)!r}): only 'cpu' and 'cuda' generators are supported")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class RNGTracker:
    """Named random streams that can be swapped in for the default generator of one device.

    A stream is a generator state. ``fork(name)`` saves the default generator's state, installs the stream's,
    runs the block, stores the stream's advanced state and restores the default one, so draws inside the block
    come from the stream and draws outside it are unaffected.

    Args:
        device: whose default generator the streams replace: ``"cpu"`` (the default) or a CUDA device.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = _check_device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._forked: set[str] = set()

    @property
    def streams(self) -> tuple[str, ...]:
        """The names of the streams, in the order they were added."""
        return tuple(self._states)

    def add(self, name: str, seed: int) -> None:
        """Add stream ``name`` seeded with ``seed``.

        Raises:
            ValueError: a stream of that name exists (seeding it again would silently repeat masks).
        """
        if name in self._states:
            raise ValueError(f"RNGTracker.add: stream {name!r} exists; call reset() first to reseed every stream")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed))
        self._states[name] = generator.get_state()

    def reset(self) -> None:
        """Drop every stream."""
        if self._forked:
            raise RuntimeError(f"RNGTracker.reset: streams {sorted(self._forked)} are forked; leave their blocks first")
        self._states.clear()

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_STREAM) -> Iterator[None]:
        """Run the block with stream ``name`` as the device's default generator.

        Args:
            name: the stream. Default ``"model_parallel"``.

        Raises:
            ValueError: no such stream (add it, or seed with `seed_tensor_parallel`), or it is already forked
                (nested forks of one stream would replay its draws).
        """
        if name not in self._states:
            raise ValueError(
                f"RNGTracker.fork: no stream {name!r}; the streams are {list(self._states)}; create it with "
                "tracker.add(name, seed) or seed_tensor_parallel(seed, mesh=mesh)"
            )
        if name in self._forked:
            raise ValueError(f"RNGTracker.fork: stream {name!r} is already forked; do not nest forks of one stream")
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        self._forked.add(name)
        try:
            yield
        finally:
            self._forked.discard(name)
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (to save in a checkpoint)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace the streams by ``states`` (as returned by `get_states`)."""
        if self._forked:
            raise RuntimeError(f"RNGTracker.set_states: streams {sorted(self._forked)} are forked")
        self._states = {name: state.clone() for name, state in states.items()}


def seed_tensor_parallel(
    seed: int,
    *,
    mesh: Mesh,
    axis: str = "tp",
    tracker: RNGTracker | None = None,
    device: torch.device | str = "cpu",
) -> RNGTracker:
    """Seed the replicated and the per-rank streams of a tensor-parallel model from one base seed.

    The device's default generator gets ``seed`` on every rank (replicated regions draw the same masks on
    every rank of ``axis``); the tracker's ``"model_parallel"`` stream gets ``model_parallel_seed(seed, rank)``
    with this rank's coordinate on ``axis`` (sharded regions draw different masks per rank).

    Args:
        seed: the base seed, the same on every rank.
        mesh: the mesh.
        axis: the tensor-parallel axis. Default ``"tp"``.
        tracker: the tracker to (re)seed; default: a new one.
        device: whose default generator to seed when a new tracker is made. Default ``"cpu"``.

    Returns:
        The tracker holding the ``"model_parallel"`` stream.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"seed_tensor_parallel: mesh must be a colo.comm.Mesh, not {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"seed_tensor_parallel: the mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
    if tracker is None:
        tracker = RNGTracker(device)
    else:
        tracker.reset()
    _default_generator_seed(tracker.device, seed)
    tracker.add(MODEL_PARALLEL_STREAM, model_parallel_seed(seed, mesh.rank(axis)))
    return tracker


def _default_generator_seed(device: torch.device, seed: int) -> None:
    if device.type == "cpu":
        torch.manual_seed(int(seed))  # also seeds CUDA's default generators, as torch.manual_seed always does
    else:
        torch.cuda.manual_seed(int(seed))
