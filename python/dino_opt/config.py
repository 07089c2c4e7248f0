"""Typed configuration for DINO training: dataclasses, YAML, overrides, checks.

The defaults are the recipe of the original DINO code (facebookresearch/dino,
``main_dino.py``) for ViT-S/16, which the paper's results were made with
(docs/design.md lists them). Key names follow the course guide where it has them
(``data.batch_size``, ``data.num_workers``, ``data.pin_memory``,
``augmentation.num_local_views``, ``model.backbone``).

Typical use::

    cfg = load_config("my.yaml", ["data.batch_size=32", "model.backbone=vit_tiny"])
    save_config(cfg, run_dir / "config.yaml")

Every way in (:meth:`Config.from_dict`, :func:`load_config`,
:func:`apply_overrides`, :func:`validate`) checks types, ranges, choices and
the relations between fields, and raises :class:`ConfigError` naming the key
and what it allows. Loading is pure: it reads and checks, and never looks at
a device. A hardware preset (``hardware.preset``) is resolved afterwards, in
one explicit step (:func:`dino_opt.hardware.resolve_hardware`), which sets the
preset's keys that the config does not set itself (:attr:`Config.given_keys`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .checkpoint import atomic_write, fsync_dir
from .presets import PRESET_NAMES

__all__ = [
    "AugmentationConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "DistributedConfig",
    "EvalConfig",
    "HardwareConfig",
    "HealthConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "apply_overrides",
    "config_to_yaml",
    "default_config",
    "effective_lr",
    "load_config",
    "save_config",
    "validate",
]


class ConfigError(ValueError):
    """A configuration that cannot be used. ``errors`` holds one message per
    problem found (the message of the exception joins them)."""

    def __init__(self, errors: str | list[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


def _opt(
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
) -> Any:
    """A dataclass field with its documentation and its allowed values.

    ``ge``/``gt``/``le``/``lt`` bound a number (or both ends of a pair);
    ``check`` names a special rule: ``"scale"`` (0 < lo <= hi <= 1),
    ``"pair"`` (lo <= hi), ``"device"``, ``"nonempty"``. ``key``: the name
    in YAML and overrides when it cannot be the attribute's (a Python
    keyword: ``checkpoint.async`` is the attribute ``async_``).
    """
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    meta["check"], meta["key"] = check, key
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------

_BACKBONES = ("vit_tiny", "vit_small", "vit_base", "resnet18", "resnet50")


@dataclass
class DataConfig:
    """Where the images come from and how the loader delivers them."""

    root: str | None = _opt(
        None,
        "ImageFolder directory (or a directory of images); null: the built-in data set",
        check="nonempty",
    )
    batch_size: int = _opt(64, "images per batch per GPU (DINO: 64)", ge=1)
    num_workers: int | None = _opt(None, "loader threads; null: the cores available", ge=1)
    pin_memory: bool = _opt(True, "batches in pinned memory for faster copies to the GPU")
    persistent_workers: bool = _opt(True, "keep the loader's workers alive between epochs")
    prefetch: int = _opt(4, "batches prepared ahead of the training step", ge=1)
    dtype: str = _opt(
        "float32",
        "dtype of the crops the loader outputs",
        choices=("float32", "bfloat16", "float16"),
    )
    photometric: str = _opt(
        "cpu",
        "where colour augmentation runs: loader threads or a GPU kernel",
        choices=("cpu", "gpu"),
    )
    on_error: str = _opt(
        "raise",
        "an unreadable image: raise, or skip it (replaced by another image)",
        choices=("raise", "skip"),
    )
    max_side: int | None = _opt(
        None, "prepared data: resize images so that their longer side is at most this", ge=1
    )


@dataclass
class AugmentationConfig:
    """DINO's multi-crop and photometric augmentation (docs/design.md, "The algorithm")."""

    global_crop_size: int = _opt(224, "side of the 2 global crops", ge=1)
    local_crop_size: int = _opt(96, "side of the local crops", ge=1)
    num_local_views: int = _opt(8, "local crops per image (DINO: 8)", ge=0)
    global_crops_scale: tuple[float, float] = _opt(
        (0.4, 1.0), "area fraction range of the global crops", check="scale"
    )
    local_crops_scale: tuple[float, float] = _opt(
        (0.05, 0.4), "area fraction range of the local crops", check="scale"
    )
    flip_p: float = _opt(0.5, "horizontal flip probability", ge=0, le=1)
    jitter_p: float = _opt(0.8, "colour jitter probability", ge=0, le=1)
    brightness: float = _opt(0.4, "colour jitter brightness strength", ge=0)
    contrast: float = _opt(0.4, "colour jitter contrast strength", ge=0)
    saturation: float = _opt(0.2, "colour jitter saturation strength", ge=0)
    hue: float = _opt(0.1, "colour jitter hue strength", ge=0, le=0.5)
    grayscale_p: float = _opt(0.2, "grayscale probability", ge=0, le=1)
    blur_sigma: tuple[float, float] = _opt(
        (0.1, 2.0), "Gaussian blur sigma range", gt=0, check="pair"
    )
    blur_p_global1: float = _opt(1.0, "blur probability, global crop 1", ge=0, le=1)
    blur_p_global2: float = _opt(0.1, "blur probability, global crop 2", ge=0, le=1)
    blur_p_local: float = _opt(0.5, "blur probability, local crops", ge=0, le=1)
    solarize_p_global2: float = _opt(0.2, "solarisation probability, global crop 2", ge=0, le=1)


