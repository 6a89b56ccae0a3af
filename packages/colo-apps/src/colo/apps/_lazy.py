"""Lazy re-exports (PEP 562) for `colo.apps` and `colo.apps.data`: a name is imported from its submodule on first use,
so importing a torch-free part of a package does not import the rest."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``(__getattr__, __dir__)`` of ``package`` re-exporting ``exports`` (name -> submodule).

    A name is imported on first access and then kept in the package's namespace; any other attribute is tried as a
    submodule (``colo.apps.train`` after ``import colo.apps``), else `AttributeError`.
    """

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            try:
                return importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":
                    raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
