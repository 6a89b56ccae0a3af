"""The `Gemini` plugin: colo.gemini's `GeminiOptimizer` (chunks placed over device, host and disk) over every rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from colo.gemini import GeminiConfig, GeminiOptimizer
from colo.zero import MixedPrecision

from ..plans import find_plan
from ..replicas import broadcast_model_state, model_tensors
from .base import Engine, Plugin
from .driver import OptimizerDriver


@dataclass(kw_only=True)
class Gemini(Plugin):
    """Heterogeneous memory management (`colo.gemini`): ZeRO-3-style sharding over every rank, each chunk kept on
    the device, the host or the disk by the ``placement`` policy and moved just in time.

    The fields are `colo.gemini.GeminiConfig`'s (sizes as bytes or ``"512MiB"``); they are validated here, before
    any collective. Gradients are reduced every microbatch (Gemini keeps no full gradient buffer).
    """

    placement: str = "auto"
    """``"auto"`` (warm-up trace, farthest-next-use eviction, prefetch) or ``"static"`` (fractions per tier)."""
    device_capacity: int | str | None = None
    """The device budget for chunk data (and, under ``auto``, the non-model memory recorded in warm-up)."""
    host_capacity: int | str | None = None
    """Host memory for chunk data; ``None``: no limit."""
    disk_dir: str | None = None
    """Directory of the disk tier (NVMe offload); ``None``: no disk tier."""
    disk_capacity: int | str | None = None
    """Bytes the disk tier may use; ``None``: the free space of ``disk_dir``."""
    param_fractions: dict[str, float] = field(default_factory=lambda: {"device": 1.0})
    """Static placement: parameter bytes per tier."""
    optim_fractions: dict[str, float] = field(default_factory=lambda: {"device": 1.0})
    """Static placement: optimizer-state bytes per tier."""
    prefetch: int = 2
    """Chunks to bring to the device ahead of use."""
    chunk_numel: int | None = None
    """Chunk capacity in elements (``None``: searched)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gemini_config()  # GeminiConfig validates every field, naming it
        if self.activation_checkpointing == "selective":
            raise ValueError(
                "Gemini.activation_checkpointing='selective' does not work with Gemini: gathering chunks inside the "
                "blocks runs different ops in the recomputation; use 'full' or 'offload'"
            )

    def gemini_config(self) -> GeminiConfig:
        """The `GeminiConfig` these settings describe."""
        mixed = None if self.precision == "fp32" else MixedPrecision(param_dtype=self.compute_dtype)
        return GeminiConfig(
            placement=self.placement,
            device_capacity=self.device_capacity,
            host_capacity=self.host_capacity,
            disk_dir=self.disk_dir,
            disk_capacity=self.disk_capacity,
            param_fractions=dict(self.param_fractions),
            optim_fractions=dict(self.optim_fractions),
            prefetch=self.prefetch,
            chunk_numel=self.chunk_numel,
            mixed_precision=mixed,
        )

    def configure(self, model, optimizer, *, criterion=None) -> Engine:
        mesh = self.build_mesh()
        broadcast_model_state(model_tensors(model), group=mesh.group("dp"))  # rank 0's values, before chunking
        self.maybe_checkpoint_activations(model)
        self.maybe_compile(model)
        plan = find_plan(model)
        checkpoint_names = plan.checkpoint_names(model) if plan is not None else None
        gemini = GeminiOptimizer(
            model, optimizer, mesh=mesh, config=self.gemini_config(), checkpoint_names=checkpoint_names
        )
        return GeminiEngine(
            self, model=model, optimizer=gemini, mesh=mesh, criterion=criterion, sync_every_microbatch=True
        )


class GeminiEngine(OptimizerDriver, Engine):
    """Runs steps for `Gemini`: the chunk-optimizer driver, reducing every microbatch."""

    def no_sync(self):
        raise RuntimeError("the Gemini plugin reduces gradients every microbatch; it has no no_sync()")

    def save(self, path: str, *, metadata: dict) -> None:
        self.optimizer.save(path, metadata=metadata, expected_names=self.expected_names)
