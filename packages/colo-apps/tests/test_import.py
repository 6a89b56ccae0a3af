"""The colo-apps package imports and merges into the `colo` namespace."""

import importlib


def test_imports_with_version():
    module = importlib.import_module("colo.apps")
    assert module.__version__ == "0.1.0"
    assert "__version__" in module.__all__


def test_the_booster_loads_no_recipe_and_the_trainer_names_load_on_use():
    """`import colo.apps.booster` does not load the RLHF or diffusion recipes (issue 41); `colo.apps.Trainer` and the
    other trainer names still resolve, on first use; none of it imports ``torch._dynamo`` (about 1.5 s of every
    process: colo.kernels marks its compile-time constant without it)."""
    import subprocess
    import sys

    probe = (
        "import sys, colo.apps.booster; "
        "print(sorted(m for m in sys.modules if 'rlhf' in m or 'diffusion' in m or m == 'colo.apps.train')); "
        "import colo.apps; print(colo.apps.Trainer.__name__, colo.apps.load_config.__name__); "
        "import colo.apps.cli.app, colo.apps.train.trainer; print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "Trainer load_config", "False"], done.stdout
