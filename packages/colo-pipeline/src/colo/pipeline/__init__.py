"""colo.pipeline: Pipeline parallelism: stage partitioning, activation p2p, schedules as data, one executor, a simulator and a timeline renderer.

The contents of this package arrive in their own issue; this is the package skeleton.
"""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
