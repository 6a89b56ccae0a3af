"""The loader's position over a `Blend`: one global sample count, so a run resumes at any data-parallel size.

The training order is the blend's endless sequence of global samples ``0, 1, 2, ...``. Step after step the ranks
read global batches of ``num_replicas * batch_size`` samples from the position; data-parallel rank ``r`` takes the
``r``-th run of ``batch_size`` samples of each. The state is the position (samples consumed over all ranks) and
what must match on resume (the sources' identities, seed, packing, ``seq_len``); it does not depend on the
data-parallel size or the batch size, so a run saved at dp=2 resumes at dp=1 or dp=4 at exactly the next sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .blend import Blend
from .streaming import CHECKPOINT_KIND

_STATE_VERSION = 1
KIND = "global-position"

_FIELDS = {  # identity key -> the run-config field that sets it
    "seed": "seed",
    "shuffle": "data.shuffle",
    "block": "the blend's block size",
    "corpus": "data.paths / data.blend (the prepared corpus)",
    "packing": "data.packing",
    "seq_len": "data.seq_len",
    "tokens": "data.max_tokens (the tokens read)",
    "weight": "data.blend weights",
    "train_rows": "eval.num_sequences (the rows held out)",
    "held_out": "eval.num_sequences",
}


class GlobalPositionSampler:
    """This rank's batches of `Blend.train` indices, read from a global sample position (see the module docstring).

    Iterating yields batches forever (there are no epochs of the blend: its sources repeat on their own); the
    position advances by a global batch with every batch yielded, so `state_dict` taken after the trainer received
    batch ``k`` resumes at batch ``k + 1``.

    Args:
        blend: the order.
        num_replicas: the data-parallel size. Default: ``1``.
        rank: this rank's data-parallel index. Default: ``0``.
        batch_size: samples per batch on each rank.
    """

    def __init__(self, blend: Blend, *, num_replicas: int = 1, rank: int = 0, batch_size: int) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} of num_replicas={num_replicas}: need 0 <= rank < num_replicas")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.blend = blend
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.position = 0
        """Global samples consumed (over all ranks)."""

    @property
    def global_batch_size(self) -> int:
        return self.num_replicas * self.batch_size

    def global_batch(self, position: int) -> np.ndarray:
        """The `Blend.train` indices of the global batch starting at ``position`` (all ranks', in rank order)."""
        return self.blend.samples(np.arange(position, position + self.global_batch_size))

    def batch(self, position: int) -> list[int]:
        """This rank's share of the global batch starting at ``position``."""
        first = position + self.rank * self.batch_size
        return self.blend.samples(np.arange(first, first + self.batch_size)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            indices = self.batch(self.position)
            self.position += self.global_batch_size
            yield indices

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able state: the global position and the blend's identity (the same on every rank)."""
        return {"version": _STATE_VERSION, "kind": KIND, "samples_consumed": self.position, **self.blend.identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at ``state``'s position (any data-parallel size or batch size).

        Raises:
            ValueError: the state is not of this sampler, or the data, seed or split differ from the saved run's
                (the message names the field).
        """
        if state.get("kind") != KIND:
            what = (
                "streamed raw files (data.streaming)"
                if state.get("kind") == CHECKPOINT_KIND
                else "read raw files (data.paths tokenized in memory)"
            )
            raise ValueError(
                f"cannot resume the data position: the checkpoint's run {what}, this run reads prepared corpora; "
                "resume with the checkpoint's data, or start a fresh run (checkpoint.resume=none)"
            )
        mine = self.blend.identity()
        for key in ("seed", "shuffle", "block"):
            _compare(key, state.get(key), mine[key])
        saved, current = state.get("sources", []), mine["sources"]
        if len(saved) != len(current):
            raise ValueError(
                f"cannot resume the data position: the checkpoint's run read {len(saved)} prepared corpora, this run "
                f"{len(current)} (data.paths / data.blend); resume with the checkpoint's data, or start a fresh run"
            )
        for number, (before, now) in enumerate(zip(saved, current)):
            for key in now:
                _compare(key, before.get(key), now[key], source=number)
        self.position = int(state["samples_consumed"])


def _compare(key: str, saved, current, *, source: int | None = None) -> None:
    if saved != current:
        where = "" if source is None else f" of source {source}"
        raise ValueError(
            f"cannot resume the data position: {_FIELDS.get(key, key)}{where} differs (the checkpoint's {key}="
            f"{saved!r}, this run's {current!r}); resume with the checkpoint's data and settings, or start a fresh run "
            "(checkpoint.resume=none)"
        )
