"""Model FLOPs utilization (MFU, Chowdhery et al., 2022): achieved model FLOP/s over the device's peak.

The peak is the dense (no sparsity) bf16 / fp16 tensor-core throughput from the vendor's datasheet, looked up by
the name CUDA reports. Where it is not known (a CPU, an unlisted GPU, fp32 math) MFU is ``None``, shown "n/a":
a guessed peak would make a wrong number look authoritative.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, so `import colo.apps` does not import it
    import torch

PEAK_FLOPS: dict[str, float] = {
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100": 312e12,
}
"""Dense bf16 / fp16 tensor-core peak FLOP/s per GPU (NVIDIA datasheets; A100 SXM and PCIe alike)."""


def device_family(device_name: str) -> str | None:
    """The `PEAK_FLOPS` key of a CUDA device name (``"NVIDIA H100 80GB HBM3"`` -> ``"H100 SXM"``), or ``None``.

    H100 and H200 NVL parts (other clocks and power) are not listed, so they give ``None``.
    """
    name = device_name.upper()
    if "NVL" in name:
        return None
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else "H100 SXM"
    if "H200" in name:
        return "H200"
    if "A100" in name:
        return "A100"
    return None


def peak_flops(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> float | None:
    """The peak FLOP/s of ``device`` for matmuls in ``dtype``, or ``None`` when unknown.

    Args:
        device (torch.device | str | None): a CUDA device; ``None``: the current CUDA device if there is one.
            Default: ``None``.
        dtype (torch.dtype | None): the compute dtype; only bf16 and fp16 have a listed peak. Default: ``None``
            (``torch.bfloat16``).

    Returns:
        float | None: FLOP/s, or ``None`` on a CPU, an unlisted GPU or another dtype.
    """
    import torch

    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return None
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return None
    family = device_family(torch.cuda.get_device_name(device))
    return None if family is None else PEAK_FLOPS[family]


def mfu(
    tokens_per_second: float, flops_per_token: float, peak_flops: float | None, *, num_devices: int = 1
) -> float | None:
    """Model FLOPs utilization: ``tokens_per_second * flops_per_token / (peak_flops * num_devices)``.

    Args:
        tokens_per_second (float): training throughput over all ``num_devices``.
        flops_per_token (float): model FLOPs per token (e.g. `colo.apps.models.llama.flops_per_token`).
        peak_flops (float | None): one device's peak FLOP/s (`peak_flops`); ``None`` when unknown.
        num_devices (int): devices the throughput was measured over. Default: ``1``.

    Returns:
        float | None: the fraction of the peak (0.4 for 40%), or ``None`` when the peak is unknown.
    """
    if num_devices < 1:
        raise ValueError(f"mfu: num_devices={num_devices} must be at least 1")
    if peak_flops is None:
        return None
    if peak_flops <= 0:
        raise ValueError(f"mfu: peak_flops={peak_flops} must be positive (or None when unknown)")
    return tokens_per_second * flops_per_token / (peak_flops * num_devices)


def format_mfu(value: float | None) -> str:
    """``"41.3%"``, or ``"n/a"`` for an unknown MFU."""
    return "n/a" if value is None else f"{100 * value:.1f}%"
