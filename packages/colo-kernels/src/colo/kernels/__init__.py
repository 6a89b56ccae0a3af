"""colo.kernels: Triton kernels with torch reference implementations and a dispatcher.

Each op has a torch reference and a Triton implementation, both autograd-aware, behind one public function;
`resolve_backend` picks Triton on CUDA and the reference elsewhere (``COLO_KERNELS=triton|torch|auto`` forces it).
"""

from .dispatch import UnsupportedKernelInput, resolve_backend, triton_available, use_backend

__version__ = "0.1.0"

__all__ = ["UnsupportedKernelInput", "__version__", "resolve_backend", "triton_available", "use_backend"]
