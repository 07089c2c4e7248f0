"""The per-key specs of the configuration, derived from its sections'
dataclasses (:mod:`dino_opt.config.fields`): each key's kind (what its
values are parsed and checked as), attribute, whether it may be null, its
metadata (help, bounds, choices) and default."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from .fields import _SECTIONS

__all__: list[str] = []


@dataclass(frozen=True)
class _Spec:
    kind: str  # "int", "float", "bool", "str", "pair", "sizes" (int or ints), "floats", "names",
    # "count" (an int, or auto)
    attr: str  # the dataclass attribute (the key, unless that is a Python keyword)
    optional: bool
    meta: typing.Mapping[str, Any]
    default: Any


def _spec_of(tp: Any) -> tuple[str, bool]:
    """The kind of a field's annotation and whether it may be None."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        if args == [int, tuple[int, ...]]:
            return "sizes", optional  # an int, or a list of them
        if args == [int, str]:
            return "count", optional  # an int, or auto
        (tp,) = args
    if typing.get_origin(tp) is tuple:
        if typing.get_args(tp) == (str, ...):
            return "names", optional  # a list of strings, possibly empty
        return ("floats" if ... in typing.get_args(tp) else "pair"), optional
    kinds = {int: "int", float: "float", bool: "bool", str: "str"}
    return kinds[tp], optional


def _build_specs() -> dict[str, dict[str, _Spec]]:
    specs: dict[str, dict[str, _Spec]] = {}
    for name, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        specs[name] = {}
        for f in dataclasses.fields(cls):
            kind, optional = _spec_of(hints[f.name])
            key = f.metadata.get("key") or f.name
            specs[name][key] = _Spec(kind, f.name, optional, f.metadata, f.default)
    return specs


_SPECS = _build_specs()
