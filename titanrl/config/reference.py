"""docs/config-reference.md, generated from the config dataclasses' field docstrings.

    python -m titanrl.config.reference > docs/config-reference.md

Walks RunConfig and its nested dataclass sections (config/schema.py) and writes, section by
section, each field's command-line name, type, default and docstring. The docstrings come from
tyro's reader (the one `titanrl train --help` uses); types and defaults are written as
`config.values` writes them in messages and help. tests/test_config_reference.py fails when the
committed page differs from this output.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from titanrl.config.overrides import IN_MEMORY_ROWS
from titanrl.config.renamed import RENAMED
from titanrl.config.schema import RunConfig
from titanrl.config.values import show, type_name

COMMAND = "python -m titanrl.config.reference > docs/config-reference.md"
"""How the page is regenerated (printed in its header and in the staleness test's message)."""


def _docstring(cls: type, name: str) -> str:
    """Field `name`'s docstring in `cls`, as one markdown paragraph ('' when it has none)."""
    from tyro._docstrings import get_field_docstring  # private: pyproject pins tyro exactly

    return _markdown(" ".join((get_field_docstring(cls, name, ()) or "").split()))


def _markdown(text: str) -> str:
    """`text` with '<' escaped outside `code` spans, so 'reward/<name>/mean' is not read as a tag."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("<", "\\<") for i, part in enumerate(parts))


def _sections(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, list[dataclasses.Field]]]:
    """(dotted section name, its default instance, its non-section fields) of `obj` and of every
    dataclass nested in it, depth first; the top level's name is ''."""
    fields = dataclasses.fields(obj)
    yield prefix, obj, [f for f in fields if not dataclasses.is_dataclass(getattr(obj, f.name))]
    for f in fields:
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{prefix}{f.name}.")


def _type_text(hint: Any) -> str:
    """`hint` as the page writes it: choices and unions joined by ' | ', None, tuples and lists
    spelled out, anything else as `config.values.type_name` writes it in messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(map(_type_text, args))
    if origin in (tuple, list) and args:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_text(a) for a in args)}]"
    return type_name(hint)


def _default_text(name: str, default: Any) -> str:
    """`default` as a user writes it on the command line ('""' and '[]' for empty ones)."""
    if name in IN_MEMORY_ROWS:
        return repr(default)
    if default == "":
        return '""'
    if isinstance(default, list) and not default:
        return "[]"
    return show(default)


def _field_line(section: str, cls: type, hints: dict[str, Any], f: dataclasses.Field, default: Any) -> str:
    """One field as a markdown list item: name, type and default, then its docstring."""
    name = f"{section}{f.name}"
    cli = f"`--{name}`" if f.name not in IN_MEMORY_ROWS else f"`{name}` (Python only, not a CLI option)"
    doc = _docstring(cls, f.name) or "(no docstring)"
    return f"- {cli} · `{_type_text(hints[f.name])}` · default `{_default_text(f.name, default)}`\n  {doc}"


def config_reference_markdown() -> str:
    """The whole page: every section of RunConfig() with each field's CLI name, type, default and docstring."""
    out = [
        "# Config reference",
        "",
        "Every field of `titanrl.RunConfig` (titanrl/config/schema.py), section by section: the command-line",
        "name (`titanrl train CONFIG.py --section.key=value`; in Python, the same attribute path), the type,",
        "the default and the field's docstring. `titanrl train --help` shows the same, with CONFIG.py's",
        "values as the defaults. Generated; do not edit by hand:",
        "",
        f"    {COMMAND}",
        "",
    ]
    for section, obj, fields in _sections(RunConfig()):
        cls = type(obj)
        title = section.rstrip(".") or "top level"
        out += [f"## {title} (`{cls.__name__}`)", ""]
        if doc := _markdown(" ".join((inspect.getdoc(cls) or "").split())):
            out += [doc, ""]
        hints = typing.get_type_hints(cls)
        out += [_field_line(section, cls, hints, f, getattr(obj, f.name)) for f in fields]
        out.append("")
    out += ["## Renamed keys", "",
            "Flat names from before the config had sections; each is refused with its new key "
            "(`titanrl.config.renamed`).", "", "| old key | new key |", "|---|---|"]
    out += [f"| `{old}` | `{new}` |" for old, new in RENAMED.items()]
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(config_reference_markdown(), end="")
