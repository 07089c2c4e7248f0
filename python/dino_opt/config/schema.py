"""The ``Config`` dataclass and its checks: types, ranges, choices and the
relations between fields, each failure a :class:`ConfigError` naming the key."""

from __future__ import annotations

import difflib
import math
import re
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

from .fields import (
    _ALIASES,
    _SECTIONS,
    RECIPE_NEEDS,
    AugmentationConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DebugConfig,
    DistributedConfig,
    EvalConfig,
    HardwareConfig,
    HealthConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    RecipeConfig,
    ScheduleConfig,
)
from .names import student_key
from .recipe import distill_conflicts, gram_conflicts
from .specs import _GROUPS, _SPECS, _flatten, _nest, _Spec

__all__ = ["Config", "default_config", "validate"]


def alias_value(section: str, key: str, value: Any) -> tuple[str, Any]:
    """The current key and value that the old key ``section.key`` (of
    ``_ALIASES``) with ``value`` stands for; raises :class:`ConfigError`
    naming the old key when ``value`` is not one of its values."""
    new, mapping = _ALIASES[section][key]
    if mapping is None:  # renamed: the same values
        return new, value
    if type(value) in {type(v) for v in mapping} and value in mapping:  # true is not 1
        return new, mapping[value]
    allowed = ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in mapping)
    raise ConfigError(
        f"{section}.{key} (the old name of {section}.{new}) must be one of {allowed}, got {value!r}"
    )


def _resolve_aliases(sname: str, values: typing.Mapping, renamed: list[str]) -> dict:
    """``values`` with old keys replaced by their current keys; an old key and
    its current key given together must agree. The renamed keys found are
    added to ``renamed`` (``old -> new``, for one deprecation line)."""
    out = dict(values)
    for old in _ALIASES.get(sname, {}):
        if old not in out:
            continue
        if _ALIASES[sname][old][1] is None:
            renamed.append(f"{sname}.{old} -> {sname}.{_ALIASES[sname][old][0]}")
        new, value = alias_value(sname, old, out.pop(old))
        if new in out and _plain(out[new]) != _plain(value):
            raise ConfigError(
                f"{sname}.{old} (the old name of {sname}.{new}) says {value!r} but "
                f"{sname}.{new} says {out[new]!r}; give only {sname}.{new}"
            )
        out[new] = value
    return out


def _warn_renamed(renamed: list[str]) -> None:
    """One deprecation line for the old keys a config used."""
    if not renamed:
        return
    shown = ", ".join(renamed[:3]) + (f" and {len(renamed) - 3} more" if len(renamed) > 3 else "")
    warnings.warn(
        f"old config keys read under their new names ({shown}); write the new ones, which "
        "nest the recipe's sections (recipe.dino, ibot, koleo, gram, distill; docs/training.md)",
        FutureWarning,
        stacklevel=2,
    )


