"""The monorepo keeps DESIGN.md's shape: seven hatchling packages, one `colo` namespace, imports only down the table."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

ALLOWED = {
    "comm": set(),
    "kernels": set(),
    "tensor": {"comm", "kernels"},
    "zero": {"comm", "tensor", "kernels"},
    "gemini": {"comm", "tensor", "zero", "kernels"},
    "pipeline": {"comm", "tensor"},
    "apps": {"comm", "tensor", "zero", "gemini", "pipeline", "kernels"},
}
"""DESIGN.md §1: which colo packages each package may import (besides itself)."""

PACKAGES = sorted(ALLOWED)


def _package_dir(name: str) -> Path:
    return ROOT / "packages" / f"colo-{name}"


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _colo_imports(path: Path) -> set[str]:
    """The colo subpackages a Python file imports (``colo.comm`` -> ``comm``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "colo":
                names = [f"colo.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "colo" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_the_seven_packages_and_nothing_else():
    present = sorted(p.name.removeprefix("colo-") for p in (ROOT / "packages").iterdir() if p.is_dir())
    assert present == PACKAGES


def test_colo_is_a_namespace_package_everywhere():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.glob("packages/*/src/colo/__init__.py")]
    assert not offenders, f"colo is a PEP 420 namespace: remove {offenders}"


@pytest.mark.parametrize("name", PACKAGES)
def test_package_layout_and_build_config(name):
    package = _package_dir(name)
    for required in ("pyproject.toml", "README.md", f"src/colo/{name}/__init__.py", "tests"):
        assert (package / required).exists(), f"colo-{name} lacks {required}"
    config = _pyproject(package / "pyproject.toml")
    assert config["build-system"]["build-backend"] == "hatchling.build"
    assert config["project"]["name"] == f"colo-{name}"
    wheel = config["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["packages"] == ["src/colo"]
    assert "dev-mode-exact" not in wheel and "dev-mode-exact" not in config["tool"]["hatch"]["build"]
    assert config["tool"]["hatch"]["version"]["path"] == f"src/colo/{name}/__init__.py"
    init = (package / f"src/colo/{name}/__init__.py").read_text()
    assert re.search(r'^__version__ = "0\.1\.0"$', init, re.M)
    assert "__all__" in init


@pytest.mark.parametrize("name", PACKAGES)
def test_declared_colo_dependencies_follow_the_table_with_ranges(name):
    config = _pyproject(_package_dir(name) / "pyproject.toml")
    colo_deps = {}
    for requirement in config["project"]["dependencies"]:
        match = re.match(r"colo-(\w+)(.*)", requirement)
        if match:
            colo_deps[match.group(1)] = match.group(2)
    assert set(colo_deps) == ALLOWED[name], f"colo-{name} must depend on exactly {sorted(ALLOWED[name])}"
    for dep, spec in colo_deps.items():
        assert spec == ">=0.1,<0.2", f"colo-{name} -> colo-{dep}: use the range >=0.1,<0.2, got {spec!r}"


@pytest.mark.parametrize("name", PACKAGES)
def test_imports_only_go_down_the_table(name):
    package = _package_dir(name)
    allowed = ALLOWED[name] | {name}
    violations = []
    for path in sorted(list(package.glob("src/**/*.py")) + list(package.glob("tests/**/*.py"))):
        for imported in _colo_imports(path) - allowed:
            violations.append(f"{path.relative_to(ROOT)} imports colo.{imported}")
    assert not violations, f"colo-{name} may import only {sorted(allowed)}:\n" + "\n".join(violations)


def test_nothing_imports_colo_apps_and_comm_imports_no_colo_package():
    for name in PACKAGES:
        if name != "apps":
            assert "apps" not in ALLOWED[name]
    assert ALLOWED["comm"] == set()


def test_the_meta_distribution_depends_on_all_seven():
    config = _pyproject(ROOT / "pyproject.toml")
    deps = {re.match(r"(colo-\w+)", d).group(1) for d in config["project"]["dependencies"] if d.startswith("colo-")}
    assert deps == {f"colo-{name}" for name in PACKAGES}


def test_the_import_checker_sees_every_import_form(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("import colo.zero\nfrom colo.tensor import x\nfrom colo import apps\nfrom . import local\n")
    assert _colo_imports(source) == {"zero", "tensor", "apps"}


def test_ci_runs_exactly_the_readme_test_commands():
    """CI runs the README's two test commands: the whole suite on the pinned torch, then the floor torch's tests."""
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in ci.splitlines() if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert commands == ["make test", "make test-floor"]
    readme = (ROOT / "README.md").read_text()
    assert "make test " in readme and "make test-floor " in readme
