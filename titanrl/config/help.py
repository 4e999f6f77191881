"""Every RunConfig field with its type, default and docstring, for `titanrl train --help`.

Field docstrings are the string literal written after each dataclass field in config/schema.py;
Python keeps no trace of them at run time, so they are read from the source with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from titanrl.config import schema as config_module
from titanrl.config.schema import RunConfig


@dataclass(frozen=True)
class FieldHelp:
    """One settable config value as the command line sees it."""

    key: str
    """Dotted override key: 'train.lr', or 'seed' for a top-level field."""
    type: str
    """The annotation as written in config/schema.py ('float | None', 'tuple[float, float]')."""
    default: Any
    """The dataclass default (default_factory called)."""
    doc: str
    """The field's docstring, whitespace collapsed; '' when it has none."""


@functools.cache
def _class_docs() -> dict[str, dict[str, str]]:
    """{class name: {field name: docstring}} for every class in config/schema.py ({} without its source)."""
    try:
        tree = ast.parse(inspect.getsource(config_module))
    except (OSError, TypeError):  # installed without .py sources: help shows types and defaults only
        return {}
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for stmt, after in zip(node.body, [*node.body[1:], None]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                fields[stmt.target.id] = " ".join(after.value.value.split())
        docs[node.name] = fields
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _help(key: str, cls: type, f: dataclasses.Field) -> FieldHelp:
    # config/schema.py has `from __future__ import annotations`: f.type is the annotation as written.
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return FieldHelp(key, annotation, _default(f), _class_docs().get(cls.__name__, {}).get(f.name, ""))


def _leaves(prefix: str, cls: type) -> list[FieldHelp]:
    """The settable fields of section `cls`, nested sections flattened ('train.parallel.tp')."""
    out = []
    for f in dataclasses.fields(cls):
        item = _help(f"{prefix}.{f.name}", cls, f)
        out += _leaves(item.key, type(item.default)) if dataclasses.is_dataclass(item.default) else [item]
    return out


def config_fields() -> list[tuple[str, str, list[FieldHelp]]]:
    """(section key, section docstring, its fields) in RunConfig order; top-level fields last, key ''."""
    sections: list[tuple[str, str, list[FieldHelp]]] = []
    top: list[FieldHelp] = []
    for f in dataclasses.fields(RunConfig):
        item = _help(f.name, RunConfig, f)
        if dataclasses.is_dataclass(item.default):
            cls = type(item.default)
            sections.append((f.name, item.doc, _leaves(f.name, cls)))
        else:
            top.append(item)
    return [*sections, ("", "Run-wide settings.", top)]


def _show_default(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, list):
        return ",".join(map(str, value)) or "(empty)"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else str(value)


@functools.cache
def config_help(width: int = 100) -> str:
    """The help text: one block per field, `--key  TYPE  (default ...)` and its docstring wrapped."""
    lines = [
        "config overrides (--section.key=value, applied on top of CONFIG.py):",
        *textwrap.wrap(
            "bools take true/false (yes/no, on/off, 1/0); 'X | None' and Any fields take none or null; "
            "tuples and lists take comma-separated items: --train.betas=0.9,0.95, "
            "--rewards=pkg.mod:fn,pkg.mod:fn2, --env.factory=pkg.mod:make_env.",
            width=width, initial_indent="  ", subsequent_indent="  ",
        ),
    ]
    for section, section_doc, items in config_fields():
        lines += ["", f"{section or 'top level'}: {section_doc}"]
        for item in items:
            lines.append(f"  --{item.key}  {item.type}  (default: {_show_default(item.default)})")
            lines += textwrap.wrap(item.doc, width=width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
