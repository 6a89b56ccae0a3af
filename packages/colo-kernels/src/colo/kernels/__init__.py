"""colo.kernels: Triton kernels with torch reference implementations and a dispatcher.

The contents of this package arrive in their own issue; this is the package skeleton.
"""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
