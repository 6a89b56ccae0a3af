"""Mixed precision: fp32 master weights with bf16/fp16 compute copies, and a dynamic loss scaler over a group.

`MixedPrecision` says which dtype the model computes and communicates in; the masters stay fp32 (they live in
the chunks' ``master`` buffers). `DynamicLossScaler` multiplies the loss by a scale, checks the gradients for
inf/nan with one all-reduce over a given group (it must span every rank whose gradients feed the step: pp x tp x
dp), so every rank skips an overflowing step together, and then halves the scale; after ``growth_interval``
clean steps it doubles it (Micikevicius et al., "Mixed Precision Training", 2018).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colo.comm import Group, all_reduce

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(kw_only=True, frozen=True)
class MixedPrecision:
    """Compute and communication dtypes; master weights and optimizer states are always fp32."""

    param_dtype: torch.dtype = torch.bfloat16
    """dtype of the compute copy of the parameters (and of their gradients): fp32, bf16 or fp16."""
    comm_dtype: torch.dtype | None = None
    """dtype gradients are reduced in; ``None``: ``param_dtype``. fp32 here trades bandwidth for accuracy."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "comm_dtype"):
            value = getattr(self, name)
            if value is None and name == "comm_dtype":
                continue
            if value not in COMPUTE_DTYPES:
                raise ValueError(f"MixedPrecision.{name}={value} is not supported; use one of {COMPUTE_DTYPES}")

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients travel in."""
        return self.comm_dtype or self.param_dtype


class DynamicLossScaler:
    """Dynamic loss scaling with an inf/nan check all-reduced over ``group``.

    Args:
        group: the group whose ranks must agree on skipping (``None``: the world). Use the fused group of every
            axis that holds gradients (``mesh.group("pp", "dp", "tp")``).
        init_scale: the first scale (default ``2**16``).
        growth_factor: multiplier after ``growth_interval`` clean steps (default 2).
        backoff_factor: multiplier after an overflow (default 0.5).
        growth_interval: clean steps between growths (default 1000).
        min_scale: the scale never drops below this (default 1).
    """

    def __init__(
        self,
        *,
        group: Group | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        if init_scale <= 0:
            raise ValueError(f"init_scale={init_scale} must be positive")
        if growth_factor <= 1:
            raise ValueError(f"growth_factor={growth_factor} must be above 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor={backoff_factor} must lie in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval} must be at least 1")
        self.group = group
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0
        self.num_skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (call ``.backward()`` on the result)."""
        return loss * self.scale

    def found_inf(self, grads: list[torch.Tensor], *, device: torch.device | None = None) -> bool:
        """Whether any rank of the group has an inf or nan in ``grads`` (one all-reduce of a flag, on ``device``:
        the compute device, which the group's backend serves; default the first gradient's device)."""
        if device is None:
            device = grads[0].device if grads else torch.device("cpu")
        local = any(not torch.isfinite(g).all() for g in grads)
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        all_reduce(flag, op="max", group=self.group)
        return bool(flag.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.num_skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        """The scaler's changing state (JSON-serialisable): the scale, the clean steps since the last change, and
        the number of skipped steps. The settings (factors, interval) are the constructor's."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned.

        Raises:
            ValueError: ``state`` holds keys `state_dict` does not write.
        """
        unknown = sorted(set(state) - {"scale", "clean_steps", "num_skipped"})
        if unknown:
            raise ValueError(
                f"DynamicLossScaler.load_state_dict: unknown keys {unknown}; pass what state_dict() returned"
            )
        self.scale = float(state.get("scale", self.scale))
        self.clean_steps = int(state.get("clean_steps", self.clean_steps))
        self.num_skipped = int(state.get("num_skipped", self.num_skipped))
