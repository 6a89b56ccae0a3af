"""`ShardedEMA`: an exponential moving average of the boosted denoiser's weights, kept where the weights are.

Under ZeRO and Gemini each rank holds the flat fp32 master shard of every chunk; the average is elementwise, so
each rank averages its own shard and nothing is communicated. Under DDP (and stage 0) every rank holds the whole
average. The decay schedule is ``diffusers.training_utils.EMAModel``'s (``decay``, ``min_decay``,
``update_after_step``, ``use_ema_warmup`` with ``inv_gamma`` / ``power``), and so is the update,
``s -= (1 - d) * (s - p)``, so it equals ``EMAModel(unet.parameters()).step(...)`` on the same updates.

Saved in the common checkpoint format (``ema/<parameter name>``, flat ranges under ZeRO / Gemini), so an average
saved at one layout loads at another, or in one process for sampling and export. A run keeps the average of its
checkpoint ``<checkpoint dir>/step-N`` in ``<checkpoint dir>/ema/step-N`` (`ema_checkpoint`), written before the
checkpoint commits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from colo.tensor.checkpoint import FlatShard, load_checkpoint, save_checkpoint

PREFIX = "ema/"
EMA_DIR = "ema"
"""The directory beside a run's checkpoints (``<checkpoint dir>/ema/step-N``) that holds their averages."""


def ema_checkpoint(checkpoint: str | os.PathLike) -> str:
    """Where the EMA of the run checkpoint ``checkpoint`` (``<root>/step-N``) is: ``<root>/ema/step-N``; inside
    the checkpoint (``<checkpoint>/ema``) for a checkpoint of an earlier colo version that kept it there."""
    checkpoint = os.path.normpath(os.fspath(checkpoint))
    inside = os.path.join(checkpoint, EMA_DIR)
    if os.path.isdir(inside):
        return inside
    return os.path.join(os.path.dirname(checkpoint), EMA_DIR, os.path.basename(checkpoint))


def _tensor_parallel_axes(engine) -> tuple[str, ...]:
    """The mesh axes of size > 1 over which ``engine``'s plugin splits the model's tensors (HybridParallel's tp)."""
    axes = getattr(engine.plugin, "tensor_parallel_axes", lambda: ())()
    return tuple(axis for axis in axes if engine.mesh.size(axis) > 1)


def _master_pieces(engine) -> Iterator[tuple[str, torch.Tensor, dict | None]]:
    """``(checkpoint name, this rank's current fp32 values, FlatShard fields | None)`` of every trainable
    parameter: flat ranges of the chunks' masters under ZeRO / Gemini (of this rank's tensor-parallel shard, placed
    in the whole tensor, under HybridParallel's tp), whole parameters otherwise."""
    from colo.zero import ChunkOptimizer
    from colo.zero.state import flat_pieces, placement_of

    optimizer = engine.optimizer
    if isinstance(optimizer, ChunkOptimizer) and (optimizer.num_shards > 1 or _tensor_parallel_axes(engine)):
        optimizer.before_checkpoint()  # the shards are read: parameter gathers in flight land first
        for chunk in optimizer.trainable_chunks:
            master = optimizer.shard_tensors(chunk)["master"]
            for slot in chunk.slots:
                placement = placement_of(optimizer, slot)
                for name, start, end, fields in flat_pieces(
                    chunk, slot, checkpoint_names=optimizer.checkpoint_names, placement=placement
                ):
                    yield name, master[start:end], fields
        return
    if isinstance(optimizer, ChunkOptimizer):  # one shard (ZeRO stage 0): every rank holds every master
        for name, value in optimizer.full_params().items():
            yield name, value, None
        return
    for name, param in engine.unwrap().named_parameters():
        if param.requires_grad:
            yield name, param.detach(), None


def _assemble(gathered: list[list[tuple[str, torch.Tensor, dict | None]]]) -> dict[str, torch.Tensor]:
    """The whole tensors from every rank's ``(name, values, FlatShard fields | None)`` pieces: a flat range of the
    tensor, or of the tensor-parallel rectangle ``rect_offsets`` / ``rect_shape`` of it; replicas are skipped (the
    rank that writes them holds the same values)."""
    result: dict[str, torch.Tensor] = {}
    rectangles: dict[tuple, torch.Tensor] = {}  # (name, offsets, shape) -> the flat rectangle being filled
    for rank_pieces in gathered:
        for name, value, fields in rank_pieces:
            if fields is None:
                result.setdefault(name, value)
                continue
            if fields.get("replica"):
                continue
            shape = tuple(fields["global_shape"])
            rect_shape = tuple(fields.get("rect_shape") or shape)
            offsets = tuple(fields.get("rect_offsets") or (0,) * len(shape))
            key = (name, offsets, rect_shape)
            if key not in rectangles:
                rectangles[key] = torch.zeros(int(torch.Size(rect_shape).numel()), dtype=value.dtype)
                result.setdefault(name, torch.zeros(shape, dtype=value.dtype))
            rectangles[key][fields["flat_start"] : fields["flat_start"] + value.numel()] = value
    for (name, offsets, rect_shape), flat in rectangles.items():
        region = tuple(slice(offset, offset + size) for offset, size in zip(offsets, rect_shape))
        result[name][region] = flat.view(rect_shape)
    return result