@dataclass
class ModelConfig:
    """Backbone and DINO head."""

    backbone: str = _opt("vit_small", "backbone architecture", choices=_BACKBONES)
    patch_size: int = _opt(16, "ViT patch size (ViT backbones only)", choices=(8, 16))
    drop_path_rate: float = _opt(0.1, "stochastic depth rate of the ViT blocks", ge=0, lt=1)
    out_dim: int = _opt(65536, "dimension of the head's output (prototypes)", ge=1)
    norm_last_layer: bool = _opt(True, "fix the norm of the head's weight-normalised last layer")
    use_bn_in_head: bool = _opt(False, "batch norm in the head's MLP")
    hidden_dim: int = _opt(2048, "hidden width of the head's MLP", ge=1)
    bottleneck_dim: int = _opt(256, "bottleneck width before the last layer", ge=1)
    init_from: str | None = _opt(
        None,
        "weights a fresh run starts from (continued pretraining): a timm or Hugging Face "
        "export, an original DINO file, a dino_opt checkpoint or run folder",
        check="nonempty",
    )


@dataclass
class OptimConfig:
    """Optimiser; lr is per 256 images (see effective_lr)."""

    optimizer: str = _opt("adamw", "optimiser", choices=("adamw", "sgd"))
    lr: float = _opt(
        0.0005, "peak learning rate per 256 images (scaled by global batch / 256)", gt=0
    )
    min_lr: float = _opt(1e-6, "learning rate at the end of the cosine schedule", ge=0)
    weight_decay: float = _opt(0.04, "weight decay at the start (cosine schedule)", ge=0)
    weight_decay_end: float = _opt(0.4, "weight decay at the end", ge=0)
    clip_grad: float = _opt(3.0, "global gradient norm clip; 0 disables", ge=0)
    freeze_last_layer: int = _opt(1, "epochs during which the head's last layer is frozen", ge=0)
    accumulation_steps: int = _opt(1, "micro-batches per optimiser step", ge=1)
    fused: bool | None = _opt(None, "fused optimiser kernel; null: where torch offers it")


@dataclass
class ScheduleConfig:
    """Epochs, warm-ups, teacher momentum and the loss's temperatures."""

    epochs: int = _opt(100, "training epochs", ge=1)
    warmup_epochs: int = _opt(10, "linear learning rate warm-up epochs", ge=0)
    momentum_teacher: float = _opt(
        0.996, "teacher EMA momentum at the start (cosine to 1)", ge=0, le=1
    )
    teacher_temp: float = _opt(0.04, "teacher temperature after the warm-up", gt=0)
    warmup_teacher_temp: float = _opt(0.04, "teacher temperature at the start", gt=0)
    warmup_teacher_temp_epochs: int = _opt(
        0, "epochs of linear teacher temperature warm-up (DINO: optionally 30, to 0.07)", ge=0
    )
    student_temp: float = _opt(0.1, "student temperature", gt=0)
    center_momentum: float = _opt(0.9, "momentum of the teacher output centre", ge=0, le=1)