@dataclass
class Config:
    """The whole configuration: one dataclass per section.

    ``given_keys`` holds the ``section.key`` names that the source of this
    config set explicitly (a YAML file, a mapping, overrides, or values that
    differ from the defaults); a hardware preset sets only the others. It is
    not part of the config's value (equality, YAML, ``to_dict``).
    """

    data: DataConfig = field(default_factory=DataConfig)
    augmentation: AugmentationConfig = field(default_factory=AugmentationConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    given_keys: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict of builtins (tuples as lists), safe for YAML and JSON;
        a nested section (``recipe.gram``) a dict in its section's."""
        return {name: _nest(values) for name, values in _flat_dict(self).items()}

    def to_flat_dict(self) -> dict[str, Any]:
        """``section.key`` -> plain value, a nested section's keys dotted
        (``recipe.gram.loss_weight``): every key of the config on one level."""
        return {
            f"{name}.{key}": value
            for name, values in _flat_dict(self).items()
            for key, value in values.items()
        }

    @classmethod
    def from_dict(cls, d: typing.Mapping[str, Any] | None) -> Config:
        """Builds and validates a Config; missing sections and keys take their defaults.

        Raises :class:`ConfigError` listing every unknown key and bad value.
        """
        return _from_dict(d)

    def validate(self) -> Config:
        """Checks this (possibly mutated) config; returns it, converted in place."""
        return validate(self)

    @property
    def student_names(self) -> tuple[str, ...]:
        """The students a run trains, named by backbone: ``model.backbone``
        (the first, the run's result) and ``recipe.distill.students``."""
        return (self.model.backbone, *self.recipe.distill.students)

    @property
    def student_keys(self) -> tuple[str, ...]:
        """The students' keys, in the order of :attr:`student_names`: their
        modules' names (``members.<key>.`` in state dicts; a name's dots as
        underscores)."""
        return tuple(student_key(n) for n in self.student_names)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _flat_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Section -> key (dotted in a nested section: ``gram.loss_weight``) ->
    its plain value."""
    return {
        name: {key: _plain(spec.get(getattr(cfg, name))) for key, spec in _SPECS[name].items()}
        for name in _SECTIONS
    }


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

_KIND_NAMES = {
    "int": "an int",
    "float": "a number",
    "bool": "a bool (true or false)",
    "str": "a string",
    "pair": "a pair of numbers [lo, hi]",
    "sizes": "an int or a non-empty list of ints",
    "floats": "a non-empty list of numbers",
    "names": "a list of strings",
    "count": "an int or auto",
}


def _to_float(value: Any) -> float | None:
    """A finite float from an int, float or numeric string; None otherwise.

    Strings count because PyYAML reads ``1e-6`` (no dot) as a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return out if math.isfinite(out) else None


def _bounds_text(meta: typing.Mapping[str, Any]) -> str | None:
    lo = meta["ge"] if meta["ge"] is not None else meta["gt"]
    hi = meta["le"] if meta["le"] is not None else meta["lt"]
    if lo is not None and hi is not None:
        left = "[" if meta["ge"] is not None else "("
        right = "]" if meta["le"] is not None else ")"
        return f"in {left}{_num(lo)}, {_num(hi)}{right}"
    if lo is not None:
        return f">= {_num(lo)}" if meta["ge"] is not None else f"> {_num(lo)}"
    if hi is not None:
        return f"<= {_num(hi)}" if meta["le"] is not None else f"< {_num(hi)}"
    return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _in_bounds(x: float, meta: typing.Mapping[str, Any]) -> bool:
    return not (
        (meta["ge"] is not None and x < meta["ge"])
        or (meta["gt"] is not None and x <= meta["gt"])
        or (meta["le"] is not None and x > meta["le"])
        or (meta["lt"] is not None and x >= meta["lt"])
    )


def _check_choice(key: str, value: Any, choices: tuple | None) -> None:
    """ConfigError naming ``key`` when ``value`` is not one of ``choices``
    (with the closest choice of a mistyped string)."""
    if choices is None or value in choices:
        return
    problem = getattr(choices, "problem", None)  # a backbone key's SOURCE:NAME
    if problem is not None and isinstance(value, str) and problem(value):
        raise ConfigError(f"{key}: {problem(value)}")
    listed = ", ".join(str(c) for c in choices)
    if getattr(choices, "also", None):
        listed += f", or {choices.also}"
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"{key} must be one of {listed}; got {value!r}{hint}")


def _convert(key: str, spec: _Spec, value: Any) -> Any:
    """Converts ``value`` to the field's type and checks its range; raises
    ConfigError naming ``key`` (``section.name``)."""
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(f"{key} must be {_KIND_NAMES[spec.kind]}, got null")
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise _bad_type(key, spec, value)
        return value
    if spec.kind == "count" and value == "auto":
        return value  # resolved when the data is known (schedule.epochs: auto)
    out = _typed(key, spec, value)
    _check_value(key, spec, out)
    return out


def _bad_type(key: str, spec: _Spec, value: Any) -> ConfigError:
    expected = _KIND_NAMES[spec.kind] + (" or null" if spec.optional else "")
    return ConfigError(f"{key} must be {expected}, got {value!r}")


