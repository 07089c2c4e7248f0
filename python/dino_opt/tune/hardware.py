"""Choosing a training configuration for this machine's hardware: the
device's memory and bfloat16 support, the hardware preset resolved for it
(the table is :mod:`dino_opt.config.presets`), and the batch size refined by
measurement.

``hardware.preset: auto`` (or the YAML shorthand ``hardware: auto``) picks the
row from the memory of the device training will use; a row's name
(``hardware.preset: 12gb``) picks it by hand. Keys the configuration sets
itself win over the preset's. Precision is bf16 on cards with bfloat16
(Ampere and later), fp16 on older ones, fp32 for the CPU row. For a ViT row,
:func:`~dino_opt.tune.dynamic_batch_size` gives a first guess of the
largest batch the memory holds; when it is below the row's batch size, the
preset turns gradient checkpointing on (it keeps one block's activations
instead of twelve). ResNet rows never need it at these sizes and the
estimator models ViTs only.

Loading a config never probes a device; :func:`resolve_hardware` is the one
explicit step that does, once per process tree (the training job resolves it
on its first process and hands the result to the others). ``dino-opt
presets`` prints the table and what ``auto`` resolves to here; ``--measure``
refines the batch size by timing real training steps
(:class:`~dino_opt.tune.ThroughputOptimizer`).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import (
    PRESET_KEYS,
    PRESETS,
    Config,
    ConfigError,
    HardwarePreset,
    apply_overrides,
    preset_for_memory,
)
from ..models import build_backbone
from ..runtime import computes_bf16, resolve_device
from ..train import DINOModel, build_loss, build_models
from .throughput import ThroughputOptimizer, dynamic_batch_size

__all__ = [
    "PresetChoice",
    "detect_device_memory",
    "measure_batch_size",
    "resolve_hardware",
    "resolve_preset",
]


@dataclass(frozen=True)
class PresetChoice:
    """A preset resolved for one device: ``values`` maps each of
    :data:`PRESET_KEYS` to its value; ``reason`` says how it was chosen."""

    preset: HardwarePreset
    values: dict[str, Any]
    device: str
    memory_gb: float | None
    estimated_max_batch: int | None
    reason: str

    def overrides(self) -> list[str]:
        """The values as ``section.key=value`` overrides."""
        out = []
        for key, value in self.values.items():
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out.append(f"{key}={text}")
        return out


def detect_device_memory(device: str = "auto") -> tuple[str, float | None, bool | None]:
    """``(device, memory in GiB, bf16 supported)`` of a ``hardware.device``
    value ('auto', 'cpu', 'cuda', 'cuda:N'); memory and bf16 are None on the
    CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu", None, None
    if not torch.cuda.is_available():
        raise ValueError(f"hardware.device={device} but CUDA is not available")
    index = torch.device(device).index if device not in ("auto", "cuda") else None
    if index is None:
        index = torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"hardware.device={device} but only {torch.cuda.device_count()} CUDA devices exist"
        )
    props = torch.cuda.get_device_properties(index)
    bf16 = props.major >= 8  # Ampere and later
    return f"cuda:{index} ({props.name})", props.total_memory / 2**30, bf16


def _vit_shape(backbone: str, patch_size: int) -> tuple[int, int]:
    """(embed_dim, depth) of a ViT backbone, built on the meta device (no memory)."""
    with torch.device("meta"):
        model, dim = build_backbone(backbone, patch_size=patch_size)
    return dim, len(model.blocks)


def _precision(row: HardwarePreset, has_bf16: bool | None) -> str:
    """The precision of preset ``row`` on a device with (``has_bf16``) or
    without bfloat16 (None: not known, no GPU here)."""
    if row.name == "cpu":
        # resolved here, so that the run folder's config names what ran
        return "bf16" if computes_bf16(torch.device("cpu")) else "fp32"
    if has_bf16 is None:
        return "auto"
    return "bf16" if has_bf16 else "fp16"


def _batch_estimate(
    used: dict[str, Any],
    memory: float | None,
    crops: tuple[int | Sequence[int], int | Sequence[int]],
    patch_size: int,
) -> int | None:
    """The memory estimate of the largest batch for the values training
    will run with (``used``) on ``memory`` GiB, at the largest (global,
    local) crop sides of ``crops``; None for a CNN or without a GPU."""
    if not used["model.backbone"].startswith("vit") or memory is None:
        return None
    global_crop_size, local_crop_size = (max(s) if isinstance(s, Sequence) else s for s in crops)
    dim, depth = _vit_shape(used["model.backbone"], patch_size)
    return dynamic_batch_size(
        memory,
        global_crop_size,
        dim,
        patch_size=patch_size,
        depth=depth,
        n_local=used["augmentation.num_local_views"],
        local_resolution=local_crop_size,
        bytes_per_value=4 if used["hardware.precision"] == "fp32" else 2,
    )


