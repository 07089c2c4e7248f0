"""Configurations in and out: ``key=value`` overrides, YAML files read strictly
and written atomically, and the learning rate scaled by the batch size."""

from __future__ import annotations

import math
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint import atomic_write, fsync_dir
from .fields import _ALIASES, _SECTIONS, ConfigError
from .schema import (
    Config,
    _flat_dict,
    _from_dict,
    _plain,
    _suggest_section,
    _unknown_key,
    _unknown_section,
    alias_value,
    validate,
)
from .specs import _GROUPS, _SPECS, _flatten

__all__ = [
    "RECIPES_DIR",
    "apply_overrides",
    "config_to_yaml",
    "effective_lr",
    "load_config",
    "recipe_names",
    "resolve_config_path",
    "save_config",
]


# ---------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------


def _parse_override(item: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value), the value read as YAML
    (the key dotted within a nested section: ``recipe.gram.loss_weight``; an
    old key renamed kept as it is, for the config to read with its
    deprecation line)."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(
            f"override {item!r} must be key=value with a dotted key, e.g. data.batch_size=32"
        )
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    parts = dotted.split(".")
    if len(parts) < 2 or not all(parts):
        hint = _suggest_section(dotted) if len(parts) == 1 else ""
        raise ConfigError(
            f"override key {dotted!r} must be section.key, e.g. data.batch_size "
            f"({hint}known sections: {', '.join(_SECTIONS)})"
        )
    sname, key = parts[0], ".".join(parts[1:])
    if sname not in _SECTIONS:
        raise ConfigError(_unknown_section(sname))
    if len(parts) > 2 and ".".join(parts[1:-1]) not in _GROUPS[sname]:
        nested = ", ".join(f"{sname}.{g}" for g in _GROUPS[sname])
        raise ConfigError(
            f"override key {dotted!r} must be section.key, e.g. data.batch_size"
            + (f", or a key of a nested section ({nested})" if nested else "")
        )
    current, mapping = _ALIASES.get(sname, {}).get(key, (key, None))
    if mapping is not None:  # an old key with values of its own: its current key and value
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        return (sname, *alias_value(sname, key, value))
    spec = _SPECS[sname].get(current)
    if spec is None:
        if key in _GROUPS[sname]:
            raise ConfigError(
                f"override {dotted}: {dotted} is a section; give one of its keys, e.g. "
                f"{sname}.{next(k for k in _SPECS[sname] if k.startswith(key + '.'))}"
            )
        raise ConfigError(_unknown_key(sname, key))
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text  # left to the type check, which names the key
    if spec.kind == "str" and value is not None and not _quoted(text):
        # `logging.output_dir=2024` means the text, not the int, and a path is
        # a path: `model.init_from=runs/exp #3/ckpt.pth` is not cut at a YAML
        # comment (a quoted value is read as YAML's string)
        value = text.strip()
    if spec.optional and isinstance(value, str) and value.strip().lower() == "none":
        value = None  # Python's spelling of YAML's null
    return sname, key, value


def _quoted(text: str) -> bool:
    text = text.strip()
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


