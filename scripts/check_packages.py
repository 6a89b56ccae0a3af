#!/usr/bin/env python3
"""Check that each colo package installs with only its colo dependencies and that its own tests then pass.

For every package (or those named), this creates a fresh virtual environment, installs torch through the same
pin as `make test`, installs the package with its ``testing`` extra and its colo dependencies from this checkout
(non-editable, so a missing file in a wheel shows up), checks that no other colo package is importable, and runs
the package's tests. Nothing else is installed: a package that imports something it does not declare (numpy,
which torch's object collectives need but torch does not require) fails here as it would for a user, and what the
tests themselves need (pytest, hypothesis, ...) comes from the package's ``testing`` extra. Not part of
`make test` (it installs torch once per package); run it with `make check-packages`.

    python scripts/check_packages.py                # all seven
    python scripts/check_packages.py comm kernels   # some
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPENDENCIES = {
    "comm": [],
    "kernels": [],
    "tensor": ["comm", "kernels"],
    "zero": ["comm", "tensor", "kernels"],
    "gemini": ["comm", "tensor", "zero", "kernels"],
    "pipeline": ["comm", "tensor"],
    "apps": ["comm", "tensor", "zero", "gemini", "pipeline", "kernels"],
}


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("  $", " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def closure(name: str) -> list[str]:
    """``name``'s colo dependencies, direct and transitive (colo-pipeline needs colo-kernels through colo-tensor)."""
    found: list[str] = []
    for dep in DEPENDENCIES[name]:
        for item in [*closure(dep), dep]:
            if item not in found:
                found.append(item)
    return found


def requirements(name: str) -> list[str]:
    """What ``pip install`` gets for ``name``, besides torch: the package with its ``testing`` extra and its colo
    dependencies, in one resolve; the colo packages come from this checkout (never from an index), everything else
    only because one of them declares it."""
    packages = ROOT / "packages"
    return [*(str(packages / f"colo-{dep}") for dep in closure(name)), f"{packages / f'colo-{name}'}[testing]"]


def check(name: str, torch_pin: str) -> float:
    start = time.monotonic()
    deps = closure(name)
    print(f"\n== colo-{name} (with {deps or 'no other colo package'})", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"colo-{name}-") as tmp:
        venv = Path(tmp) / "venv"
        _run([sys.executable, "-m", "venv", str(venv)])
        python = str(venv / "bin" / "python")
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={torch_pin}\n")
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(constraints)]
        _run(pip + ["torch"])
        _run(pip + requirements(name))
        others = sorted(set(DEPENDENCIES) - set(deps) - {name})
        probe = (
            "import importlib.util, sys; "
            f"present = [n for n in {others!r} if importlib.util.find_spec('colo.' + n)]; "
            "sys.exit(f'other colo packages importable: {present}' if present else 0)"
        )
        _run([python, "-c", probe])
        _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"packages/colo-{name}/tests"], cwd=ROOT)
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", default=list(DEPENDENCIES), help="package names (default: all)")
    parser.add_argument("--torch", default="2.13.0", help="torch version to pin in each environment")
    args = parser.parse_args()
    unknown = [p for p in args.packages if p not in DEPENDENCIES]
    if unknown:
        parser.error(f"unknown package {unknown[0]!r}; choose from {', '.join(DEPENDENCIES)}")
    timings = {name: check(name, args.torch) for name in args.packages}
    print("\nall passed: " + ", ".join(f"colo-{n} ({t:.0f}s)" for n, t in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
