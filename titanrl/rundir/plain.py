"""Dataclasses to plain data and back, so run state on disk names no Python class.

`to_plain` turns a dataclass (and whatever it holds) into dicts, lists, strings, numbers,
None and tensors: what `torch.load(weights_only=True)` reads, and what stays readable when
the classes move or gain fields. `from_plain(cls, data)` rebuilds it from the field types
(`list[Group]`, `tuple[Request, list[RolloutBatch]]`, `Group | None`, ...); fields typed `Any`
(dataset rows, stream positions) are taken as they are, after `to_plain` checked they are plain.
A field typed `np.ndarray` (`Sample.routed_experts`) is stored as a tensor of its dtype (compact,
where a list would cost a Python object per element) and comes back as an array.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import numpy as np
import torch

_LEAVES = (str, int, float, bool, type(None), torch.Tensor)


def to_plain(value: Any, where: str = "state") -> Any:
    """`value` as plain data; a dataclass becomes a dict of its fields. `where` names the value
    in the error raised for anything that cannot be stored plainly (a Ray object ref, a lock...)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        arrays = _array_fields(type(value))
        return {f.name: _array_to_plain(getattr(value, f.name)) if f.name in arrays
                else to_plain(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, bool) or value is None or type(value) in (str, int, float) or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} ({type(k).__name__}) cannot be stored as plain data")
            out[k] = to_plain(v, f"{where}[{k!r}]")
        return out
    for kind in (str, int, float):  # subclasses (numpy's float64, an IntEnum): their plain value
        if isinstance(value, kind):
            return kind(value)
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # numpy scalars and arrays
        return to_plain(value.tolist(), where)
    raise TypeError(f"{where}: {type(value).__qualname__} cannot be stored as plain data")


def from_plain(cls: Any, data: Any, where: str = "state") -> Any:
    """Rebuilds a value of type `cls` (a dataclass, or a container type of them) from `to_plain`'s output.

    A key `cls` does not know is an error (the state was written by another version); a field
    missing from `data` takes its default.
    """
    if cls is Any or cls in _LEAVES or cls is object:
        return data
    if cls is np.ndarray:
        return data.numpy() if isinstance(data, torch.Tensor) else np.asarray(_expect(data, (list, tuple), where))
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:
            return from_plain(others[0], data, where)
        return data  # a union of leaves (`int | float`): already plain
    if origin is list:
        (item,) = args or (Any,)
        return [from_plain(item, v, f"{where}[{i}]") for i, v in enumerate(_expect(data, (list, tuple), where))]
    if origin is tuple:
        data = _expect(data, (list, tuple), where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_plain(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise ValueError(f"{where}: expected {len(args)} items, found {len(data)}")
        return tuple(from_plain(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin is dict:
        value_type = args[1] if args else Any
        return {k: from_plain(value_type, v, f"{where}[{k!r}]") for k, v in _expect(data, dict, where).items()}
    if dataclasses.is_dataclass(cls):
        data = _expect(data, dict, where)
        hints = _field_types(cls)
        unknown = set(data) - set(hints)
        if unknown:
            raise ValueError(f"{where}: {cls.__qualname__} has no field(s) {sorted(unknown)}")
        return cls(**{name: from_plain(hints[name], v, f"{where}.{name}") for name, v in data.items()})
    return data


def _array_to_plain(value: Any) -> Any:
    return torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value


@functools.cache
def _array_fields(cls: type) -> frozenset[str]:
    """The fields of dataclass `cls` typed `np.ndarray` (or `np.ndarray | None`)."""
    return frozenset(name for name, tp in _field_types(cls).items()
                     if tp is np.ndarray or np.ndarray in typing.get_args(tp))


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The init fields of dataclass `cls` and their resolved types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _expect(data: Any, kinds: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, kinds):
        raise ValueError(f"{where}: expected {kinds}, found {type(data).__name__}")
    return data