def gather_pieces(pieces, *, group, to_rank: int | None = None) -> dict[str, torch.Tensor]:
    """The whole tensors of every rank of ``group``'s ``(name, values, FlatShard fields | None)`` pieces (a
    collective: every rank of ``group`` calls it); ``to_rank``: only that global rank assembles them (the others get
    ``{}``)."""
    import torch.distributed as dist

    # each piece in a storage of its own: a flat range of a chunk's master is a view, which pickling would send
    # with the whole master shard, once per piece
    pieces = [(name, value.detach().to("cpu", copy=True), fields) for name, value, fields in pieces]
    if group.size == 1:
        return _assemble([pieces])
    if to_rank is None:
        gathered = [None] * group.size
        dist.all_gather_object(gathered, pieces, group=group.process_group)
    else:
        receives = dist.get_rank() == to_rank
        gathered = [None] * group.size if receives else None
        dist.gather_object(pieces, gathered, dst=to_rank, group=group.process_group)
        if not receives:
            return {}
    return _assemble(gathered)


def full_weights(engine, *, to_rank: int | None = None) -> dict[str, torch.Tensor]:
    """The boosted model's current trainable weights, whole, by checkpoint name: `colo.apps.booster.Booster`'s
    ``full_state_dict`` for layouts it cannot gather (HybridParallel's tensor-parallel shards). A collective."""
    return gather_pieces(list(_master_pieces(engine)), group=_saving_group(engine), to_rank=to_rank)


def _saving_group(engine):
    """The ranks whose pieces make the whole average: the data axes, and the tensor-parallel axes when the plugin
    splits tensors (the world then: HybridParallel's mesh is ``(pp, dp, sp, tp)`` and the DiT has no pipeline)."""
    from colo.comm import world_group

    if _tensor_parallel_axes(engine):
        return world_group()
    return engine.mesh.group(*engine.plugin.data_axes(engine.mesh))


class ShardedEMA:
    """EMA of a boosted model's trainable weights, sharded like its optimizer state.

    Args:
        booster: a `Booster` after ``boost`` (DDP, Zero 0-3 or Gemini).
        decay, min_decay, update_after_step, use_ema_warmup, inv_gamma, power: as ``diffusers`` ``EMAModel``.

    Call `step` after every optimizer step (`Booster.train_step`); `save` / `load` with the checkpoint; `full`
    gathers the average (a collective) for sampling or export.
    """

    def __init__(
        self,
        booster,
        *,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
    ) -> None:
        if not 0 <= min_decay <= decay <= 1:
            raise ValueError(f"ShardedEMA needs 0 <= min_decay <= decay <= 1, got min_decay={min_decay}, decay={decay}")
        if booster.engine is None:
            raise RuntimeError("ShardedEMA(booster): call booster.boost(model, optimizer, ...) first")
        self.engine = booster.engine
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_ema_warmup, self.inv_gamma, self.power = use_ema_warmup, inv_gamma, power
        self.optimization_step = 0
        self.shadow: dict[str, tuple[torch.Tensor, dict | None]] = {
            name: (value.detach().clone().float(), fields) for name, value, fields in _master_pieces(self.engine)
        }

    def get_decay(self, optimization_step: int) -> float:
        """The decay of the update numbered ``optimization_step`` (EMAModel's schedule)."""
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            value = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            value = (1 + step) / (10 + step)
        return max(min(value, self.decay), self.min_decay)

    @torch.no_grad()
    def step(self) -> None:
        """Fold the current weights into the average (after an optimizer step; no communication)."""
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for name, value, _ in _master_pieces(self.engine):
            shadow = self.shadow[name][0]
            shadow.sub_(one_minus_decay * (shadow - value.to(shadow.device, torch.float32)))

    def _tensors(self) -> dict:
        return {
            PREFIX + name: value if fields is None else FlatShard(value, **fields)
            for name, (value, fields) in self.shadow.items()
        }

    def state_metadata(self) -> dict:
        return {
            "optimization_step": self.optimization_step,
            "decay": self.decay,
            "min_decay": self.min_decay,
            "update_after_step": self.update_after_step,
            "use_ema_warmup": self.use_ema_warmup,
            "inv_gamma": self.inv_gamma,
            "power": self.power,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the average to the new checkpoint directory ``path`` (every rank calls it)."""
        save_checkpoint(
            path, self._tensors(), metadata={"ema": self.state_metadata()}, group=_saving_group(self.engine)
        )

    def load(self, path: str | os.PathLike) -> None:
        """Fill the average (and its step count) from ``path``, saved at any layout."""
        metadata, _ = load_checkpoint(path, self._tensors(), strict=False)
        self.optimization_step = int(metadata["ema"]["optimization_step"])

    def full(self, *, to_rank: int | None = None) -> dict[str, torch.Tensor]:
        """The whole average by parameter name (a collective under ZeRO / Gemini / tensor parallelism: every rank
        calls it).

        ``to_rank``: only that global rank assembles it (the others get ``{}``), so a large model's average is not
        copied into every rank's host memory; ``None``: every rank gets it."""
        import torch.distributed as dist

        sharded = any(fields is not None for _, fields in self.shadow.values())
        if not sharded:
            if to_rank is not None and dist.is_initialized() and dist.get_rank() != to_rank:
                return {}
            return {name: value.clone() for name, (value, _) in self.shadow.items()}
        pieces = [(name, value, fields) for name, (value, fields) in self.shadow.items()]
        return gather_pieces(pieces, group=_saving_group(self.engine), to_rank=to_rank)

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module, averaged: dict[str, torch.Tensor], *, prefix: str = "") -> None:
        """Copy ``averaged`` (from `full`) into ``module``'s parameters named ``prefix + name``."""
        params = dict(module.named_parameters())
        for name, value in averaged.items():
            params[name.removeprefix(prefix)].copy_(value)
