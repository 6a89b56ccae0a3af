"""Ship a function to other processes by reference: module name, file and qualified name.

Plain pickling fails for modules that are not importable by name in a fresh process, such as pytest test files
imported with ``--import-mode=importlib``; those are loaded from their file instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FunctionRef:
    """Where to find a module-level function in another process."""

    module: str
    qualname: str
    path: str | None


def ref_of(fn: Callable[..., Any]) -> FunctionRef:
    """A `FunctionRef` for ``fn``; raises if ``fn`` is not reachable from its module's top level."""
    if not callable(fn):
        raise TypeError(f"expected a function to run on every rank, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not qualname or not module or "<" in qualname:
        raise TypeError(
            f"{getattr(fn, '__name__', fn)!r} cannot be shipped to other processes: lambdas, closures and "
            "functions defined inside other functions cannot be found there; define it at module level"
        )
    try:
        path = inspect.getsourcefile(fn) or inspect.getfile(fn)
    except TypeError:
        path = getattr(sys.modules.get(module), "__file__", None)
    return FunctionRef(module, qualname, os.path.abspath(path) if path else None)


def _same_file(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _load_module(ref: FunctionRef):
    if ref.module == "__main__" or ref.module == "__mp_main__":
        main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
        if main is not None and _has(main, ref.qualname):
            return main
    module = sys.modules.get(ref.module)
    if module is not None and (ref.path is None or _same_file(getattr(module, "__file__", None), ref.path)):
        return module
    try:
        spec = importlib.util.find_spec(ref.module)
    except (ImportError, ValueError, AttributeError):
        spec = None
    if spec is not None and (ref.path is None or _same_file(spec.origin, ref.path)):
        return importlib.import_module(ref.module)
    if ref.path is None or not os.path.exists(ref.path):
        raise ImportError(f"cannot find module {ref.module!r} (file {ref.path!r}) to run {ref.qualname}")
    name = ref.module if ref.module not in ("__main__", "__mp_main__") else "__colo_main__"
    spec = importlib.util.spec_from_file_location(name, ref.path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ref.path} to run {ref.qualname}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _has(obj: Any, qualname: str) -> bool:
    for part in qualname.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def resolve(ref: FunctionRef) -> Callable[..., Any]:
    """The function a `FunctionRef` names, importing or loading its module if needed."""
    obj: Any = _load_module(ref)
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    return obj
