"""Merging section values into a config, for test helpers that take section overrides.

A helper that builds `TrainConfig(compute=ComputeConfig(device="cpu"))` and is called with
`compute=ComputeConfig(compile=True)` should get both settings: `merged` lays the fields a section
value sets (those that differ from its class's defaults) over the base's section. A value equal to
its default therefore cannot undo a base's setting: pass another value, or build the config whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

Config = TypeVar("Config")


def merged(base: Config, **overrides: Any) -> Config:
    """`base` with `overrides`: a dataclass value changes only its non-default fields of `base`'s
    section (recursively); any other value replaces the field."""
    changes = {}
    for name, value in overrides.items():
        current = getattr(base, name)
        if dataclasses.is_dataclass(value) and dataclasses.is_dataclass(current):
            default = type(value)()
            set_fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                          if getattr(value, f.name) != getattr(default, f.name)}
            changes[name] = merged(current, **set_fields)
        else:
            changes[name] = value
    return dataclasses.replace(base, **changes)