def resolve_preset(
    name: str,
    *,
    device: str = "auto",
    memory_gb: float | None = None,
    bf16: bool | None = None,
    global_crop_size: int | Sequence[int] = 224,
    local_crop_size: int | Sequence[int] = 96,
    patch_size: int = 16,
    fixed: dict[str, Any] | None = None,
) -> PresetChoice:
    """The values of preset ``name`` ('auto' or a row of :data:`PRESETS`).

    The memory and bfloat16 support are read from ``device`` unless
    ``memory_gb`` is given (then the device is taken to be a GPU of that
    size; ``bf16`` says whether it supports bfloat16, default yes). ``auto``
    picks the row from the memory. Precision is bf16 on cards with bfloat16
    (Ampere and later), fp16 on older ones, ``auto`` for a GPU row on a
    machine without a GPU, and for the CPU row bf16 where this CPU computes
    bfloat16 natively (avx512_bf16 or AMX), else fp32. The crop sizes feed the
    memory estimate of ViT rows (lists, one side per crop-size pair: the
    largest); ``fixed`` holds the keys of :data:`PRESET_KEYS` the
    configuration sets itself, which the estimate uses in place of the
    row's (``values`` still lists the row's).
    """
    if name not in ("auto", *PRESETS):
        close = difflib.get_close_matches(str(name).lower(), ["auto", *PRESETS], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(
            f"hardware.preset must be one of off, auto, {', '.join(PRESETS)}; got {name!r}{hint}"
        )
    if memory_gb is not None:
        where, memory = "a GPU (memory given)", float(memory_gb)
        has_bf16 = True if bf16 is None else bf16
        if not memory > 0:
            raise ValueError(f"memory_gb must be > 0, got {memory_gb!r}")
    else:
        where, memory, has_bf16 = detect_device_memory(device)

    row = preset_for_memory(memory) if name == "auto" else PRESETS[name]
    values = {
        "data.batch_size": row.batch_size,
        "augmentation.num_local_views": row.num_local_views,
        "model.backbone": row.backbone,
        "hardware.precision": _precision(row, has_bf16),
        "hardware.activation_checkpointing": "none",
    }
    used = {**values, **(fixed or {})}  # what training will run with
    crops = (global_crop_size, local_crop_size)
    estimate = _batch_estimate(used, memory, crops, patch_size)
    if estimate is not None:
        short = row.name != "cpu" and estimate < used["data.batch_size"]
        values["hardware.activation_checkpointing"] = "full" if short else "none"
    checkpointing = values["hardware.activation_checkpointing"] != "none"
    size = "no GPU" if memory is None else f"{memory:.1f} GiB"
    how = "chosen by memory" if name == "auto" else "named"
    reason = f"preset {row.name} ({how}; device {where}, {size})"
    if estimate is not None:
        reason += f"; memory estimate: batch <= {estimate}"
        if checkpointing:
            reason += ", below the batch size, so (full) activation checkpointing is on"
    return PresetChoice(row, values, where, memory, estimate, reason)


def resolve_hardware(cfg: Config) -> tuple[Config, PresetChoice | None]:
    """The one step that turns ``hardware.preset`` into values: for a config
    with a preset (``auto`` or a row), the config with the preset's keys that
    it does not set itself (:attr:`~dino_opt.config.Config.given_keys`) filled
    in for its device, and ``hardware.preset`` then ``off``, so that the
    result is self-contained (a run folder's ``config.yaml`` reloads to the
    same values on any machine, and processes given it resolve nothing
    again); and the choice. Without a preset: ``(cfg, None)``.

    ``hardware.compile: null`` (the default) is resolved here too: true where
    the device is a GPU, false on the CPU (where per-block compilation did
    not pay: docs/training.md#the-step), so that the run folder says what ran
    and the tools that rebuild a model from a run's config (k-NN, a frozen
    teacher, the memory model) never compile it unasked.

    Raises :class:`~dino_opt.config.ConfigError` naming the preset when it
    cannot be resolved (e.g. ``hardware.device=cuda`` without CUDA)."""
    if cfg.hardware.compile is None:
        on_gpu = cfg.hardware.device != "cpu" and torch.cuda.is_available()
        cfg = apply_overrides(cfg, [f"hardware.compile={str(on_gpu).lower()}"])
    name = cfg.hardware.preset
    if name == "off":
        return cfg, None
    try:
        choice = resolve_preset(
            name,
            device=cfg.hardware.device,
            global_crop_size=cfg.augmentation.global_crop_size,
            local_crop_size=cfg.augmentation.local_crop_size,
            patch_size=cfg.model.patch_size,
            fixed={key: _value(cfg, key) for key in PRESET_KEYS if key in cfg.given_keys},
        )
    except ValueError as e:
        raise ConfigError(f"hardware.preset={name}: {e}") from None
    own = [
        o
        for o, key in zip(choice.overrides(), choice.values, strict=True)
        if key not in cfg.given_keys
    ]
    return apply_overrides(cfg, [*own, "hardware.preset=off"]), choice


def _value(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def measure_batch_size(
    cfg,
    *,
    max_batch_size: int | None = None,
    target_memory_fraction: float = 0.9,
    steps: int = 3,
    warmup: int = 1,
) -> dict:
    """Refines ``cfg``'s batch size by measurement: times real training steps
    of ``cfg``'s model, crops and precision on ``cfg.hardware.device``
    (:meth:`~dino_opt.tune.ThroughputOptimizer.find_optimal_batch_size`,
    random crops of the configured sizes, with crop-size pairs the largest)
    up to ``max_batch_size`` (default twice ``cfg.data.batch_size``).
    Returns the search's result."""
    device = resolve_device(cfg.hardware.device)
    a = cfg.augmentation
    student, teacher = build_models(cfg)
    generator = torch.Generator().manual_seed(cfg.hardware.seed)
    global_side, local_side = a.largest_crop_sizes  # crop-size pairs: the largest
    crops = [
        torch.randn(1, 3, side, side, generator=generator)
        for side in [global_side] * 2 + [local_side] * a.num_local_views
    ]
    search = ThroughputOptimizer(
        DINOModel(student, teacher), device, loss_fn=build_loss(cfg), config=cfg
    )
    return search.find_optimal_batch_size(
        [crops],
        max_batch_size=max_batch_size or 2 * cfg.data.batch_size,
        target_memory_fraction=target_memory_fraction,
        steps=steps,
        warmup=warmup,
    )
