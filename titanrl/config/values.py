"""How a config value reads on the command line, as a tyro primitive rule.

tyro parses the keys, the nesting, `--k=v` and `--k v`, Literal choices and the help; this rule
keeps the value syntax users write today where it differs from tyro's own (`True`/`False`,
`None`, space-separated tuples): bools as true/false, yes/no, on/off or 1/0; none/null for
`X | None` fields; comma-separated tuples and lists (`0.9,0.95`, `(0.9, 0.95)`, `[a,b]`, and
tyro's space-separated form); 'module:function' text for callable fields (`rewards`,
`env.factory`: imported by `validate`). `check_type` and `type_name` are shared with `validation`.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # tyro is imported only where a parser is built: `validate` does not need it
    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class _Unparsable(ValueError):
    """A command-line value does not fit its field's type."""


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _text_options(args: tuple[Any, ...]) -> list[Any]:
    """A union's options as text describes them: `Callable | str` is one ('module:function')."""
    options = [a for a in args if a is not type(None)]
    if any(typing.get_origin(a) is collections.abc.Callable for a in options):
        options = [a for a in options if a is not str]
    return options


def parse(text: str, hint: Any) -> Any:
    """`text` as a value of `hint`; ValueError saying what the value should look like."""
    try:
        return _parse(text.strip(), hint)
    except _Unparsable:
        raise ValueError(f"{text!r} is not a valid {expected(hint)}") from None


def _parse(text: str, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None if text.lower() in NONE_WORDS else text
    if hint is type(None):
        if text.lower() in NONE_WORDS:
            return None
        raise _Unparsable(text)
    if _is_union(hint):
        if type(None) in args and text.lower() in NONE_WORDS:
            return None
        for option in args:
            if option is not type(None):
                try:
                    return _parse(text, option)
                except _Unparsable:
                    pass
        raise _Unparsable(text)
    if origin is Literal:
        for choice in args:
            if text == str(choice):
                return choice
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
    if hint is str or origin is collections.abc.Callable:  # a callable: 'module:function', imported by validate
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


def expected(hint: Any) -> str:
    """What a command-line value of `hint` looks like, for error messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "value ('package.module:function', or none)"
    if origin is collections.abc.Callable:
        return "'package.module:function'"
    if _is_union(hint):
        return " or ".join([*map(expected, _text_options(args)), *(["none"] if type(None) in args else [])])
    if origin is Literal:
        return f"choice ({type_name(hint)})"
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
    return type_name(hint)


def type_name(hint: Any) -> str:
    """How a type annotation reads in messages: 'int', 'float | None', "'cpu' or 'cuda'"."""
    if typing.get_origin(hint) is Literal:
        choices = [repr(c) for c in typing.get_args(hint)]
        return " or ".join([", ".join(choices[:-1]), choices[-1]] if len(choices) > 1 else choices)
    if typing.get_origin(hint) is collections.abc.Callable:
        return "callable"
    if _is_union(hint):
        return " | ".join(map(type_name, typing.get_args(hint)))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_type(value: Any, hint: Any) -> bool:
    """Whether `value` (set in Python, not parsed) is a `hint`; bool is not an int here."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if _is_union(hint):
        return any(check_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return any(type(value) is type(c) and value == c for c in args)
    if origin is collections.abc.Callable:
        return True  # resolve_reward / resolve_env_factory check it, naming the signature it needs
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(check_type, value, args))
    if origin is list:
        return isinstance(value, list)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def show(value: Any) -> str:
    """`value` as a user writes it on the command line (help defaults): 'true', 'none', '0.9,0.99'."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(map(show, value))
    if callable(value) and hasattr(value, "__qualname__"):  # a reward or env factory object
        return f"{getattr(value, '__module__', '?')}:{value.__qualname__}"
    return str(value)


def _metavar(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or typing.get_origin(hint) is collections.abc.Callable:
        return "MODULE:FUNCTION"
    if _is_union(hint):
        return "|".join([*map(_metavar, _text_options(args)), *(["none"] if type(None) in args else [])])
    if hint is bool:
        return "{true,false}"
    if origin is tuple:
        return ",".join(_metavar(a) for a in args if a is not Ellipsis)
    if origin is list:
        return "A,B,..."
    return getattr(hint, "__name__", str(hint)).upper()


def _handled(hint: Any) -> bool:
    """Types whose text form is ours; str and bare Literal keep tyro's own (Literal: its choices)."""
    return (
        hint in (Any, bool, int, float, type(None))
        or _is_union(hint)
        or typing.get_origin(hint) in (tuple, list)
    )


def _spec(hint: Any) -> PrimitiveConstructorSpec:
    from tyro.constructors import PrimitiveConstructorSpec

    sequence = typing.get_origin(hint) in (tuple, list)
    instance_from_str: Callable[[list[str]], Any] = lambda args: parse(",".join(args) if sequence else args[0], hint)
    return PrimitiveConstructorSpec(
        # A sequence takes `--k=a,b` (one token) as well as tyro's `--k a b`.
        nargs="*" if sequence else 1,
        metavar=_metavar(hint),
        instance_from_str=instance_from_str,
        is_instance=lambda value: check_type(value, hint),
        str_from_instance=lambda value: [show(value)],
    )


def value_registry() -> ConstructorRegistry:
    """A tyro registry whose primitive rule parses config values as described above."""
    from tyro.constructors import ConstructorRegistry

    registry = ConstructorRegistry()

    @registry.primitive_rule
    def titanrl_values(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
        return _spec(info.type) if _handled(info.type) else None

    return registry
