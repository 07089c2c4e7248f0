"""The per-key specs of the configuration, derived from its sections'
dataclasses (:mod:`dino_opt.config.fields`): each key's kind (what its
values are parsed and checked as), the attributes that reach it, whether it
may be null, its metadata (help, bounds, choices), default, and whether a
resumed run may change it. A section may nest sections of its own (the
recipe's ``recipe.gram``, ...): their keys are dotted within the section
(``gram.loss_weight``), and nested mappings in YAML."""

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
    path: tuple[str, ...] = ()  # the attributes of the nested sections above ``attr``
    resume: bool = False  # whether a resumed run may give it another value

    def owner(self, section: Any) -> Any:
        """The (nested) section object that holds this key's attribute."""
        for name in self.path:
            section = getattr(section, name)
        return section

    def get(self, section: Any) -> Any:
        return getattr(self.owner(section), self.attr)

    def set(self, section: Any, value: Any) -> None:
        setattr(self.owner(section), self.attr, value)


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


def _add_specs(out: dict, groups: dict, cls: type, path: tuple[str, ...], resume: bool) -> None:
    """The specs of ``cls``'s fields into ``out``, a nested section's under
    its dotted prefix (``groups``: prefix -> its class)."""
    resume = getattr(cls, "MAY_CHANGE_ON_RESUME", resume)
    hints = typing.get_type_hints(cls)
    prefix = "".join(f"{p}." for p in path)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            groups[prefix + f.name] = tp
            _add_specs(out, groups, tp, (*path, f.name), resume)
            continue
        kind, optional = _spec_of(tp)
        key = prefix + (f.metadata.get("key") or f.name)
        may = f.metadata.get("resume")
        out[key] = _Spec(
            kind, f.name, optional, f.metadata, f.default, path, resume if may is None else may
        )


def _build_specs() -> tuple[dict[str, dict[str, _Spec]], dict[str, dict[str, type]]]:
    specs: dict[str, dict[str, _Spec]] = {}
    groups: dict[str, dict[str, type]] = {}
    for name, cls in _SECTIONS.items():
        specs[name], groups[name] = {}, {}
        _add_specs(specs[name], groups[name], cls, (), False)
    return specs, groups


#: Section -> key (dotted within the section) -> its spec; section -> the
#: dotted names of its nested sections -> their classes.
_SPECS, _GROUPS = _build_specs()


def _nest(flat: typing.Mapping[str, Any]) -> dict[str, Any]:
    """A section's dotted keys as nested mappings (``gram.loss_weight`` ->
    ``{"gram": {"loss_weight": ...}}``), in their order."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _flatten(sname: str, values: typing.Mapping, prefix: str = "") -> dict[Any, Any]:
    """A section's mapping with its nested sections' mappings as dotted keys
    (the inverse of :func:`_nest`); a nested section given as null is left
    out (``gram:`` with nothing under it), one given as anything but a
    mapping is kept whole, for the checks to name."""
    out: dict[Any, Any] = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}" if isinstance(key, str) else key
        if dotted in _GROUPS[sname] and isinstance(value, typing.Mapping):
            out.update(_flatten(sname, value, f"{dotted}."))
        elif dotted in _GROUPS[sname] and value is None:
            continue
        else:
            out[dotted] = value
    return out
