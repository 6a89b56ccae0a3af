"""Root pytest configuration: runs before any test module, so before anything imports triton."""

import os

import torch

# Triton kernels run in Triton's interpreter on machines without CUDA; the variable is read when a kernel is
# decorated with @triton.jit, so it must be set before any colo.kernels module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