def _typed(key: str, spec: _Spec, value: Any) -> Any:
    """``value`` (not None) as the field's type (``str``, ``int``,
    ``count``, ``float``, ``sizes``, ``floats``, ``names``, ``pair``)."""
    bad_type = _bad_type(key, spec, value)
    if spec.kind == "str":
        if not isinstance(value, str):
            raise bad_type
        out: Any = value
    elif spec.kind in ("int", "count"):
        # bool is an int subclass, but `batch_size: true` is a mistake.
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_type
        out = value
    elif spec.kind == "float":
        out = _to_float(value)
        if out is None:
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
    elif spec.kind == "sizes":
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]  # one size: the int
        if isinstance(value, (list, tuple)) and value:
            if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
                raise bad_type
            out = tuple(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            out = value
        else:
            raise bad_type
    elif spec.kind == "floats":
        if not isinstance(value, (list, tuple)) or not value:
            raise bad_type
        out = tuple(_to_float(v) for v in value)
        if any(v is None for v in out):
            raise bad_type
    elif spec.kind == "names":
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad_type
        out = tuple(value)
    else:  # pair
        if isinstance(value, str) and "," in value:
            value = value.strip("()[] ").split(",")
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise bad_type
        lo, hi = (_to_float(v) for v in value)
        if lo is None or hi is None:
            raise bad_type
        out = (lo, hi)
    return out


def _check_value(key: str, spec: _Spec, out: Any) -> None:
    """The field's choices, bounds and own check (``scale``, ``pair``,
    ``device``, ``nonempty``) on its converted value ``out``."""
    meta = spec.meta
    choices = meta["choices"]
    for item in out if spec.kind == "names" else ():
        _check_choice(key, item, choices)
    if choices is not None and spec.kind != "names":
        _check_choice(key, out, choices)

    bounds = _bounds_text(meta)
    if bounds is not None:
        numbers = out if isinstance(out, tuple) else (out,)
        if not all(_in_bounds(x, meta) for x in numbers):
            what = "both ends of " + key if spec.kind == "pair" else key
            what = "every entry of " + key if spec.kind != "pair" and len(numbers) > 1 else what
            raise ConfigError(f"{what} must be {bounds}, got {_plain(out)!r}")

    check = meta["check"]
    if check == "scale" and not 0 < out[0] <= out[1] <= 1:
        raise ConfigError(f"{key} must be [lo, hi] with 0 < lo <= hi <= 1, got {list(out)}")
    if check == "pair" and not out[0] <= out[1]:
        raise ConfigError(f"{key} must be [lo, hi] with lo <= hi, got {list(out)}")
    if check == "device" and not _DEVICE_RE.match(out):
        raise ConfigError(f"{key} must be auto, cpu, cuda or cuda:N (N a GPU index), got {out!r}")
    if check == "nonempty" and not out.strip():
        raise ConfigError(f"{key} must be a non-empty string or null, got {out!r}")


# ---------------------------------------------------------------------------
# Unknown names
# ---------------------------------------------------------------------------


def _unknown_section(name: Any) -> str:
    known = ", ".join(_SECTIONS)
    hint = _suggest_section(str(name))
    return f"unknown section {str(name)!r} ({hint}known sections: {known})"


def _suggest_section(name: str) -> str:
    close = difflib.get_close_matches(name, list(_SECTIONS), n=1)
    if close:
        return f"did you mean '{close[0]}'? "
    # A key written at the top level, e.g. `batch_size: 32`.
    owners = [s for s, keys in _SPECS.items() if name in keys]
    if owners:
        return f"did you mean '{owners[0]}.{name}'? "
    return ""


def _unknown_key(section: str, name: Any) -> str:
    name = str(name)
    keys = list(_SPECS[section])
    close = difflib.get_close_matches(name, keys, n=1)
    if close:
        hint = f"did you mean '{section}.{close[0]}'? "
    else:
        # The right key in the wrong section, e.g. `optim.epochs`.
        owners = [s for s, k in _SPECS.items() if name in k]
        hint = f"did you mean '{owners[0]}.{name}'? " if owners else ""
    return f"unknown key '{section}.{name}' ({hint}known keys in {section}: {', '.join(keys)})"


# ---------------------------------------------------------------------------
# Building and validating
# ---------------------------------------------------------------------------


def _from_dict(d: typing.Mapping[str, Any] | None) -> Config:
    if d is None:
        d = {}
    if not isinstance(d, typing.Mapping):
        raise ConfigError(
            f"a config must be a mapping of sections ({', '.join(_SECTIONS)}), "
            f"got {type(d).__name__}"
        )
    errors: list[str] = []
    sections: dict[str, Any] = {}
    given_keys: list[str] = []
    renamed: list[str] = []
    for sname, values in d.items():
        if sname not in _SECTIONS:
            errors.append(_unknown_section(sname))
            continue
        if values is None:  # `data:` with nothing under it
            continue
        if sname == "hardware" and isinstance(values, str):
            values = {"preset": values}  # `hardware: auto`
        if sname == "recipe" and isinstance(values, str):
            values = {"name": values}  # `recipe: dinov2`
        if not isinstance(values, typing.Mapping):
            errors.append(
                f"section {sname!r} must be a mapping of keys "
                f"({', '.join(_SPECS[sname])}), got {values!r}"
            )
            continue
        try:
            values = _resolve_aliases(sname, _flatten(sname, values), renamed)
        except ConfigError as e:
            errors.extend(e.errors)
            continue
        section = sections[sname] = _SECTIONS[sname]()
        for key, value in values.items():
            spec = _SPECS[sname].get(key) if isinstance(key, str) else None
            if spec is None:
                errors.append(_not_a_group(sname, key, value) or _unknown_key(sname, key))
                continue
            try:
                spec.set(section, _convert(f"{sname}.{key}", spec, value))
                given_keys.append(f"{sname}.{key}")
            except ConfigError as e:
                errors.extend(e.errors)
    if errors:
        raise ConfigError(errors)
    _warn_renamed(renamed)
    given = frozenset(given_keys)
    cfg = Config(**{s: sections.get(s) or _SECTIONS[s]() for s in _SECTIONS}, given_keys=given)
    _check_relations(cfg)
    return cfg


def _not_a_group(sname: str, key: Any, value: Any) -> str | None:
    """The error of a nested section (``recipe.gram``) given as something
    else than a mapping of its keys; None for any other key."""
    if key not in _GROUPS[sname]:
        return None
    keys = [k.removeprefix(f"{key}.") for k in _SPECS[sname] if k.startswith(f"{key}.")]
    return f"{sname}.{key} must be a mapping of keys ({', '.join(keys)}), got {value!r}"


def validate(cfg: Config) -> Config:
    """Checks every field of ``cfg`` (types, ranges, choices) and the relations
    between fields; converts in place where lossless (an int where a float
    belongs, a list where a pair belongs). Returns ``cfg``.

    Use it after changing a config's attributes in code; the loading
    functions call it themselves.
    """
    if not isinstance(cfg, Config):
        raise ConfigError(f"expected a Config, got {type(cfg).__name__}")
    errors: list[str] = []
    converted: list[tuple[Any, str, Any]] = []
    for sname, cls in _SECTIONS.items():
        section = getattr(cfg, sname)
        if not isinstance(section, cls):
            errors.append(f"section {sname!r} must be a {cls.__name__}, got {section!r}")
            continue
        wrong = _wrong_groups(sname, section)
        if wrong:
            errors += wrong
            continue
        for key, spec in _SPECS[sname].items():
            try:
                value = _convert(f"{sname}.{key}", spec, spec.get(section))
                converted.append((section, spec, value))
            except ConfigError as e:
                errors.extend(e.errors)
    if errors:
        raise ConfigError(errors)
    for section, spec, value in converted:
        spec.set(section, value)
    _check_relations(cfg)
    return cfg


def _wrong_groups(sname: str, section: Any) -> list[str]:
    """The nested sections of ``section`` that are not their dataclass (a
    config changed in code)."""
    errors = []
    for dotted, cls in _GROUPS[sname].items():
        node = section
        for name in dotted.split("."):
            node = getattr(node, name, None)
        if not isinstance(node, cls):
            errors.append(f"{sname}.{dotted} must be a {cls.__name__}, got {node!r}")
    return errors


def _check_relations(cfg: Config) -> None:
    """Checks between fields (each field alone is already valid)."""
    errors = []
    s, o, m, a = cfg.schedule, cfg.optim, cfg.model, cfg.augmentation
    epochs = s.epochs if s.epochs != "auto" else float("inf")  # auto: scaled with the warm-ups
    if s.warmup_epochs > epochs:
        errors.append(
            f"schedule.warmup_epochs ({s.warmup_epochs}) must be <= schedule.epochs ({s.epochs})"
        )
    if s.warmup_teacher_temp_epochs > epochs:
        errors.append(
            f"schedule.warmup_teacher_temp_epochs ({s.warmup_teacher_temp_epochs}) must be "
            f"<= schedule.epochs ({s.epochs})"
        )
    if o.min_lr > o.lr:
        errors.append(f"optim.min_lr ({o.min_lr}) must be <= optim.lr ({o.lr})")
    errors += _crop_pair_conflicts(a)
    if m.backbone.startswith("vit"):
        # The crops must tile into whole patches.
        for key in ("global_crop_size", "local_crop_size"):
            size = getattr(a, key)
            bad = [v for v in (size if isinstance(size, tuple) else (size,)) if v % m.patch_size]
            if bad:
                what = f"({size})" if isinstance(size, int) else f"{list(size)}: {bad[0]}"
                errors.append(
                    f"augmentation.{key} {what} must be a multiple of model.patch_size "
                    f"({m.patch_size}) for a ViT backbone"
                )
    elif m.patch_size != _SPECS["model"]["patch_size"].default:
        errors.append(
            f"model.patch_size applies to ViT backbones only; model.backbone is "
            f"{m.backbone!r} (leave model.patch_size at its default)"
        )
    needs_tokens = RECIPE_NEEDS[cfg.recipe.name].get("patch_tokens")
    if needs_tokens and not m.backbone.startswith("vit"):
        errors.append(
            f"recipe.name={cfg.recipe.name} needs a ViT backbone ({needs_tokens}); "
            f"model.backbone is {m.backbone!r}"
        )
    errors += _sharding_conflicts(cfg)
    needs = RECIPE_NEEDS[cfg.recipe.name]
    errors += gram_conflicts(cfg, needs)
    errors += distill_conflicts(cfg, needs)
    h = cfg.health
    if h.on_collapse == "rollback" and h.rollback_lr_scale >= 1:
        errors.append(
            "health.on_collapse=rollback needs health.rollback_lr_scale < 1 (a rollback at "
            "the same learning rate replays the same steps into the same collapse)"
        )
    if errors:
        raise ConfigError(errors)


def _crop_pair_conflicts(a: AugmentationConfig) -> list[str]:
    """The crop-size pairs: lists of one length, one probability per pair summing to 1."""
    g, loc = a.global_crop_size, a.local_crop_size
    if isinstance(g, tuple) and isinstance(loc, tuple) and len(g) != len(loc):
        return [
            f"augmentation.global_crop_size has {len(g)} sizes but augmentation.local_crop_size "
            f"has {len(loc)}: give one (global, local) pair per position"
        ]
    ratios, n = a.crop_size_ratios, len(a.crop_size_pairs)
    if ratios is None:
        return []
    if len(ratios) != n:
        return [
            f"augmentation.crop_size_ratios has {len(ratios)} ratios for {n} crop-size "
            "pair(s) (the lengths of augmentation.global_crop_size / local_crop_size)"
        ]
    if abs(sum(ratios) - 1) > 1e-6:
        return [
            f"augmentation.crop_size_ratios must sum to 1, got {sum(ratios):g} ({list(ratios)})"
        ]
    return []


def _sharding_conflicts(cfg: Config) -> list[str]:
    """What ``distributed.strategy=fsdp`` cannot be combined with."""
    if cfg.distributed.strategy != "fsdp":
        return []
    errors = []
    others = [n for n in cfg.student_names if not n.startswith("vit")]
    if others:
        key = "model.backbone" if others[0] == cfg.model.backbone else "recipe.distill.students"
        errors.append(
            f"distributed.strategy=fsdp shards a ViT block by block; {key} names "
            f"{others[0]!r} (use distributed.strategy=ddp)"
        )
    if cfg.recipe.distill.students_init_from:
        errors.append(
            "recipe.distill.students_init_from starts students that are not sharded: use "
            "distributed.strategy=ddp"
        )
    if cfg.hardware.precision == "fp16":
        errors.append(
            "distributed.strategy=fsdp takes hardware.precision bf16, fp32 or auto, not fp16 "
            "(fp16's loss scaling does not reduce its overflow check over the shards)"
        )
    return errors


def default_config() -> Config:
    """The original DINO recipe for ViT-S/16 (a fresh object each call)."""
    return Config()
