"""CLI-style `section.key=value` overrides of a RunConfig, parsed by tyro.

tyro builds the nested `--section.key` options from the dataclasses in `schema` (Literal fields
become choices); `values` gives the value syntax. Anything tyro refuses becomes a `ConfigError`
naming the key and what it expects, raised from tyro's parse-error hook instead of its exit.

Rows in memory (`data.train_rows`, `data.eval_rows`: Python only, never an override) do not go
through tyro: it would try to build an option from their runtime type (a `datasets.Dataset`
holds a pyarrow Table, which tyro refuses with an exit), so they are set aside and put back.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
import warnings
from collections.abc import Sequence
from typing import Any

import tyro
from tyro import _errors as tyro_errors  # private and experimental: pyproject pins tyro exactly

from titanrl.config.renamed import RENAMED, renamed_message
from titanrl.config.schema import RunConfig
from titanrl.config.values import value_registry
from titanrl.errors import ConfigError


def _registry() -> tyro.constructors.ConstructorRegistry:
    """`values`' primitive rule, and dataclasses whose field docstrings read as one paragraph each.

    tyro keeps a docstring's line breaks wherever the next line starts indented (all of ours
    do), so a wrapped docstring would print as ragged lines; whitespace is collapsed instead.
    """
    from tyro.constructors._struct_spec_dataclass import dataclass_rule  # private: tyro is pinned

    registry = value_registry()

    @registry.struct_rule
    def one_paragraph_docstrings(info: tyro.constructors.StructTypeInfo) -> Any:
        spec = dataclass_rule(info)
        if spec is None:
            return None

        def collapsed(helptext: Any) -> Any:
            return lambda: " ".join(((helptext() if callable(helptext) else helptext) or "").split()) or None

        fields = tuple(dataclasses.replace(f, helptext=collapsed(f.helptext)) for f in spec.fields)
        return dataclasses.replace(spec, fields=fields)

    return registry


IN_MEMORY_ROWS = ("train_rows", "eval_rows")
"""DataConfig fields that hold rows in memory (Python only): kept out of tyro."""


def without_rows(config: RunConfig) -> tuple[RunConfig, dict[str, Any]]:
    """`config` with its in-memory rows (IN_MEMORY_ROWS) set to None, and those rows by field name."""
    rows = {name: getattr(config.data, name) for name in IN_MEMORY_ROWS}
    if all(value is None for value in rows.values()):
        return config, rows
    data = dataclasses.replace(config.data, **dict.fromkeys(IN_MEMORY_ROWS))
    return dataclasses.replace(config, data=data), rows


TYRO_OPTIONS: dict[str, Any] = dict(
    use_underscores=True,  # --train.max_staleness, as the fields are spelled
    config=(tyro.conf.FlagConversionOff,),  # bools take a value (--output.tensorboard=false), not --no-...
    registry=_registry(),
)
"""How every titanrl tyro call reads the config (overrides and help alike)."""


def apply_overrides(config: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """Applies `section.key=value` strings (leading dashes allowed) to a copy of `config`.

    A value is parsed by its field's annotation (see `titanrl.config.values`): int, float, str;
    a Literal field one of its choices; bool as true/false, yes/no, on/off or 1/0; `X | None`
    fields take none/null for None; tuples and lists take comma-separated items
    (`train.optimizer.betas=0.9,0.95`, `rewards=pkg.mod:fn,pkg.mod:fn2`); a callable field (`rewards`,
    `env.factory`) keeps the text, a 'module:function' string that `validate` imports.
    """
    args = []
    for raw in overrides:
        item = raw.lstrip("-")
        if "=" not in item:
            raise ConfigError(f"override {raw!r} must look like --section.key=value")
        if (key := item.split("=", 1)[0]) in RENAMED:
            raise ConfigError(renamed_message(key))
        args.append(f"--{item}")

    def refuse(event: tyro_errors.ParseErrorEvent) -> None:
        raise ConfigError(_explain(event, args))

    bare, rows = without_rows(config)
    with tyro_errors.on_parse_error(refuse), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a mistyped value in CONFIG.py: validate names it
        # tyro builds every section anew from `config`'s values: the input is never touched.
        parsed = tyro.cli(RunConfig, default=bare, args=args, console_outputs=False, add_help=False, **TYRO_OPTIONS)
    kept = {name: value for name, value in rows.items() if value is not None and getattr(parsed.data, name) is None}
    return dataclasses.replace(parsed, data=dataclasses.replace(parsed.data, **kept)) if kept else parsed


def _key(argument: Any) -> str:
    """The dotted key of a tyro argument ('--train.optimizer.lr' -> 'train.optimizer.lr')."""
    return argument.lowered.name_or_flags[0].lstrip("-")


def _explain(event: tyro_errors.ParseErrorEvent, args: list[str]) -> str:
    """The ConfigError message for a tyro parse failure."""
    if isinstance(event, tyro_errors.InstantiationFailure) and event.argument is not None:
        return f"{_key(event.argument)}={event.message}"  # values.parse's "'x' is not a valid float ..."
    if isinstance(event, tyro_errors.InvalidChoice):
        return f"{_key(event.argument)}={event.value!r} is not one of {', '.join(map(repr, event.choices))}"
    if isinstance(event, tyro_errors.UnrecognizedArgs):
        keys = [t.lstrip("-").split("=", 1)[0] for t in event.tokens if t.startswith("--")]
        return _unknown_key(keys[0]) if keys else f"unexpected value(s) {' '.join(event.tokens)!r} in overrides"
    return f"overrides {' '.join(args)!r} cannot be applied ({type(event).__name__})"


def _unknown_key(dotted: str) -> str:
    """Why `dotted` is not a settable key: a missing field (with a close match), a section, or a value."""
    cls: Any = RunConfig
    parts = dotted.split(".")
    for depth, name in enumerate(parts):
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if name not in names:
            where = ".".join(parts[:depth]) or "the config"
            close = _closest_key(dotted)
            hint = f"; did you mean {close!r}?" if close else ""
            return f"unknown config key {dotted!r}: {where} has no field {name!r}{hint}"
        cls = hints[name]
        if depth == len(parts) - 1 and dataclasses.is_dataclass(cls):
            first = dataclasses.fields(cls)[0].name
            return f"{dotted!r} is a section, not a value: set its fields one by one, e.g. --{dotted}.{first}=..."
        if depth < len(parts) - 1 and not dataclasses.is_dataclass(cls):
            return f"unknown config key {dotted!r}: {'.'.join(parts[: depth + 1])} is not a section"
    return f"config key {dotted!r} cannot be set from the command line"


def _leaf_keys(cls: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key under the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _closest_key(dotted: str) -> str | None:
    """The settable key `dotted` most likely meant: a close spelling of a key (an old flat name counts
    as its new one), else a close field name anywhere under the same top-level section."""
    keys = _leaf_keys(RunConfig)
    close = difflib.get_close_matches(dotted, keys + list(RENAMED), n=1, cutoff=0.75)
    if close:
        return RENAMED.get(close[0], close[0])
    head, leaf = dotted.split(".", 1)[0], dotted.rsplit(".", 1)[-1]
    under = {key.rsplit(".", 1)[-1]: key for key in keys if key.startswith(head + ".")}
    close = difflib.get_close_matches(leaf, list(under), n=1)
    return under[close[0]] if close else None
