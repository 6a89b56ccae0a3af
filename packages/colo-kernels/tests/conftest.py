"""colo-kernels tests: Triton kernels run in Triton's interpreter when there is no CUDA device.

The root conftest sets this too; this one keeps the package's tests runnable on their own
(``pytest packages/colo-kernels/tests`` with only colo-kernels installed).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
