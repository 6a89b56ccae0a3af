"""The colo-tensor package imports and merges into the `colo` namespace."""

import importlib


def test_imports_with_version():
    module = importlib.import_module("colo.tensor")
    assert module.__version__ == "0.1.0"
    assert "__version__" in module.__all__
