"""Row tiling shared by the row-wise Triton kernels (`rms_norm`, `layer_norm`, `softmax`).

These kernels treat their input as ``(rows, hidden)``, hold a whole row in one block and process several rows per
program; their backward kernels loop over row tiles and accumulate per-program partial parameter gradients.
"""

from __future__ import annotations

import torch

from .dispatch import UnsupportedKernelInput
from .tuning import tuned_config

try:
    import triton
except ImportError:  # triton is a Linux-only dependency; the reference paths work without it
    triton = None

MAX_FUSED_COLS = 65536
"""Widest row the row-wise Triton kernels hold in one block; wider inputs need ``backend="torch"``."""


def _row_tiling(
    op: str, n_rows: int, n_cols: int, device: torch.device, kernel: str = "forward"
) -> tuple[int, int, int]:
    """``(BLOCK_N, ROWS, num_warps)`` for ``op``'s ``kernel`` (``"forward"`` or ``"backward"``), which holds whole
    rows of ``n_cols`` elements.

    On a GPU a tile is about 2k+ elements (several short rows per program), or what `colo.kernels.tuning` measured
    for the op, kernel and ``BLOCK_N`` on the GPU's architecture; in Triton's interpreter every tile operation is
    one numpy call, so tiles are as large as 32k elements to keep CPU tests fast.
    """
    if n_cols > MAX_FUSED_COLS:
        raise UnsupportedKernelInput(
            f"{op}: rows of {n_cols} elements exceed the {MAX_FUSED_COLS} the Triton kernel holds in one block; "
            "use backend='torch'"
        )
    block_n = triton.next_power_of_2(max(n_cols, 1))
    if device.type == "cuda":
        rows = max(1, min(16, 2048 // block_n))
    else:
        rows = min(triton.next_power_of_2(max(n_rows, 1)), max(1, 32768 // block_n))
    num_warps = min(16, max(4, rows * block_n // 512))
    tuned = tuned_config(f"{op}.{kernel}", device, block_n=block_n)
    if tuned is not None:
        rows, num_warps = int(tuned.get("ROWS", rows)), int(tuned.get("num_warps", num_warps))
    return block_n, rows, num_warps


def _backward_grid(num_tiles: int, device: torch.device) -> int:
    """Programs for a backward kernel that loops over row tiles: a few per SM on a GPU; at most two in the
    interpreter, so CPU tests exercise a program that accumulates over several tiles, as on a GPU."""
    if device.type == "cuda":
        return max(1, min(num_tiles, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(num_tiles, 2))
