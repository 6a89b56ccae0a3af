"""``colo info``: the environment a bug report needs: Python, platform, torch and its devices, colo packages."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

COLO_DISTRIBUTIONS = (
    "colo-comm",
    "colo-kernels",
    "colo-tensor",
    "colo-zero",
    "colo-gemini",
    "colo-pipeline",
    "colo-apps",
)
OPTIONAL = ("triton", "transformers", "tensorboard", "numpy", "pydantic", "typer", "rich", "safetensors")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment_info() -> dict:
    """A JSON-able description of this machine's Python, torch, devices and colo packages."""
    import torch
    import torch.distributed as dist

    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": {
            "available": torch.cuda.is_available(),
            "version": torch.version.cuda,
            "devices": devices,
        },
        "distributed": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
        },
        "colo": {name: _version(name) for name in COLO_DISTRIBUTIONS},
        "packages": {name: _version(name) for name in OPTIONAL},
    }


def format_info(info: dict) -> str:
    """``colo info``'s text: one ``key: value`` line per item."""
    lines = [
        f"python        {info['python']} ({info['executable']})",
        f"platform      {info['platform']}, {info['cpu_count']} CPUs",
        f"torch         {info['torch']}",
    ]
    cuda = info["cuda"]
    if cuda["available"]:
        lines.append(f"cuda          {cuda['version']}, {len(cuda['devices'])} device(s)")
        for device in cuda["devices"]:
            lines.append(
                f"  cuda:{device['index']}      {device['name']}, {device['memory_gib']} GiB, sm {device['capability']}"
            )
    else:
        lines.append("cuda          not available (training runs on CPU with gloo)")
    backends = [name for name, ok in info["distributed"].items() if ok]
    lines.append(f"backends      {', '.join(backends) or 'none'}")
    for name, version in info["colo"].items():
        lines.append(f"{name:<14}{version or 'not installed'}")
    for name, version in info["packages"].items():
        lines.append(f"{name:<14}{version or 'not installed'}")
    return "\n".join(lines)
