"""pytest markers for tests that need GPUs: they skip, with a reason, on machines without them."""

from __future__ import annotations

import pytest
import torch


def requires_gpus(count: int = 1) -> pytest.MarkDecorator:
    """Skip unless at least ``count`` CUDA devices are visible."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(available < count, reason=f"needs {count} CUDA device(s); {available} visible")


requires_cuda = requires_gpus(1)
"""Skip unless a CUDA device is visible."""
