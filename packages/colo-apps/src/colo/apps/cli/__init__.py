"""The ``colo`` command line: ``colo train``, ``colo launch``, ``colo info``, ``colo config``, ``colo generate``,
``colo convert`` (``python -m colo.apps.cli ...`` is the same)."""

from .app import app, main

__all__ = ["app", "main"]
