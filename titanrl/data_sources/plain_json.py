"""Python values as JSON text and back, exactly: tuples, sets and non-string dict keys survive.

Generated rows carry task state (a generator's metadata, its config) to the reward as JSON
strings, so every row has the same flat schema through `datasets`/Arrow and JSON lines. Plain
JSON would turn a tuple into a list, and some checkers compare tuples (reasoning-gym's ARC
grids), so those are tagged: `{"__tuple__": [...]}`, `{"__set__": [...]}`,
`{"__frozenset__": [...]}`, and a dict whose keys are not all strings (or whose one key is a
tag) becomes `{"__dict__": [[key, value], ...]}`. Scalars JSON has no type for are tagged too:
`{"__fraction__": "3/4"}`, `{"__decimal__": "1.50"}`, `{"__complex__": [re, im]}`,
`{"__datetime__" | "__date__" | "__time__": isoformat}`, `{"__timedelta__": [days, s, us]}`,
`{"__float__": "inf"}` (and "-inf", "nan"). Set elements are written in a fixed order, so the
same value always gives the same text (whatever the process's hash seed). numpy scalars and
arrays become Python numbers and lists. Any other type is refused, naming where it was.
"""

from __future__ import annotations

import datetime
import decimal
import fractions
import json
import math
from typing import Any

SCALARS = {"__fraction__": fractions.Fraction, "__decimal__": decimal.Decimal, "__datetime__": datetime.datetime,
           "__date__": datetime.date, "__time__": datetime.time}
"""Tagged scalar types, written as `str()` (fractions, decimals) or `isoformat()` (dates and times)."""
TAGS = ("__tuple__", "__set__", "__frozenset__", "__dict__", "__complex__", "__timedelta__", "__float__", *SCALARS)
"""The one-key objects that stand for a value JSON has no type for."""


def encode(value: Any, where: str = "value") -> Any:
    """`value` as JSON-safe data (dicts, lists, str, numbers, bools, None) with tagged containers;
    TypeError names the path (`where`) of a value of another type."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, (set, frozenset)):
        items = sorted((encode(v, f"{where} element") for v in value), key=lambda v: json.dumps(v, sort_keys=True))
        return {"__frozenset__" if isinstance(value, frozenset) else "__set__": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in TAGS):
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"__dict__": [[encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, complex):
        return {"__complex__": [encode(value.real, where), encode(value.imag, where)]}
    for tag, cls in SCALARS.items():
        if type(value) is cls:
            return {tag: str(value) if tag in ("__fraction__", "__decimal__") else value.isoformat()}
    if isinstance(value, datetime.timedelta):
        return {"__timedelta__": [value.days, value.seconds, value.microseconds]}
    if type(value).__module__ == "numpy":
        return encode(value.tolist(), where)  # numpy scalars' tolist() is the Python number
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which has no JSON form")


def decode(data: Any) -> Any:
    """The value `encode` was given (numpy values come back as Python numbers and lists)."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            (tag, items), = data.items()
            if tag == "__tuple__":
                return tuple(decode(v) for v in items)
            if tag == "__set__":
                return {decode(v) for v in items}
            if tag == "__frozenset__":
                return frozenset(decode(v) for v in items)
            if tag == "__dict__":
                return {decode(k): decode(v) for k, v in items}
            if tag == "__float__":
                return float(items)
            if tag == "__complex__":
                return complex(*items)
            if tag == "__timedelta__":
                return datetime.timedelta(*items)
            if tag in ("__fraction__", "__decimal__"):
                return SCALARS[tag](items)
            if tag in SCALARS:
                return SCALARS[tag].fromisoformat(items)
        return {k: decode(v) for k, v in data.items()}
    return data


def dumps(value: Any, where: str = "value") -> str:
    """`value` as JSON text (see `encode`)."""
    return json.dumps(encode(value, where), ensure_ascii=False, allow_nan=False)


def loads(text: str) -> Any:
    """The value `dumps` wrote."""
    return decode(json.loads(text))
