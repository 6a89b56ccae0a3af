"""Launch configurations measured on GPUs (block sizes, warps, pipeline stages), kept as data beside the kernels.

``tuning.json`` next to this module lists entries ``{"kernel", "capability", "match", "config", "measured"}``: for
one kernel (``"flash_attention.forward"``, ``"rms_norm.forward"``, ...) on GPUs of one compute capability
(``[9, 0]`` for H100/H200), the launch configuration a tuning run measured fastest for inputs whose properties equal
``match`` (a property ``match`` leaves out matches any value). ``benchmarks/kernel_tuning.py`` writes such files;
``COLO_KERNEL_TUNING=PATH`` makes a process read PATH instead (a tuning run, an experiment). A kernel asks
`tuned_config` and keeps its own default configuration when no entry matches, so CPUs, the interpreter and
untuned GPUs run exactly the code they ran before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

TUNING_ENV = "COLO_KERNEL_TUNING"
"""Environment variable naming a tuning file that replaces the packaged ``tuning.json``."""

DEFAULT_TUNING_PATH = Path(__file__).with_name("tuning.json")

_tables: dict[str, list[dict]] = {}
_lookups: dict[tuple, dict | None] = {}


def _load(path: str) -> list[dict]:
    """The entries of a tuning file, each checked for the fields `tuned_config` reads."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        if Path(path) == DEFAULT_TUNING_PATH:
            return []
        raise ValueError(f"{TUNING_ENV}={path}: no such file; unset it or point it at a tuning JSON") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"tuning file {path}: expected an object with a list 'entries'")
    for index, entry in enumerate(entries):
        fields = ("kernel", "capability", "config")
        if not isinstance(entry, dict) or any(field not in entry for field in fields):
            raise ValueError(f"tuning file {path}: entries[{index}] needs the fields {', '.join(fields)}")
    return entries


def _entries() -> tuple[str, list[dict]]:
    path = os.environ.get(TUNING_ENV) or str(DEFAULT_TUNING_PATH)
    if path not in _tables:
        _tables[path] = _load(path)
    return path, _tables[path]


def tuned_config(kernel: str, device: torch.device, **properties) -> dict | None:
    """The measured launch configuration of ``kernel`` for inputs with ``properties`` on ``device``, or None.

    Only CUDA devices have entries. The first entry whose kernel and capability equal the device's and whose
    ``match`` agrees with every given property wins; the answer is cached per (file, kernel, device, properties).
    """
    if device.type != "cuda":
        return None
    path, entries = _entries()
    capability = tuple(torch.cuda.get_device_capability(device))
    key = (path, kernel, capability, tuple(sorted(properties.items())))
    if key not in _lookups:
        _lookups[key] = matching_config(entries, kernel, capability, **properties)
    found = _lookups[key]
    return None if found is None else dict(found)


def matching_config(entries: list[dict], kernel: str, capability: tuple[int, int], **properties) -> dict | None:
    """The ``config`` of the first entry for ``kernel`` and ``capability`` whose ``match`` agrees with every given
    property (a property the entry's ``match`` leaves out matches any value), or None."""
    for entry in entries:
        match = entry.get("match", {})
        if (
            entry["kernel"] == kernel
            and tuple(entry["capability"]) == tuple(capability)
            and all(match[name] == value for name, value in properties.items() if name in match)
        ):
            return dict(entry["config"])
    return None


def clear_cache() -> None:
    """Forget loaded tuning files and looked-up configurations (after changing ``COLO_KERNEL_TUNING``)."""
    _tables.clear()
    _lookups.clear()
