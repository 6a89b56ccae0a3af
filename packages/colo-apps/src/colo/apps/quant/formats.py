"""colo's weight-only quantized formats: int8 per output channel and int4 group-wise, with their storage layout.

Both are computed in fp32 from the weight and never clamp: the scales are chosen so that every code lands inside
its range. Rounding is ``torch.round``: to the nearest code, ties to even.

**int8, symmetric, per output channel.** For row ``o`` of a ``(out_features, in_features)`` weight,
``scale[o] = max_i |w[o, i]| / 127`` and ``q[o, i] = round(w[o, i] / scale[o])`` in ``[-127, 127]`` (``-128`` is
never used, so the grid is symmetric about 0 and 0 is exact); ``w ~ q * scale``. Stored: ``qweight`` int8
``(out, in)``, ``scale`` fp32 ``(out,)``.

**int4, asymmetric, group-wise.** Each row is cut into groups of ``group_size`` consecutive input columns. For group
``g``, ``zero[o, g] = min(w)`` over the group, ``scale[o, g] = (max(w) - min(w)) / 15`` and ``q = round((w - zero) /
scale)`` in ``[0, 15]``; ``w ~ q * scale + zero``. Asymmetric because a group's values are rarely centred: the 16
codes span ``[min, max]`` exactly, a step ``(max - min) / 15`` never larger than the symmetric grid's
``2 max|w| / 14`` (which must also leave one of the 16 codes unused to stay clamp-free). The zero point is a float
(the value code 0 stands for), not an integer code: an integer zero point would shift the grid and clamp the
group's extreme values.

**Packed int4 layout.** Two codes a byte, along the input dimension: ``qweight[o, j] = q[o, 2j] | (q[o, 2j + 1] <<
4)`` (uint8, ``(out, in / 2)``; the even column in the low nibble). ``scale`` and ``zero`` are fp32 ``(out, in /
group_size)``; group ``g`` covers columns ``g * group_size .. (g + 1) * group_size - 1``.

A constant row (int8) or group (int4) gets scale 1: its codes are all 0 (int8 stores 0s, int4 stores the value in
``zero``), exactly.

Storage (bytes, one ``(out, in)`` weight; bf16 is ``2 * out * in``):

- int8: ``out * in + 4 * out`` -> ratio vs bf16 ``(in + 4) / (2 * in)``
- int4: ``out * in / 2 + 8 * out * in / group_size`` -> ratio vs bf16 ``1/4 + 4 / group_size``
"""

from __future__ import annotations

import dataclasses

import torch

MODES = ("int8", "int4")
"""The weight-only quantization modes."""

GROUP_SIZES = (32, 64, 128)
"""The int4 group sizes colo supports."""

INT8_MAX = 127
INT4_LEVELS = 15


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """How to quantize the linear weights of a model.

    Raises:
        ValueError: an unknown ``mode``, a ``group_size`` with int8, or an int4 ``group_size`` not in `GROUP_SIZES`.
    """

    mode: str
    """``"int8"`` (symmetric, per output channel) or ``"int4"`` (asymmetric, group-wise, packed two a byte)."""

    group_size: int | None = None
    """int4 only: input columns sharing one scale and zero point, one of 32, 64, 128 (``None``: 32). Must divide
    every quantized layer's ``in_features``."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"quantization mode {self.mode!r} is unknown; use mode='int8' or mode='int4'")
        if self.mode == "int8" and self.group_size is not None:
            raise ValueError(
                f"group_size={self.group_size} is for int4; int8 is per output channel: leave group_size unset"
            )
        if self.mode == "int4":
            if self.group_size is None:
                object.__setattr__(self, "group_size", GROUP_SIZES[0])
            elif isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
                raise ValueError(f"int4 group_size={self.group_size!r} is not supported; choose one of {GROUP_SIZES}")

    def check_in_features(self, in_features: int, *, name: str) -> None:
        """Raise a `ValueError` naming ``name`` when this config cannot quantize a layer of ``in_features`` inputs."""
        if self.mode == "int4" and in_features % self.group_size:
            fitting = [size for size in GROUP_SIZES if in_features % size == 0]
            fix = (
                f"use group_size in {fitting}"
                if fitting
                else "use mode='int8' or keep the layer in float (skip=..., colo convert --keep-float NAME)"
            )
            raise ValueError(f"{name}: group_size={self.group_size} does not divide in_features={in_features}; {fix}")

    def to_dict(self) -> dict:
        """The config as JSON-ready metadata."""
        return {"mode": self.mode, "group_size": self.group_size}


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per-output-channel quantization of a ``(out, in)`` weight (see the module docstring).

    Returns:
        ``(qweight, scale)``: int8 ``(out, in)`` codes in ``[-127, 127]`` and fp32 ``(out,)`` scales.
    """
    _check_matrix(weight)
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None])
    return codes.to(torch.int8), scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qweight * scale`` row by row, computed in fp32, returned in ``dtype``."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 group-wise quantization of a ``(out, in)`` weight, packed two codes a byte.

    Returns:
        ``(qweight, scale, zero)``: uint8 ``(out, in / 2)`` packed codes, fp32 ``(out, in / group_size)`` scales and
        zero points (the value of code 0, the group's minimum).
    """
    _check_matrix(weight)
    out_features, in_features = weight.shape
    if group_size <= 0 or group_size % 2 or in_features % group_size:
        raise ValueError(f"group_size={group_size} must be even and divide in_features={in_features}")
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    zero = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - zero) / INT4_LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - zero[..., None]) / scale[..., None])
    return pack_int4(codes.to(torch.uint8).reshape(out_features, in_features)), scale, zero


def dequantize_int4(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``code * scale + zero`` group by group from packed codes, computed in fp32, returned in ``dtype``."""
    codes = unpack_int4(qweight).float()
    out_features, in_features = codes.shape
    num_groups = scale.shape[-1]
    groups = codes.reshape(out_features, num_groups, in_features // num_groups)
    return (groups * scale.float()[..., None] + zero.float()[..., None]).reshape(out_features, in_features).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in ``[0, 15]`` of shape ``(rows, cols)`` (``cols`` even) into ``(rows, cols / 2)`` bytes:
    column ``2j`` in the low nibble of byte ``j``, column ``2j + 1`` in the high nibble."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 takes uint8 codes with an even last dim, got {codes.dtype} {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The uint8 codes ``(rows, 2 * cols)`` of `pack_int4`'s ``(rows, cols)`` bytes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantized_weight_bytes(out_features: int, in_features: int, config: QuantConfig) -> int:
    """Bytes colo stores for one quantized ``(out, in)`` weight (codes, scales, zero points; see the module
    docstring's formulas)."""
    if config.mode == "int8":
        return out_features * in_features + 4 * out_features
    return out_features * in_features // 2 + 8 * out_features * (in_features // config.group_size)


def _check_matrix(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a floating-point (out, in) weight, got {weight.dtype} {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("the weight holds inf or nan; it cannot be quantized")
