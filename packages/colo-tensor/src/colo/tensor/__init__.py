"""colo.tensor: Layouts over a mesh, redistribution, autograd communication ops, tensor-parallel layers, sequence parallelism, `parallelize(model, plan)` and the sharded checkpoint format.

The contents of this package arrive in their own issue; this is the package skeleton.
"""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
