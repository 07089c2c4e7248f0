"""The docs' tables of configuration keys, written from the fields
themselves (their default and help), so that the docs cannot drift from
the code (``scripts/config_tables.py`` puts them in docs/)."""

from __future__ import annotations

from typing import Any

from .fields import _SECTIONS, ConfigError
from .specs import _SPECS

__all__ = ["key_table"]


def _yaml_text(value: Any) -> str:
    """A default as a config file writes it (``true``, ``null``, ``[0.1, 0.5]``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml_text(v) for v in value) + "]"
    return str(value)


def _keys(name: str) -> list[tuple[str, str]]:
    """(section, key) of the keys ``name`` stands for: a section
    (``recipe``), a nested section (``recipe.gram``) or one key."""
    section, _, rest = name.partition(".")
    if section not in _SECTIONS:
        raise ConfigError(f"key table: unknown section {section!r} in {name!r}")
    keys = [k for k in _SPECS[section] if not rest or k == rest or k.startswith(rest + ".")]
    if not keys:
        raise ConfigError(f"key table: {name!r} names no key of section {section!r}")
    return [(section, k) for k in keys]


def key_table(*names: str) -> str:
    """The Markdown table (key, default, meaning) of the keys of ``names``,
    each a section, a nested section or a key, in their order."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for name in names:
        for section, key in _keys(name):
            spec = _SPECS[section][key]
            meaning = spec.meta["help"].replace("|", "\\|")
            lines.append(f"| `{section}.{key}` | {_yaml_text(spec.default)} | {meaning} |")
    return "\n".join(lines) + "\n"
