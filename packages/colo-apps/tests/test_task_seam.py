"""Recipes plug into the one training loop through `colo.apps.train.task` (issue 41): the trainer knows no recipe,
``data.task`` is looked up in the registry only, and the run config is assembled from the registered tasks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APPS = Path(__file__).resolve().parents[1] / "src" / "colo" / "apps"


def _imported_modules(path: Path) -> set[str]:
    """The modules a file imports, relative imports resolved against its package (``colo.apps.train.x``)."""
    package = ".".join(path.relative_to(APPS.parents[1]).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_train_imports_no_recipe():
    recipes = ("colo.apps.rlhf", "colo.apps.diffusion", "colo.apps.recipes")
    violations = [
        f"{path.relative_to(APPS)} imports {module}"
        for path in sorted((APPS / "train").glob("*.py"))
        for module in sorted(_imported_modules(path))
        if module.startswith(recipes)
    ]
    assert not violations, "\n".join(violations)


def test_the_import_resolver_sees_relative_imports(tmp_path):
    path = APPS / "train" / "trainer.py"
    modules = _imported_modules(path)
    assert "colo.apps.train.task" in modules and "colo.comm" in modules


def _is_task_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "task" and getattr(node.value, "attr", None) == "data"


def _is_string(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(_is_string(e) for e in node.elts)


def test_data_task_is_branched_on_nowhere():
    """No ``config.data.task == "..."`` / ``in ("...", ...)`` anywhere in colo-apps: the registry decides."""
    branches = []
    for path in sorted(APPS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_is_task_name(side) for side in sides) and any(_is_string(side) for side in sides):
                    branches.append(f"{path.relative_to(APPS)}:{node.lineno}")
    assert not branches, branches


def test_the_trainer_neither_probes_tasks_nor_lets_them_assign_its_attributes():
    trainer = ast.parse((APPS / "train" / "trainer.py").read_text())
    probes = [
        node.lineno
        for node in ast.walk(trainer)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr")
    ]
    assert not probes, f"trainer.py probes objects at lines {probes}"
    assignments = []
    for path in [*sorted((APPS / "rlhf").glob("*task*.py")), *sorted((APPS / "diffusion").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(element, ast.Attribute) and getattr(element.value, "id", None) in ("trainer", "ctx"):
                        assignments.append(f"{path.relative_to(APPS)}:{node.lineno}")
    assert not assignments, f"tasks assign the run's attributes: {assignments}"


def test_the_run_config_is_assembled_from_the_registered_tasks():
    import typing

    from colo.apps.train.config import RunConfig
    from colo.apps.train.task import task_specs

    specs = task_specs()
    assert {"pretrain", "sft", "rm", "dpo", "grpo", "ppo", "diffusion"} <= set(specs)
    choices = typing.get_args(RunConfig.model_fields["data"].annotation.model_fields["task"].annotation)
    assert set(choices) == set(specs)
    for spec in specs.values():
        if spec.section is not None:
            assert RunConfig.model_fields[spec.section].annotation is spec.section_type


@pytest.mark.parametrize(
    "preset, overrides, where, message",
    [
        ("tiny-grpo", ["plugin={name: hybrid, tp: 2}", "lora.enabled=true"], "lora.enabled", "set lora.enabled=false"),
        ("tiny-dpo", ["preference.margin=1.0"], "preference.margin", "data.task='dpo' does not read it"),
        ("tiny-llama", ["grpo.beta=0.5"], "config", "grpo.* is read only with data.task='grpo'"),
        ("tiny-llama", ["data.task=sft"], "data.max_tokens", "data.task='sft' reads every conversation"),
        ("tiny-llama", ["data.task=sft", "data.max_tokens=null"], "data.paths", "needs data.paths of chat records"),
        ("tiny-ppo", ["ppo.critic_plugin={name: gemini}"], "ppo.critic_plugin", "name='gemini' cannot hold the critic"),
    ],
)
def test_a_task_rule_is_reported_at_its_field(preset, overrides, where, message):
    from colo.apps.train import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        load_config(preset=preset, overrides=overrides)
    assert f"  {where}: " in str(error.value) and message in str(error.value), str(error.value)


def test_a_name_cannot_be_registered_twice():
    from colo.apps.train.task import TaskSpec, register_task, task_specs

    pretrain = task_specs()["pretrain"]
    register_task(pretrain)  # the same spec again: a no-op
    with pytest.raises(ValueError, match="registered already"):
        register_task(TaskSpec(name="pretrain", summary="another", load=pretrain.load))


def test_the_readme_table_of_refusals_is_the_rule_tables():
    """The colo-apps README's table of what each task refuses is generated from the tasks' rule tables: a rule added,
    removed or reworded without the README (or a README edit the code does not back) fails here."""
    import re

    from colo.apps.train.task import rules_table, task_specs

    readme = (APPS.parents[2] / "README.md").read_text()
    block = re.search(r"<!-- task-rules:begin -->\n(.*?)\n<!-- task-rules:end -->", readme, re.S)
    assert block is not None, "the README lost its task-rules block"
    assert block.group(1) == rules_table(), "regenerate it: colo config --rules"
    assert all(rule.summary for spec in task_specs().values() for rule in spec.rules), "every rule needs a summary"


def test_the_readme_table_of_refused_hybrid_layouts_is_the_plugin_rule_table():
    """The layouts HybridParallel refuses, in the README, are its rule table's: every `UnsupportedLayout` rule has a
    summary, and the README's block is generated from them."""
    import re

    from colo.apps.booster.parallel_dims import UnsupportedLayout
    from colo.apps.booster.plugins.hybrid import _RULES, unsupported_table

    assert all(rule.summary for rule in _RULES if rule.error is UnsupportedLayout), "a refusal needs a summary"
    readme = (APPS.parents[2] / "README.md").read_text()
    block = re.search(r"<!-- hybrid-rules:begin -->\n(.*?)\n<!-- hybrid-rules:end -->", readme, re.S)
    assert block is not None, "the README lost its hybrid-rules block"
    assert block.group(1) == unsupported_table(), "regenerate it: colo config --rules"
