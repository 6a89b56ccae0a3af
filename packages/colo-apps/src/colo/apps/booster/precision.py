"""Precision names shared by the plugins: ``"fp32"``, ``"bf16"`` and ``"fp16"``."""

from __future__ import annotations

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(owner: str, value: str) -> torch.dtype:
    """The dtype of a precision name; a `ValueError` naming ``owner.precision`` and the choices otherwise."""
    if value not in PRECISIONS:
        raise ValueError(f"{owner}.precision={value!r} is not supported; use one of {sorted(PRECISIONS)}")
    return PRECISIONS[value]