@dataclass
class HardwareConfig:
    """Device, numerics and memory/speed trade-offs."""

    device: str = _opt("auto", "auto, cpu, cuda or cuda:N", check="device")
    precision: str = _opt(
        "auto",
        "autocast precision; auto: bf16 where supported, else fp32",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    grad_checkpointing: bool = _opt(False, "recompute ViT blocks in backward to save memory")
    crop_batch_size: int | None = _opt(
        None, "crops' worth per backbone pass; null: all crops at once", ge=1
    )
    channels_last: bool = _opt(False, "channels_last memory format (convolutional backbones)")
    preset: str = _opt(
        "off",
        "set batch size, local crops, backbone, precision and checkpointing from the device's "
        "memory (auto) or a named row (dino-opt presets); keys set in the config win",
        choices=PRESET_NAMES,
    )
    compile: bool = _opt(False, "torch.compile the model")
    seed: int = _opt(0, "seed of every random choice", ge=0, le=2**32 - 1)


@dataclass
class LoggingConfig:
    """Run folder and what goes into it."""

    output_dir: str | None = _opt(None, "run folder; null: runs/<timestamp>", check="nonempty")
    log_every: int = _opt(10, "steps between logged metrics", ge=1)
    tensorboard: bool = _opt(True, "write TensorBoard logs")
    progress: bool = _opt(True, "show a progress bar")
    profile: bool = _opt(True, "write the profile summary")
    tsne: bool = _opt(True, "plot a t-SNE map of held-out features before and after training")
    histograms: bool = _opt(
        False, "TensorBoard histograms of the per-image teacher entropy at each logging step"
    )
    wandb: bool = _opt(
        False,
        "also log to Weights & Biases (pip install 'dino_opt[wandb]'; WANDB_MODE=offline "
        "works without a network)",
    )
    wandb_project: str = _opt("dino_opt", "Weights & Biases project", check="nonempty")


@dataclass
class CheckpointConfig:
    """When to save, how many to keep, what to resume from."""

    every_epochs: int = _opt(1, "epochs between checkpoints; 0: only at the end", ge=0)
    every_steps: int = _opt(
        0, "optimizer steps between checkpoints inside an epoch (resume mid-epoch); 0: off", ge=0
    )
    keep: int = _opt(3, "most recent checkpoints kept (milestones are kept as well)", ge=1)
    milestone_every: int = _opt(
        0, "every this many epochs an end-of-epoch checkpoint is kept for good; 0: none", ge=0
    )
    resume: str | None = _opt(
        "auto",
        "auto: continue from the newest good checkpoint of the run folder when there is "
        "one; a checkpoint path; null: start fresh (refused if the run folder has checkpoints)",
        check="nonempty",
    )
    async_: bool = _opt(
        True,
        "write checkpoints in a background thread: the step waits only for a copy of the "
        "state (to pinned host memory on a GPU); one write in flight at a time",
        key="async",
    )


@dataclass
class EvalConfig:
    """k-NN evaluation on teacher features, as in DINO."""

    knn_k: int = _opt(20, "neighbours of the weighted k-NN vote", ge=1)
    knn_temperature: float = _opt(0.07, "temperature of the k-NN vote weights", gt=0)
    every_epochs: int = _opt(0, "epochs between evaluations; 0: only at the end", ge=0)


@dataclass
class HealthConfig:
    """Training health checks at each logging interval (dino_opt.health)."""

    enabled: bool = _opt(True, "check collapse, gradients, throughput and NaN steps while training")
    feature_std_min: float = _opt(
        0.1,
        "collapse alert below this std of the L2-normalised features x sqrt(dim) "
        "(isotropic features: 1)",
        ge=0,
    )
    entropy_uniform_max: float = _opt(
        0.98, "uniform-collapse alert above this teacher entropy / log(out_dim)", ge=0, le=1
    )
    entropy_dominant_min: float = _opt(
        1.0,
        "dominant-dimension alert below this entropy (nats) of the batch-mean teacher output",
        ge=0,
    )
    grad_norm_max: float = _opt(
        10.0, "gradient-explosion alert above this gradient norm (before clipping)", ge=0
    )
    throughput_drop: float = _opt(
        0.8,
        "throughput alert below this fraction of the first logged throughput; 0 disables",
        ge=0,
        le=1,
    )
    throughput_window: int = _opt(
        3, "logging intervals averaged for the throughput check (first vs last)", ge=1
    )
    max_nonfinite_steps: int = _opt(
        20,
        "act (health.on_nonfinite) after more than this many consecutive steps with a NaN/inf "
        "loss or gradient",
        ge=0,
    )
    on_nonfinite: str = _opt(
        "rollback",
        "after too many non-finite steps: rollback (reload the last good checkpoint, skip the "
        "failing batches, go on), stop (save and stop), skip (skip their updates, go on)",
        choices=("rollback", "stop", "skip"),
    )
    on_collapse: str = _opt(
        "warn",
        "on a collapse alert sustained for health.collapse_patience logging intervals: warn, "
        "or rollback (reload the last good checkpoint at a lower learning rate)",
        choices=("warn", "rollback"),
    )
    collapse_patience: int = _opt(
        3, "consecutive logging intervals with a collapse alert before on_collapse acts", ge=1
    )
    max_rollbacks: int = _opt(
        3, "rollbacks allowed in a run; one more failure stops it, its checkpoints kept", ge=0
    )
    rollback_lr_scale: float = _opt(
        1.0, "each rollback multiplies the learning rate from then on by this", gt=0, le=1
    )


@dataclass
class DistributedConfig:
    """Several processes: collective timeouts and hang detection."""

    timeout_s: float = _opt(
        1800.0, "timeout of a collective of the process group (NCCL, gloo), seconds", gt=0
    )
    hang_timeout_s: float = _opt(
        900.0,
        "a rank without progress for this long ends the job, naming the stuck rank and its "
        "last completed step (the checkpoint in flight finished first); 0: off",
        ge=0,
    )


@dataclass
class DebugConfig:
    """Fault injection, for testing the fault tolerance of a run."""

    inject_nonfinite_at_step: int | None = _opt(
        None,
        "make the batch of this step (as the metrics count steps) all NaN, as a corrupt image "
        "would: the loss, the teacher's output and the center become non-finite",
        ge=1,
    )
    inject_hang_at_step: int | None = _opt(
        None,
        "at this step, rank debug.inject_hang_rank stops (sleeps) just before the metrics "
        "all-reduce, so the other ranks wait in it",
        ge=1,
    )
    inject_hang_rank: int = _opt(0, "the rank that stops at debug.inject_hang_at_step", ge=0)


# Section name -> section class, in the order they are written out.
_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "augmentation": AugmentationConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "hardware": HardwareConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "health": HealthConfig,
    "distributed": DistributedConfig,
    "debug": DebugConfig,
}


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
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    given_keys: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict of builtins (tuples as lists), safe for YAML and JSON."""
        out: dict[str, dict[str, Any]] = {}
        for name in _SECTIONS:
            section = getattr(self, name)
            out[name] = {
                key: _plain(getattr(section, spec.attr)) for key, spec in _SPECS[name].items()
            }
        return out

    @classmethod
    def from_dict(cls, d: typing.Mapping[str, Any] | None) -> Config:
        """Builds and validates a Config; missing sections and keys take their defaults.

        Raises :class:`ConfigError` listing every unknown key and bad value.
        """
        return _from_dict(d)

    def validate(self) -> Config:
        """Checks this (possibly mutated) config; returns it, converted in place."""
        return validate(self)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------------------
# Field types and per-field checks
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    kind: str  # "int", "float", "bool", "str" or "pair"
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
        (tp,) = args
    if typing.get_origin(tp) is tuple:
        return "pair", optional
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

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

_KIND_NAMES = {
    "int": "an int",
    "float": "a number",
    "bool": "a bool (true or false)",
    "str": "a string",
    "pair": "a pair of numbers [lo, hi]",
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


def _convert(key: str, spec: _Spec, value: Any) -> Any:
    """Converts ``value`` to the field's type and checks its range; raises
    ConfigError naming ``key`` (``section.name``)."""
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(f"{key} must be {_KIND_NAMES[spec.kind]}, got null")
    meta = spec.meta
    expected = _KIND_NAMES[spec.kind] + (" or null" if spec.optional else "")
    bad_type = ConfigError(f"{key} must be {expected}, got {value!r}")

    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise bad_type
        return value
    if spec.kind == "str":
        if not isinstance(value, str):
            raise bad_type
        out: Any = value
    elif spec.kind == "int":
        # bool is an int subclass, but `batch_size: true` is a mistake.
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_type
        out = value
    elif spec.kind == "float":
        out = _to_float(value)
        if out is None:
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
    else:  # pair
        if isinstance(value, str) and "," in value:
            value = value.strip("()[] ").split(",")
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise bad_type
        lo, hi = (_to_float(v) for v in value)
        if lo is None or hi is None:
            raise bad_type
        out = (lo, hi)

    choices = meta["choices"]
    if choices is not None and out not in choices:
        listed = ", ".join(str(c) for c in choices)
        hint = ""
        if isinstance(out, str):
            close = difflib.get_close_matches(out, [str(c) for c in choices], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{key} must be one of {listed}; got {out!r}{hint}")

    bounds = _bounds_text(meta)
    if bounds is not None:
        numbers = out if spec.kind == "pair" else (out,)
        if not all(_in_bounds(x, meta) for x in numbers):
            what = "both ends of " + key if spec.kind == "pair" else key
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
    return out


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
    for sname, values in d.items():
        if sname not in _SECTIONS:
            errors.append(_unknown_section(sname))
            continue
        if values is None:  # `data:` with nothing under it
            continue
        if sname == "hardware" and isinstance(values, str):
            values = {"preset": values}  # `hardware: auto`
        if not isinstance(values, typing.Mapping):
            errors.append(
                f"section {sname!r} must be a mapping of keys "
                f"({', '.join(_SPECS[sname])}), got {values!r}"
            )
            continue
        kwargs = {}
        for key, value in values.items():
            spec = _SPECS[sname].get(key) if isinstance(key, str) else None
            if spec is None:
                errors.append(_unknown_key(sname, key))
                continue
            try:
                kwargs[spec.attr] = _convert(f"{sname}.{key}", spec, value)
                given_keys.append(f"{sname}.{key}")
            except ConfigError as e:
                errors.extend(e.errors)
        sections[sname] = kwargs
    if errors:
        raise ConfigError(errors)
    given = frozenset(given_keys)
    cfg = Config(**{s: _SECTIONS[s](**sections.get(s, {})) for s in _SECTIONS}, given_keys=given)
    _check_relations(cfg)
    return cfg


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
        for key, spec in _SPECS[sname].items():
            try:
                value = _convert(f"{sname}.{key}", spec, getattr(section, spec.attr))
                converted.append((section, spec.attr, value))
            except ConfigError as e:
                errors.extend(e.errors)
    if errors:
        raise ConfigError(errors)
    for section, key, value in converted:
        setattr(section, key, value)
    _check_relations(cfg)
    return cfg


def _check_relations(cfg: Config) -> None:
    """Checks between fields (each field alone is already valid)."""
    errors = []
    s, o, m, a = cfg.schedule, cfg.optim, cfg.model, cfg.augmentation
    if s.warmup_epochs > s.epochs:
        errors.append(
            f"schedule.warmup_epochs ({s.warmup_epochs}) must be <= schedule.epochs ({s.epochs})"
        )
    if s.warmup_teacher_temp_epochs > s.epochs:
        errors.append(
            f"schedule.warmup_teacher_temp_epochs ({s.warmup_teacher_temp_epochs}) must be "
            f"<= schedule.epochs ({s.epochs})"
        )
    if o.min_lr > o.lr:
        errors.append(f"optim.min_lr ({o.min_lr}) must be <= optim.lr ({o.lr})")
    if m.backbone.startswith("vit"):
        # The crops must tile into whole patches.
        for key in ("global_crop_size", "local_crop_size"):
            size = getattr(a, key)
            if size % m.patch_size:
                errors.append(
                    f"augmentation.{key} ({size}) must be a multiple of model.patch_size "
                    f"({m.patch_size}) for a ViT backbone"
                )
    elif m.patch_size != _SPECS["model"]["patch_size"].default:
        errors.append(
            f"model.patch_size applies to ViT backbones only; model.backbone is "
            f"{m.backbone!r} (leave model.patch_size at its default)"
        )
    h = cfg.health
    if h.on_collapse == "rollback" and h.rollback_lr_scale >= 1:
        errors.append(
            "health.on_collapse=rollback needs health.rollback_lr_scale < 1 (a rollback at "
            "the same learning rate replays the same steps into the same collapse)"
        )
    if errors:
        raise ConfigError(errors)


def default_config() -> Config:
    """The original DINO recipe for ViT-S/16 (a fresh object each call)."""
    return Config()


# ---------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------


def _parse_override(item: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value), the value read as YAML."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(
            f"override {item!r} must be key=value with a dotted key, e.g. data.batch_size=32"
        )
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        hint = _suggest_section(dotted) if len(parts) == 1 else ""
        raise ConfigError(
            f"override key {dotted!r} must be section.key, e.g. data.batch_size "
            f"({hint}known sections: {', '.join(_SECTIONS)})"
        )
    sname, key = parts
    if sname not in _SECTIONS:
        raise ConfigError(_unknown_section(sname))
    spec = _SPECS[sname].get(key)
    if spec is None:
        raise ConfigError(_unknown_key(sname, key))
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text  # left to the type check, which names the key
    if spec.kind == "str" and value is not None and not isinstance(value, str):
        # `logging.output_dir=2024` means the text, not the int.
        value = text.strip()
    if spec.optional and isinstance(value, str) and value.strip().lower() == "none":
        value = None  # Python's spelling of YAML's null
    return sname, key, value


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
        if not isinstance(section, dict):
            # None (empty in the file) takes the override; anything else is
            # reported by from_dict, so keep it when it is not a mapping.
            if section is not None and not isinstance(section, typing.Mapping):
                continue
            section = dict(section or {})
            d[sname] = section
        section[key] = value
    if errors:
        raise ConfigError(errors)
    return d


def _given_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The values of ``cfg`` that count as set by it: its given keys and every
    key that differs from its default (a config changed in code)."""
    d = cfg.to_dict()
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
    d = _given_dict(cfg)
    for sname, values in _merge_overrides({}, overrides).items():  # parsed and checked alone
        d[sname].update(values)
    return _from_dict(d)


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


