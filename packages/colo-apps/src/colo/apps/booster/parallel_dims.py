"""`ParallelDims`: the parallel degrees of one layout and the mesh they make, and the typed errors layouts raise.

`HybridParallel` keeps its sizes in a `ParallelDims` (`HybridParallel.dims`); the mesh shape, the data-parallel
size and the checks against the world size come from it, and the plans (`ModelPlan.check`) read the same object.
Errors are `LayoutError` (a size that cannot work: not a positive integer, not dividing the world) and
`UnsupportedLayout` (a combination colo does not run yet); both are `ValueError` s that carry ``field``, the setting
to change, so callers (the run config, `colo plan`) can act on the field instead of matching message text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class LayoutError(ValueError):
    """A parallel layout that cannot be built; ``field`` names the setting to change (``"tp"``, ``"zero_stage"``)."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedLayout(LayoutError):
    """A combination of settings colo does not support yet (the message says which setting to change)."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of tensor (``tp``), pipeline (``pp``), sequence (``sp``) and data (``dp``) parallelism.

    ``dp=None`` means "what the world size leaves"; `resolve` fills it in. The mesh is ``Mesh(pp, dp, sp, tp)`` in
    that order (tp innermost: its ranks are neighbours).

    Args:
        tp, pp, sp: positive integers.
        dp: a positive integer, or ``None`` for the rest of the world.
        owner: the class named in error messages. Default: ``"HybridParallel"``.

    Raises:
        LayoutError: a degree that is not a positive integer.
    """

    tp: int = 1
    pp: int = 1
    sp: int = 1
    dp: int | None = None
    owner: str = "HybridParallel"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "sp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{self.owner}.{name}={value!r} must be a positive integer", field=name)
        if self.dp is not None and (isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1):
            raise LayoutError(
                f"{self.owner}.dp={self.dp!r} must be a positive integer, or None for the rest", field="dp"
            )

    @property
    def model_parallel(self) -> int:
        """Ranks one copy of the data runs on: ``tp * pp * sp``."""
        return self.tp * self.pp * self.sp

    def resolve(self, world_size: int) -> ParallelDims:
        """These degrees with ``dp`` filled in for ``world_size`` ranks.

        Raises:
            LayoutError: the degrees do not multiply to the world size (``field`` names ``dp`` when it was given,
                else ``tp``).
        """
        if self.dp is not None and self.dp * self.model_parallel != world_size:
            raise LayoutError(
                f"{self.owner}: dp={self.dp} x tp={self.tp} x pp={self.pp} x sp={self.sp} = "
                f"{self.dp * self.model_parallel} ranks, but the world size is {world_size}; the sizes must multiply "
                "to it (set dp=None to use what is left)",
                field="dp",
            )
        if world_size % self.model_parallel:
            raise LayoutError(
                f"{self.owner}: tp={self.tp} x pp={self.pp} x sp={self.sp} = {self.model_parallel} does not divide "
                f"the world size {world_size}; choose sizes whose product divides it",
                field="tp",
            )
        return replace(self, dp=world_size // self.model_parallel)

    def mesh_shape(self, world_size: int) -> dict[str, int]:
        """``{"pp", "dp", "sp", "tp"}`` sizes of the mesh on ``world_size`` ranks (see `resolve`)."""
        resolved = self.resolve(world_size)
        return {"pp": resolved.pp, "dp": resolved.dp, "sp": resolved.sp, "tp": resolved.tp}

    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (and data-parallel gradients reduced over)."""
        return ("dp", "sp") if self.sp > 1 else ("dp",)
