"""The colo-gemini package imports and merges into the `colo` namespace."""

import importlib


def test_imports_with_version():
    module = importlib.import_module("colo.gemini")
    assert module.__version__ == "0.1.0"
    assert "__version__" in module.__all__