def _merge_overrides(d: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    if isinstance(overrides, str):  # a lone string would be iterated by character
        overrides = [overrides]
    errors = []
    for item in overrides:
        try:
            sname, key, value = _parse_override(item)
        except ConfigError as e:
            errors.extend(e.errors)
            continue
        section = d.get(sname)
        if section is not None and not isinstance(section, typing.Mapping):
            # None (empty in the file) takes the override; anything else is
            # reported by from_dict, so keep it when it is not a mapping.
            continue
        # nested sections as dotted keys, so that the override replaces the file's key
        section = d[sname] = _flatten(sname, section or {})
        current = _ALIASES.get(sname, {}).get(key, (key,))[0]
        for old, (now, _) in _ALIASES.get(sname, {}).items():
            if now == current:
                section.pop(old, None)  # the override wins over the old key in the file
        section.pop(current, None)
        section[key] = value
    if errors:
        raise ConfigError(errors)
    return d


def _given_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The values of ``cfg`` that count as set by it: its given keys and every
    key that differs from its default (a config changed in code)."""
    d = _flat_dict(cfg)
    return {
        sname: {
            key: value
            for key, value in values.items()
            if f"{sname}.{key}" in cfg.given_keys or value != _plain(_SPECS[sname][key].default)
        }
        for sname, values in d.items()
    }


def apply_overrides(cfg: Config, overrides: typing.Iterable[str]) -> Config:
    """A new Config: ``cfg`` with ``section.key=value`` overrides applied and checked.

    Values are read as YAML (``32``, ``0.5``, ``true``, ``[0.3, 1.0]``,
    ``null``); a string field takes the text as written. The overrides join
    the keys the config sets itself (:attr:`Config.given_keys`).
    """
    return _from_dict(_merge_overrides(_given_dict(cfg), overrides))


# ---------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML
    otherwise keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` may be overridden by explicit keys
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r}",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, not a file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"{context}: {problem}" if context else problem
        raise ConfigError(f"{where}: malformed YAML ({detail})") from None


# The YAML recipes shipped with the package (dino-opt train --config NAME).
RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def recipe_names() -> list[str]:
    """The names of the packaged YAML configs (``dinov2_vits14``, ...)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_config_path(path: str | os.PathLike) -> Path:
    """``path`` itself when it exists or names a folder or a ``.yaml`` file;
    else a packaged config's name (:func:`recipe_names`) gives its file."""
    p = Path(path)
    packaged = RECIPES_DIR / f"{p.name}.yaml"
    if not p.exists() and p.suffix == "" and p.parent == Path(".") and packaged.is_file():
        return packaged
    return p


def load_config(
    path: str | os.PathLike | typing.Mapping | None = None, overrides: typing.Iterable[str] = ()
) -> Config:
    """Reads a YAML config (None, or an empty file: the defaults; a mapping
    of sections: that config; the name of a packaged config, e.g.
    ``dinov2_vitl14``: that file, :func:`recipe_names`), applies ``section.key=value`` overrides,
    checks the result.

    Raises :class:`ConfigError` naming the file (not found; malformed YAML
    with its line and column) or the keys at fault.
    """
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    d: Any = {}
    if isinstance(path, typing.Mapping):
        d = {k: dict(v) if isinstance(v, typing.Mapping) else v for k, v in path.items()}
        path = None
    elif path is not None:
        path = resolve_config_path(path)
        d = _read_yaml(path)
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections "
                f"({', '.join(_SECTIONS)}), got {type(d).__name__}"
            )
    d = _merge_overrides(d, overrides)  # errors in an override name the override
    try:
        return _from_dict(d)
    except ConfigError as e:
        if path is None:
            raise
        origin = f"{path} with overrides" if overrides else str(path)
        raise ConfigError([f"{origin}: {msg}" for msg in e.errors]) from None


class _Dumper(yaml.SafeDumper):
    """Sections in block style, pairs in flow style (``[0.4, 1.0]``)."""

    def represent_list(self, data):
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(list, _Dumper.represent_list)


def config_to_yaml(cfg: Config, comments: bool = True) -> str:
    """The config as YAML that :func:`load_config` reads back to an equal
    config; with ``comments``, each key carries its documentation."""
    validate(cfg)
    text = yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False, width=1 << 30)
    if not comments:
        return text
    lines, section, path = [], None, []
    for line in text.splitlines():
        top = re.match(r"^(\w+):", line)
        if top:
            section = top.group(1)
            if lines:
                lines.append("")
            lines.append(f"# {_first_line(_SECTIONS[section])}")
        sub = re.match(r"^((?:  )+)(\w+):", line)
        if sub and section is not None:
            depth = len(sub.group(1)) // 2
            path[depth - 1 :] = [sub.group(2)]
            dotted = ".".join(path)
            if dotted in _GROUPS[section]:  # a nested section: its doc above it
                line = f"{sub.group(1)}# {_first_line(_GROUPS[section][dotted])}\n{line}"
            else:
                meta = _SPECS[section][dotted].meta
                allowed = f" ({' | '.join(map(str, meta['choices']))})" if meta["choices"] else ""
                line = f"{line}  # {meta['help']}{allowed}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _first_line(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0]


def save_config(cfg: Config, path: str | os.PathLike) -> Path:
    """Writes ``cfg`` as YAML to ``path`` atomically (a temporary file in the
    same folder, fsync, rename; :func:`~dino_opt.checkpoint.atomic_write`), so
    a crash never leaves a half-written config. Creates the parent folders.
    Returns the path."""
    path = Path(path)
    text = config_to_yaml(cfg).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(text))
    fsync_dir(path.parent)
    return path


# ---------------------------------------------------------------------------
# Derived values
# ---------------------------------------------------------------------------


def effective_lr(cfg: Config, world_size: int = 1) -> float:
    """The peak learning rate: ``optim.lr`` scaled by the images of one
    optimiser step, ``batch_size * world_size * accumulation_steps``.

    ``optim.scaling_rule`` linear_wrt_256 (DINO, main_dino.py): ``lr * images
    / 256``; the defaults give 0.0005 * 64 * 16 / 256 = 0.002 on 16 GPUs.
    sqrt_wrt_1024 (DINOv2): ``lr * sqrt(images / 1024)``; DINOv2's 0.004 at
    64 per GPU on 16 GPUs stays 0.004. ``optim.min_lr`` is not scaled, as in
    both.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    images = cfg.data.batch_size * world_size * cfg.optim.accumulation_steps
    if cfg.optim.scaling_rule == "sqrt_wrt_1024":
        return cfg.optim.lr * math.sqrt(images / 1024)
    return cfg.optim.lr * images / 256
