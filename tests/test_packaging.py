"""Each package declares what it needs: a user who installs only colo-zero gets everything colo-zero imports.

A third-party module a package's source imports at module level is one of its ``dependencies`` (in its
``testing`` subpackage, the test harness, it may come from the ``testing`` extra instead); one imported inside a
function (an optional feature) is a dependency or in an extra; its tests need only its own dependencies, those of
its colo dependencies and its ``testing`` extra. numpy has a rule of its own, because the import that needs it is
usually not in colo's code: torch's object collectives (``broadcast_object_list``, ...) and ``Tensor.numpy()`` run
on numpy, and Triton's interpreter (how colo.kernels runs on CPU) imports it, yet neither torch nor triton requires
it. Finally `scripts/check_packages.py`, which installs each package alone and runs its tests, installs nothing
the packages do not declare, so it catches what these static rules miss.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name.removeprefix("colo-") for p in (ROOT / "packages").iterdir() if p.is_dir())

DISTRIBUTION_OF = {"yaml": "pyyaml", "PIL": "pillow", "pil": "pillow", "mlflow": "mlflow-skinny"}
"""Import names that differ from the distribution that provides them (the others are the same, normalised)."""

TORCH_CALLS_NEEDING_NUMPY = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}
"""torch.distributed's object collectives: they turn pickled bytes into tensors and back through numpy."""

IMPORTS_NEEDING_NUMPY = {"triton"}
"""Third-party modules that need numpy without requiring it: Triton's interpreter imports numpy (triton 3.x)."""


def _normalise(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _requirement_name(requirement: str) -> str:
    return _normalise(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def _pyproject(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / f"colo-{name}" / "pyproject.toml").read_text())["project"]


def _dependencies(name: str) -> set[str]:
    return {_requirement_name(r) for r in _pyproject(name).get("dependencies", [])}


def _extras(name: str) -> dict[str, set[str]]:
    extras = _pyproject(name).get("optional-dependencies", {})
    return {extra: {_requirement_name(r) for r in requirements} for extra, requirements in extras.items()}


def _colo_closure(name: str) -> set[str]:
    """The colo packages ``name`` depends on, directly or not (``comm``, ``tensor``, ...)."""
    found: set[str] = set()
    for dep in _dependencies(name):
        if dep.startswith("colo-") and dep[5:] not in found:
            found |= {dep[5:], *_colo_closure(dep[5:])}
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """The third-party modules a file imports, each ``"module"`` (runs on import) or ``"lazy"`` (in a function)."""

    def __init__(self) -> None:
        self.found: dict[str, str] = {}
        self._function_depth = 0

    def _add(self, module: str) -> None:
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top in ("colo", "__future__"):
            return
        distribution = _normalise(DISTRIBUTION_OF.get(top, top))
        if self._function_depth == 0 or self.found.get(distribution) != "module":
            self.found[distribution] = "lazy" if self._function_depth else "module"

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._function_depth += 1
        self.generic_visit(node)
        self._function_depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # never runs
            for statement in node.orelse:
                self.visit(statement)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module)


def _imports(path: Path) -> dict[str, str]:
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    return visitor.found


