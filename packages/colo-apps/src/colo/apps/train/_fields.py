"""Pydantic fields derived from colo's keyword-only config dataclasses (plugins, `LlamaConfig`).

The dataclasses document each field with an attribute docstring (the string under the field); this module reads
those docstrings with `ast` and turns the dataclass fields into pydantic field definitions, so the run config,
``colo train --help`` and ``colo config --schema`` describe every plugin and model field without a second copy
that could drift from the code it configures.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import cache

from pydantic import Field


@cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """``{field name: its attribute docstring}`` for ``cls`` and its dataclass bases (base first, subclass wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (a frozen app): fields stay described by name only
            continue
        body = ast.parse(source).body[0].body
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def dataclass_fields(
    cls: type, *, exclude: tuple[str, ...] = (), optional: bool = False
) -> dict[str, tuple[object, object]]:
    """Pydantic field definitions (``create_model`` style) for the init fields of dataclass ``cls``.

    Args:
        cls: a dataclass whose fields carry attribute docstrings.
        exclude: field names to leave out (set by the run config elsewhere).
        optional: make every field ``T | None`` with default ``None`` ("keep the preset's value").

    Returns:
        ``{name: (annotation, FieldInfo)}`` with the dataclass default and the docstring as the description.
    """
    hints = typing.get_type_hints(cls)
    docs = attribute_docstrings(cls)
    result: dict[str, tuple[object, object]] = {}
    for field in dataclasses.fields(cls):
        if not field.init or field.name in exclude or field.name.startswith("_"):
            continue
        description = docs.get(field.name, field.name.replace("_", " "))
        annotation = hints[field.name]
        if optional:
            result[field.name] = (
                annotation | None,
                Field(default=None, description=f"{description} Unset: the preset's value."),
            )
        elif field.default is not dataclasses.MISSING:
            result[field.name] = (annotation, Field(default=field.default, description=description))
        elif field.default_factory is not dataclasses.MISSING:
            result[field.name] = (annotation, Field(default_factory=field.default_factory, description=description))
        else:
            result[field.name] = (annotation, Field(description=description))
    return result
