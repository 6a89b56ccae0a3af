"""The `Gemini` plugin: colo.gemini's `GeminiOptimizer` (chunks placed over device, host and disk) over every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from colo.gemini import GeminiConfig, GeminiOptimizer, GeminiTiers
from colo.zero import MixedPrecision

from ..plans import find_plan
from ..replicas import broadcast_model_state, model_tensors
from .base import Engine, Plugin
from .driver import OptimizerDriver


@dataclass(kw_only=True)
class Gemini(Plugin, GeminiTiers):
    """Heterogeneous memory management (`colo.gemini`): ZeRO-3-style sharding over every rank, each chunk kept on
    the device, the host or the disk by the ``placement`` policy and moved just in time.

    The tier fields (``placement``, the capacities, ``disk_dir``, the static fractions, ``prefetch``) are
    `colo.gemini.GeminiTiers`'s, defined once there with their defaults; they are validated here, before any
    collective. Gradients are reduced every microbatch (Gemini keeps no full gradient buffer).
    """

    packs_chunks: ClassVar[bool] = True
    blocks_trace_whole: ClassVar[bool] = False  # the chunk hooks inside a block run eagerly, between its graphs

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
        tiers = {**self.tier_settings(), "param_fractions": dict(self.param_fractions)}
        tiers["optim_fractions"] = dict(self.optim_fractions)
        return GeminiConfig(**tiers, chunk_numel=self.chunk_numel, mixed_precision=mixed)

    def configure(self, model, optimizer, *, criterion=None, param_order=None) -> Engine:
        mesh = self.build_mesh()
        broadcast_model_state(model_tensors(model), group=mesh.group("dp"))  # rank 0's values, before chunking
        self.maybe_checkpoint_activations(model)
        self.maybe_compile(model)
        plan = find_plan(model)
        checkpoint_names = plan.checkpoint_names(model) if plan is not None else None
        gemini = GeminiOptimizer(
            model,
            optimizer,
            mesh=mesh,
            config=self.gemini_config(),
            checkpoint_names=checkpoint_names,
            param_order=param_order,
        )
        return GeminiEngine(
            self, model=model, optimizer=gemini, mesh=mesh, criterion=criterion, sync_every_microbatch=True
        )


class GeminiEngine(OptimizerDriver, Engine):
    """Runs steps for `Gemini`: the chunk-optimizer driver, reducing every microbatch."""

    def no_sync(self):
        raise RuntimeError("the Gemini plugin reduces gradients every microbatch; it has no no_sync()")
