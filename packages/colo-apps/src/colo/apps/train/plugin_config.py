"""The ``plugin`` section of the run config: one pydantic model per Booster plugin, chosen by ``name``.

The fields are the plugin dataclasses' own (`DDP`, `Zero`, `Gemini`, `HybridParallel`, `ExpertParallel`), with
their docstrings as descriptions; the plugin's ``__post_init__`` checks run at validation time, so a bad
combination (``compile_blocks`` with ``zero_stage=3``, an unknown schedule...) is reported against the ``plugin``
field before anything starts.
``num_microbatches`` comes from ``schedule.num_microbatches`` and the materialization seed from ``seed``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from colo.pipeline import MicrobatchCountError

from ..booster import DDP, ExpertParallel, Gemini, HybridParallel, Plugin, Zero
from ._fields import dataclass_fields

_SET_BY_RUN = ("num_microbatches", "seed")


class _PluginSection(BaseModel):
    """What every plugin section does: validate its fields by building the plugin once, and build it for a run."""

    model_config = ConfigDict(extra="forbid")
    plugin_class: ClassVar[type[Plugin]] = Plugin  # set per plugin section below

    def build(self, *, num_microbatches: int = 1, seed: int = 0) -> Plugin:
        """The Booster plugin these settings describe.

        Args:
            num_microbatches: microbatches per step (``schedule.num_microbatches``).
            seed: the run seed (HybridParallel materializes a meta-device model's shards from it).
        """
        fields = self.model_dump(exclude={"name"})
        if "seed" in _init_fields(self.plugin_class):
            fields["seed"] = seed
        return self.plugin_class(num_microbatches=num_microbatches, **fields)

    @model_validator(mode="after")
    def _plugin_checks(self):
        try:
            self.build()
        except MicrobatchCountError:
            return self  # depends on schedule.num_microbatches, set by the run: checked again by RunConfig
        return self


def _init_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _section(name: str, plugin_class: type, doc: str) -> type[_PluginSection]:
    model = create_model(
        f"{plugin_class.__name__}Section",
        __base__=_PluginSection,
        __doc__=doc,
        name=(Literal[name], Field(description=f"The plugin: {name!r} selects `{plugin_class.__name__}`.")),
        **dataclass_fields(plugin_class, exclude=_SET_BY_RUN),
    )
    model.plugin_class = plugin_class
    return model


DDPSection = _section("ddp", DDP, "torch DistributedDataParallel over every rank (parameters replicated).")
ZeroSection = _section("zero", Zero, "ZeRO stages 0-3 over every rank (colo.zero).")
GeminiSection = _section("gemini", Gemini, "Gemini: ZeRO-3-style chunks placed over device, host and disk.")
HybridSection = _section("hybrid", HybridParallel, "Tensor x pipeline x sequence x data parallelism, ZeRO 0-3.")
ExpertSection = _section(
    "expert",
    ExpertParallel,
    "Expert parallelism for mixture-of-experts presets: each MoE layer's experts split over ep ranks (tokens reach "
    "them by all-to-all), ZeRO 0-2 over the data ranks (colo.apps.booster.ExpertParallel).",
)

PluginConfig = Annotated[
    Union[DDPSection, ZeroSection, GeminiSection, HybridSection, ExpertSection],  # noqa: UP007
    Field(discriminator="name"),
]
"""One of the plugin sections, told apart by ``name`` (``ddp``, ``zero``, ``gemini``, ``hybrid``, ``expert``)."""

PLUGIN_NAMES = ("ddp", "zero", "gemini", "hybrid", "expert")
