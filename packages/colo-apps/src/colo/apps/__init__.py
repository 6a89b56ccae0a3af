"""colo.apps: The Booster and its plugins, native models and their plans, Hugging Face plans, the trainer, configs, the
`colo` CLI and the recipes.

The contents of this package arrive in their own issue; this is the package skeleton.
"""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
