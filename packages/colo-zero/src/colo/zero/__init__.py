"""colo.zero: ZeRO stages 1/2/3 over a data-parallel axis: chunks, mixed precision and loss scaling, clipping,
accumulation and optimizer-state offload.

The contents of this package arrive in their own issue; this is the package skeleton.
"""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