def _needs_numpy_through_torch(path: Path) -> list[str]:
    """The calls in a file that need numpy although no import says so: ``Tensor.numpy()``, ``torch.from_numpy``
    and torch.distributed's object collectives."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver, attribute = ast.unparse(node.func.value), node.func.attr
        through_dist = receiver in ("dist", "torch.distributed", "c10d") and attribute in TORCH_CALLS_NEEDING_NUMPY
        if attribute == "numpy" and not node.args or attribute == "from_numpy" or through_dist:
            calls.append(f"{path.relative_to(ROOT)}:{node.lineno} {receiver}.{attribute}()")
    return calls


def _sources(name: str, folder: str) -> list[Path]:
    return sorted((ROOT / "packages" / f"colo-{name}" / folder).rglob("*.py"))


@pytest.mark.parametrize("name", PACKAGES)
def test_every_third_party_import_of_the_source_is_declared(name):
    dependencies, extras = _dependencies(name), _extras(name)
    optional = set().union(*extras.values())
    harness = ROOT / "packages" / f"colo-{name}" / "src" / "colo" / name / "testing"
    missing = []
    for path in _sources(name, "src"):
        for distribution, when in _imports(path).items():
            allowed = dependencies | (extras.get("testing", set()) if harness in path.parents else set())
            if when == "lazy":
                allowed = allowed | optional
            if distribution not in allowed:
                missing.append(f"{path.relative_to(ROOT)} imports {distribution} ({when} level)")
    assert not missing, (
        f"colo-{name} imports what its pyproject.toml does not declare; add each to [project] dependencies (an "
        "optional feature imported inside a function may use an extra instead):\n" + "\n".join(missing)
    )


@pytest.mark.parametrize("name", PACKAGES)
def test_numpy_is_declared_where_torch_or_triton_needs_it(name):
    dependencies = _dependencies(name)
    reasons = []
    for path in _sources(name, "src"):
        reasons += _needs_numpy_through_torch(path)
        reasons += [
            f"{path.relative_to(ROOT)} imports {module}, whose interpreter imports numpy"
            for module in IMPORTS_NEEDING_NUMPY & set(_imports(path))
        ]
    if reasons:
        assert "numpy" in dependencies, (
            f"colo-{name} needs numpy, which neither torch nor triton installs; add 'numpy>=1.24' to its "
            "[project] dependencies:\n" + "\n".join(reasons)
        )


def test_every_package_on_colo_comm_gets_numpy_for_the_object_collectives():
    # colo.comm.broadcast_object (zero.save, checkpoints, the pipeline's shape metadata) runs torch's
    # broadcast_object_list, which fails with "Numpy is not available" in an environment without numpy
    assert "numpy" in _dependencies("comm")
    users = [name for name in PACKAGES if "comm" in _colo_closure(name)]
    assert {"tensor", "zero", "gemini", "pipeline", "apps"} <= set(users)


@pytest.mark.parametrize("name", PACKAGES)
def test_tests_import_only_what_the_package_and_its_testing_extra_declare(name):
    testing = _extras(name).get("testing", set())
    assert {"pytest", "pytest-timeout"} <= testing, f"colo-{name}'s testing extra must list pytest and pytest-timeout"
    colo_in_testing = {dep[5:] for dep in testing if dep.startswith("colo-")}
    assert colo_in_testing <= _colo_closure(name), (
        f"colo-{name}'s testing extra names colo packages it does not depend on: "
        f"{sorted(colo_in_testing - _colo_closure(name))}; the package is tested without them"
    )
    allowed = _dependencies(name) | testing
    for dep in _colo_closure(name):
        allowed |= _dependencies(dep) | (_extras(dep).get("testing", set()) if dep in colo_in_testing else set())
    missing = [
        f"{path.relative_to(ROOT)} imports {distribution}"
        for path in _sources(name, "tests")
        for distribution in _imports(path)
        if distribution not in allowed
    ]
    assert not missing, (
        f"colo-{name}'s tests import what neither the package nor its testing extra declares; add each to the "
        "testing extra in its pyproject.toml:\n" + "\n".join(missing)
    )


def _check_packages_script():
    spec = importlib.util.spec_from_file_location("check_packages", ROOT / "scripts" / "check_packages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", PACKAGES)
def test_check_packages_installs_only_what_the_packages_declare(name):
    script = _check_packages_script()
    assert not hasattr(script, "TEST_TOOLS"), "check_packages.py must not install tools the packages do not declare"
    packages = ROOT / "packages"
    expected = [str(packages / f"colo-{dep}") for dep in script.closure(name)]
    expected.append(f"{packages / f'colo-{name}'}[testing]")
    assert script.requirements(name) == expected
    assert set(script.closure(name)) == _colo_closure(name), "check_packages.py's DEPENDENCIES disagree with pyproject"
    # torch is the only other requirement it passes to pip, and every package declares it
    source = (ROOT / "scripts" / "check_packages.py").read_text()
    assert '_run(pip + ["torch"])' in source
    assert "torch" in _dependencies(name)


def test_the_import_scanner_tells_module_level_from_lazy(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "import os\nimport numpy as np\nfrom yaml import safe_load\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pandas\ntry:\n    import rich\nexcept ImportError:\n    pass\n"
        "def f(t):\n    import peft\n    return t.numpy()\n"
    )
    assert _imports(source) == {"numpy": "module", "pyyaml": "module", "rich": "module", "peft": "lazy"}
