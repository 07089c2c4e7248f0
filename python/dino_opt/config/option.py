"""One option of the configuration: a dataclass field that carries its help,
its allowed values and whether a resumed run may change it (what
:mod:`dino_opt.config.specs` reads, and the sections' modules write)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["option"]


def option(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    check: str | None = None,
    key: str | None = None,
    resume: bool | None = None,
) -> Any:
    """A dataclass field with its documentation and its allowed values.

    ``ge``/``gt``/``le``/``lt`` bound a number (or both ends of a pair);
    ``check`` names a special rule: ``"scale"`` (0 < lo <= hi <= 1),
    ``"pair"`` (lo <= hi), ``"device"``, ``"nonempty"``. ``key``: the name
    in YAML and overrides when it cannot be the attribute's (a Python
    keyword: ``checkpoint.async`` is the attribute ``async_``). ``resume``:
    whether a run resumed from a checkpoint may give another value (where
    things go and how they are reported, not what is computed); None: as
    its section says (``MAY_CHANGE_ON_RESUME``).
    """
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    meta["check"], meta["key"], meta["resume"] = check, key, resume
    return field(default=default, metadata=meta)
