"""CLI-style `section.key=value` overrides of a RunConfig, parsed by each field's annotation.

A key or value that does not fit raises `ConfigError` naming the key and what it expects.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from titanrl.config.schema import RunConfig
from titanrl.errors import ConfigError


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Applies `section.key=value` strings (leading dashes allowed) to a copy of `config`.

    A value is parsed by its field's annotation: int, float, str; bool as true/false, yes/no,
    on/off or 1/0; `X | None` and `Any` fields take none/null for None; tuples and lists take
    comma-separated items (`train.betas=0.9,0.95`, `rewards=pkg.mod:fn,pkg.mod:fn2`); an `Any`
    field otherwise keeps the text (a 'module:function' string that `validate` imports).
    """
    config = _copy_sections(config)
    for raw in overrides:
        item = raw.lstrip("-")
        if "=" not in item:
            raise ConfigError(f"override {raw!r} must look like --section.key=value")
        dotted, text = item.split("=", 1)
        parent, leaf, hint = _resolve(config, dotted)
        setattr(parent, leaf, _parse_value(text, hint, dotted))
    return config


def _copy_sections(obj: Any) -> Any:
    """A copy of a config whose sections (nested ones too) are copies: overrides never touch the input."""
    obj = dataclasses.replace(obj)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            setattr(obj, f.name, _copy_sections(value))
    return obj


def _resolve(config: Any, dotted: str) -> tuple[Any, str, Any]:
    """The object holding `dotted`'s field, the field's name and its type annotation."""
    obj: Any = config
    parts = dotted.split(".")
    for depth, name in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        if name not in names:
            where = ".".join(parts[:depth]) or "the config"
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {'.'.join(parts[:depth] + close)!r}?" if close else ""
            raise ConfigError(f"unknown config key {dotted!r}: {where} has no field {name!r}{hint}")
        value = getattr(obj, name)
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(value):
                first = dataclasses.fields(value)[0].name
                raise ConfigError(
                    f"{dotted!r} is a section, not a value: set its fields one by one, e.g. --{dotted}.{first}=..."
                )
            return obj, name, typing.get_type_hints(type(obj))[name]
        obj = value
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(parts[: depth + 1])} is not a section")
    raise AssertionError("unreachable")


_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class _Unparsable(ValueError):
    """A command-line value does not fit its field's type."""


def _parse_value(text: str, hint: Any, dotted: str) -> Any:
    """Parses `text` as a value of `hint`; a ConfigError names the key and the expected type."""
    try:
        return _parse(text.strip(), hint)
    except _Unparsable:
        raise ConfigError(f"{dotted}={text!r} is not a valid {_expected(hint)}") from None


def _parse(text: str, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None if text.lower() in _NONE_WORDS else text
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in _NONE_WORDS:
            return None
        for option in args:
            if option is not type(None):
                try:
                    return _parse(text, option)
                except _Unparsable:
                    pass
        raise _Unparsable(text)
    if hint is bool:
        if text.lower() in _TRUE_WORDS:
            return True
        if text.lower() in _FALSE_WORDS:
            return False
        raise _Unparsable(text)
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise _Unparsable(text) from None
    if hint is str:
        return text
    if origin in (tuple, list):
        items = _split_items(text)
        if origin is list:
            item_hint = args[0] if args else Any
            # An item 'none' stays a string: a list has no use for None entries.
            return [item if item_hint is Any else _parse(item, item_hint) for item in items]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse(item, args[0]) for item in items)
        if len(items) != len(args):
            raise _Unparsable(text)
        return tuple(_parse(item, a) for item, a in zip(items, args, strict=True))
    raise _Unparsable(text)


def _split_items(text: str) -> list[str]:
    """'a,b', '(a, b)' and '[a,b]' all give ['a', 'b']; '' and '[]' give []."""
    if text[:1] + text[-1:] in ("()", "[]"):
        text = text[1:-1]
    return [item.strip() for item in text.split(",") if item.strip()]


def _expected(hint: Any) -> str:
    """What a command-line value of `hint` looks like, for error messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "value ('package.module:function', or none)"
    if origin in (typing.Union, types.UnionType):
        options = [_expected(a) for a in args if a is not type(None)]
        return " or ".join(options + (["none"] if type(None) in args else []))
    if hint is bool:
        return "bool (true/false, yes/no, on/off, 1/0)"
    if hint is int:
        return "int (like 8)"
    if hint is float:
        return "float (like 0.5 or 3e-4)"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"comma-separated list of {type_name(args[0])}"
        example = ",".join("0.9" if a is float else "1" if a is int else "x" for a in args)
        return f"tuple of {len(args)} comma-separated values ({', '.join(map(type_name, args))}; like {example})"
    if origin is list:
        return "comma-separated list"
    return f"{type_name(hint)} (it cannot be set from the command line; set it in the config file)"


def type_name(hint: Any) -> str:
    """How a type annotation reads in messages: 'int', 'float | None', 'tuple[float, float]'."""
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
