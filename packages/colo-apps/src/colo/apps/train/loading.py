"""Reading a `RunConfig`: YAML / TOML files, named run presets and ``--set a.b=c`` overrides, with errors that
name the field."""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError

from .config import run_config_class
from .plugin_config import PLUGIN_NAMES

if TYPE_CHECKING:
    from .config import RunConfig
from .presets import RUN_PRESETS


class ConfigError(ValueError):
    """A run config that does not validate; the message names every offending field and what to change."""


def read_config_file(path: str | os.PathLike) -> dict:
    """The raw mapping of a YAML (``.yaml``/``.yml``) or TOML (``.toml``) run-config file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    suffix = os.path.splitext(path)[1].lower()
    with open(path, "rb") as file:
        if suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - python 3.10
                import tomli as tomllib
            try:
                data = tomllib.load(file)
            except tomllib.TOMLDecodeError as error:
                raise ConfigError(f"{path}: invalid TOML: {error}") from None
        elif suffix in (".yaml", ".yml"):
            try:
                data = yaml.safe_load(file) or {}
            except yaml.YAMLError as error:
                raise ConfigError(f"{path}: invalid YAML: {error}") from None
        else:
            raise ConfigError(f"config file {path!r}: unknown extension {suffix!r}; use .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], object]:
    """``"optimizer.lr=1e-3"`` -> ``(["optimizer", "lr"], 0.001)``; the value is parsed as YAML (numbers, booleans,
    ``null``, lists), and a value YAML cannot parse stays a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. --set optimizer.lr=1e-3")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        value = _number_or_text(value)
    return key.split("."), value


def _number_or_text(value: str) -> object:
    try:  # YAML 1.1 reads "3e-4" as a string
        return float(value) if any(c in value for c in ".eE") else int(value)
    except ValueError:
        return value


def apply_overrides(data: Mapping, overrides: Iterable[str]) -> dict:
    """A copy of the raw config ``data`` with every ``KEY=VALUE`` of ``overrides`` applied, in order.

    Setting ``plugin.name`` switches plugins: the fields the new plugin does not have are dropped.
    """
    result = copy.deepcopy(dict(data))
    for text in overrides:
        path, value = parse_override(text)
        node = result
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise ConfigError(f"--set {text!r}: {where} is a value ({child!r}), not a section")
            node = child
        if path == ["plugin", "name"] and node.get("name", value) != value:
            _switch_plugin(node, value)
        node[path[-1]] = value
    return result


def _switch_plugin(section: dict, name: object) -> None:
    from .plugin_config import DDPSection, ExpertSection, GeminiSection, HybridSection, ZeroSection

    sections = dict(zip(PLUGIN_NAMES, (DDPSection, ZeroSection, GeminiSection, HybridSection, ExpertSection)))
    if name not in sections:
        return  # validation reports the unknown name
    allowed = set(sections[name].model_fields)
    for key in [key for key in section if key not in allowed]:
        del section[key]


def format_validation_error(error: ValidationError) -> str:
    """One line per problem: ``field.path: message (got value)``."""
    lines = []
    for problem in error.errors():
        location = ".".join(str(part) for part in problem["loc"]) or "config"
        message = problem["msg"].removeprefix("Value error, ")
        field = re.match(r"([a-z_]+(?:\.[a-z_]+)*): ", message)
        if location == "config" and field:  # a task's rule (TaskRule) names its field: report it there
            location, message = field.group(1), message[field.end() :]
        if problem["type"] == "extra_forbidden":
            parent = location.rpartition(".")[0]
            message = f"unknown field; see `colo config --schema` for the fields of {parent or 'the config'}"
        elif problem["type"] == "union_tag_invalid":
            message = f"unknown plugin name; use one of {list(PLUGIN_NAMES)}"
        got = problem.get("input")
        shown = "" if isinstance(got, (dict, list)) or problem["type"] == "missing" else f" (got {got!r})"
        lines.append(f"  {location}: {message}{shown}")
    return "invalid run config:\n" + "\n".join(lines)


def validate_config(data: Mapping) -> RunConfig:
    """Validate a raw mapping into a `RunConfig`; a `ConfigError` naming each bad field otherwise."""
    data = dict(data)
    if isinstance(data.get("plugin"), Mapping) and "name" not in data["plugin"]:  # the default plugin, DDP
        data["plugin"] = {"name": "ddp", **data["plugin"]}
    try:
        return run_config_class().model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def load_config(
    path: str | os.PathLike | None = None, *, preset: str | None = None, overrides: Iterable[str] = ()
) -> RunConfig:
    """The run config from a file or a named preset (or the defaults), with ``--set`` overrides applied.

    Args:
        path: a ``.yaml`` / ``.yml`` / ``.toml`` file.
        preset: a name of `RUN_PRESETS` (``tiny-llama``, ``llama-1b``, ``llama-7b``, ``llama-70b``).
        overrides: ``"a.b=c"`` strings applied after the file or preset.

    Raises:
        ConfigError: unreadable file, unknown preset, bad override or a field that does not validate.
    """
    if path is not None and preset is not None:
        raise ConfigError("give a config file or --preset, not both")
    if preset is not None:
        if preset not in RUN_PRESETS:
            raise ConfigError(f"unknown run preset {preset!r}; choose one of {sorted(RUN_PRESETS)}")
        data = RUN_PRESETS[preset]
    elif path is not None:
        data = read_config_file(path)
    else:
        data = {}
    return validate_config(apply_overrides(data, overrides))
