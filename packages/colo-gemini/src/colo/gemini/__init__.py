"""colo.gemini: The heterogeneous memory manager: chunk placement over device, host and disk tiers, memory tracing,
prefetch and the hybrid optimizer.

The contents of this package arrive in their own issue; this is the package skeleton.
"""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
