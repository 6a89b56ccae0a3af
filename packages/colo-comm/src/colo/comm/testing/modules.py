"""`load_beside`: import a test-helper module that sits beside a test file, in the test process and in its ranks.

pytest's ``--import-mode=importlib`` does not make test directories importable, and the ranks of `run_distributed`
load a test module from its file (so a pytest fixture, which exists only in the pytest process, cannot reach code
running on the ranks). A shared helper module is therefore loaded by path, once per process: every test file
that asks for it gets the same module object, so its classes are the same in every file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def load_beside(test_file: str | os.PathLike, filename: str, *, module_name: str) -> ModuleType:
    """The module ``filename`` in the directory of ``test_file``, imported once per process as ``module_name``.

    Args:
        test_file: the calling test file (pass ``__file__``).
        filename: the helper module's file name, e.g. ``"_models.py"``.
        module_name: a process-wide unique name for it, e.g. ``"colo_zero_test_models"``.

    Raises:
        FileNotFoundError: no such file beside ``test_file``.
        ValueError: ``module_name`` is already taken by a module loaded from another file.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(test_file)), filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_beside: {path} does not exist (beside {test_file})")
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        if os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
            raise ValueError(f"load_beside: module name {module_name!r} is taken by {loaded!r}; choose another name")
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
