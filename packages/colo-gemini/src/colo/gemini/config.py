"""`GeminiConfig`: the settings of `GeminiOptimizer`, validated with messages that name the field and the fix."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

import torch

from colo.comm import default_device
from colo.zero.config import ChunkConfig

from .placement import TIERS

PLACEMENTS = ("static", "auto")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str | None, field_name: str) -> int | None:
    """``"64MiB"`` -> ``67108864``; ints pass through; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"GeminiConfig.{field_name}={value!r} must be a number of bytes or a string like '64MiB'")
    if isinstance(value, (int, float)):
        result = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"GeminiConfig.{field_name}={value!r} is not a size; write bytes (1048576) or '1MiB', '2GB', '512KiB'"
            )
        result = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if result <= 0:
        raise ValueError(f"GeminiConfig.{field_name}={value!r} must be positive")
    return result


def _check_fractions(name: str, fractions: dict[str, float]) -> dict[str, float]:
    if not isinstance(fractions, dict):
        raise TypeError(f"GeminiConfig.{name} must be a dict tier -> fraction, e.g. {{'device': 0.5, 'host': 0.5}}")
    unknown = sorted(set(fractions) - set(TIERS))
    if unknown:
        raise ValueError(f"GeminiConfig.{name} names {unknown}, not tiers; use keys from {TIERS}")
    for tier, value in fractions.items():
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"GeminiConfig.{name}[{tier!r}]={value} must lie in [0, 1]")
    total = sum(float(v) for v in fractions.values())
    if not math.isclose(total, 1.0, abs_tol=1e-9):
        raise ValueError(f"GeminiConfig.{name}={fractions} sums to {total}; the fractions of the tiers must sum to 1")
    return {tier: float(fractions.get(tier, 0.0)) for tier in TIERS}


@dataclass(kw_only=True)
class GeminiTiers:
    """Where Gemini keeps chunk data: the placement policy and the tier budgets.

    Defined once, here: `GeminiConfig` and the Booster's ``Gemini`` plugin (and through it the run config) both
    inherit these fields, so their defaults cannot drift. Sizes are bytes, or strings such as ``"512MiB"``.
    """

    placement: str = "static"
    """``"static"`` (the default, as Colossal-AI's ``GeminiPlugin``): homes from ``param_fractions`` /
    ``optim_fractions`` (everything on the device unless they say otherwise). ``"auto"``: everything off the
    device at first, a warm-up step records the chunks' access order and the non-model memory, then the parameters
    become resident if they all fit (and optimizer state fills the rest), otherwise the device is a cache that
    evicts the chunk needed farthest ahead and prefetches in the recorded order (needs ``device_capacity``
    without CUDA)."""
    device_capacity: int | str | None = None
    """The device budget: the arena that holds every chunk buffer on the device; under ``auto`` the non-model
    memory the warm-up records is kept free of chunks as well. ``None``: static: just large enough for what the
    fractions put there plus the working set; auto: the GPU's free memory (required without CUDA)."""
    host_capacity: int | str | None = None
    """Host memory Gemini may use for chunk data; ``None``: no limit."""
    disk_dir: str | None = None
    """Directory of the disk tier (NVMe offload); each rank uses a subdirectory. ``None``: no disk tier."""
    disk_capacity: int | str | None = None
    """Bytes the disk tier may use; ``None``: the free space of ``disk_dir``."""
    param_fractions: dict[str, float] = field(default_factory=lambda: {"device": 1.0})
    """Static placement: fraction of the parameter bytes homed on each tier, filled in packing order (device,
    host, disk). Colossal-AI's ``offload_param_frac`` is ``1 - param_fractions["device"]``."""
    optim_fractions: dict[str, float] = field(default_factory=lambda: {"device": 1.0})
    """Static placement: fraction of the optimizer-state bytes (master, moments, gradient shard) on each tier.
    Colossal-AI's ``offload_optim_frac`` is ``1 - optim_fractions["device"]``."""
    prefetch: int = 2
    """How many chunks ahead to bring to the device (0: fetch on demand only)."""

    def check_tiers(self) -> None:
        """Validate the tier settings (naming the field and the fix); sizes become bytes, fractions cover every
        tier."""
        if self.placement not in PLACEMENTS:
            raise ValueError(f"GeminiConfig.placement={self.placement!r} is not a policy; use one of {PLACEMENTS}")
        for name in ("device_capacity", "host_capacity", "disk_capacity"):
            setattr(self, name, parse_bytes(getattr(self, name), name))
        self.param_fractions = _check_fractions("param_fractions", self.param_fractions)
        self.optim_fractions = _check_fractions("optim_fractions", self.optim_fractions)
        if self.placement == "auto":
            for name in ("param_fractions", "optim_fractions"):
                if getattr(self, name)["device"] != 1.0:
                    raise ValueError(
                        f"GeminiConfig.{name} is a static placement setting; with placement='auto' the warm-up "
                        "step decides; drop it or use placement='static'"
                    )
        wants_disk = self.param_fractions["disk"] > 0 or self.optim_fractions["disk"] > 0
        if wants_disk and self.disk_dir is None:
            raise ValueError(
                "GeminiConfig puts a fraction on the disk tier but disk_dir is None; set disk_dir to a directory "
                "(fast local NVMe) or move the fractions to device/host"
            )
        if self.disk_capacity is not None and self.disk_dir is None:
            raise ValueError("GeminiConfig.disk_capacity is set without disk_dir; set disk_dir too")
        if self.prefetch < 0:
            raise ValueError(f"GeminiConfig.prefetch={self.prefetch} must be >= 0 (0 fetches on demand only)")

    def tier_settings(self) -> dict:
        """The `GeminiTiers` fields of this object, by name (to build a `GeminiConfig` from a plugin)."""
        return {f.name: getattr(self, f.name) for f in fields(GeminiTiers)}


@dataclass(kw_only=True)
class GeminiConfig(ChunkConfig, GeminiTiers):
    """Settings of `GeminiOptimizer`: `colo.zero.config.ChunkConfig`'s (``data_axes``, ``chunk_numel``,
    ``mixed_precision``), the tiers' (`GeminiTiers`) and the device's."""

    max_chunk_numel: int = 1 << 24
    """Largest capacity the search tries (smaller chunks move in finer steps)."""
    device: str | torch.device | None = None
    """The compute device; ``None``: `colo.comm.default_device` (the current CUDA device in an NCCL job, the CPU in a
    gloo one; before ``torch.distributed`` starts, CUDA when every local process has a GPU of its own)."""
    pin_memory: bool | None = None
    """Pin host buffers; ``None``: when CUDA is available (pinning raises without it)."""
    disk_threads: int = 2
    """Background I/O threads of the disk tier."""

    def __post_init__(self) -> None:
        self.check_tiers()
        super().__post_init__()
        if self.disk_threads < 1:
            raise ValueError(f"GeminiConfig.disk_threads={self.disk_threads} must be at least 1")
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("GeminiConfig.pin_memory=True needs CUDA (torch.pin_memory raises without it); use None")
        if self.device is not None:
            device = torch.device(self.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"GeminiConfig.device={self.device!r} but CUDA is not available; use None or 'cpu'")

    def resolved_device(self) -> torch.device:
        """The compute device this config means."""
        if self.device is not None:
            device = torch.device(self.device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return device
        return default_device()