def load_config(
    path: str | os.PathLike | typing.Mapping | None = None, overrides: typing.Iterable[str] = ()
) -> Config:
    """Reads a YAML config (None, or an empty file: the defaults; a mapping
    of sections: that config), applies ``section.key=value`` overrides,
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
        path = Path(path)
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
    lines, section = [], None
    for line in text.splitlines():
        top = re.match(r"^(\w+):", line)
        if top:
            section = top.group(1)
            if lines:
                lines.append("")
            doc = (_SECTIONS[section].__doc__ or "").strip().splitlines()[0]
            lines.append(f"# {doc}")
        sub = re.match(r"^  (\w+):", line)
        if sub and section is not None:
            meta = _SPECS[section][sub.group(1)].meta
            allowed = f" ({' | '.join(map(str, meta['choices']))})" if meta["choices"] else ""
            line = f"{line}  # {meta['help']}{allowed}"
        lines.append(line)
    return "\n".join(lines) + "\n"


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
    """The peak learning rate by DINO's linear scaling rule.

    ``optim.lr`` is the rate for 256 images per optimiser step; DINO scales it
    linearly with the images that make one step: ``lr * batch_size *
    world_size * accumulation_steps / 256`` (main_dino.py: ``args.lr *
    (args.batch_size_per_gpu * get_world_size()) / 256``; accumulated
    micro-batches add to the step's batch the same way). The defaults give
    0.0005 * 64 * 16 / 256 = 0.002 on 16 GPUs. ``optim.min_lr`` is not scaled,
    as in DINO.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    return cfg.optim.lr * cfg.data.batch_size * world_size * cfg.optim.accumulation_steps / 256
