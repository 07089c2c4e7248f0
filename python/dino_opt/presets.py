"""Hardware presets: a training configuration chosen from the device's memory.

The table follows the course guide's "configurations by GPU" (batch size,
backbone and local crops for 8, 12, 16 and 24+ GB cards) and adds what the
guide leaves implicit: the autocast precision the card supports and whether
gradient checkpointing is needed. A preset sets five keys::

    data.batch_size  augmentation.num_local_views  model.backbone
    hardware.precision  hardware.grad_checkpointing

``hardware.preset: auto`` (or the YAML shorthand ``hardware: auto``) picks the
row from the memory of the device training will use; a row's name
(``hardware.preset: 12gb``) picks it by hand. Keys the configuration sets
itself win over the preset's. ``dino-opt presets`` prints the table and what
``auto`` resolves to on this machine; ``--measure`` refines the batch size by
timing real training steps (:class:`~dino_opt.throughput.ThroughputOptimizer`).

For a ViT row, :func:`~dino_opt.throughput.dynamic_batch_size` gives a first
guess of the largest batch the memory holds; when it is below the row's batch
size, the preset turns gradient checkpointing on (it keeps one block's
activations instead of twelve). ResNet rows never need it at these sizes and
the estimator models ViTs only.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PRESETS",
    "PRESET_KEYS",
    "HardwarePreset",
    "PresetChoice",
    "detect_device_memory",
    "measure_batch_size",
    "preset_for_memory",
    "resolve_preset",
]

# The keys a preset sets, as section.key.
PRESET_KEYS = (
    "data.batch_size",
    "augmentation.num_local_views",
    "model.backbone",
    "hardware.precision",
    "hardware.grad_checkpointing",
)

# A card sold as N GB reports a little less (a 24 GB RTX 3090: 23.7 GiB; an
# "8 GB" card: 7.8 GiB), so a row applies from this fraction of its size.
_REPORTED_FRACTION = 0.9


@dataclass(frozen=True)
class HardwarePreset:
    """One row of the table: what to train with on ``memory_gb`` of device memory."""

    name: str
    memory_gb: float  # nominal size the row is for (0 for the CPU row)
    backbone: str
    batch_size: int
    num_local_views: int
    note: str

    @property
    def min_memory_gb(self) -> float:
        """The least reported memory (GiB) the row applies from."""
        return _REPORTED_FRACTION * self.memory_gb


PRESETS: dict[str, HardwarePreset] = {
    p.name: p
    for p in (
        HardwarePreset(
            "cpu", 0, "vit_tiny", 16, 4, "no GPU: a small ViT that trains in minutes per epoch"
        ),
        HardwarePreset("8gb", 8, "resnet18", 16, 4, "GTX 1080, RTX 2080, RTX 3060/3070"),
        HardwarePreset("12gb", 12, "resnet18", 32, 6, "RTX 3080 12 GB, RTX 4070"),
        HardwarePreset("16gb", 16, "resnet50", 32, 6, "V100 16 GB, RTX 4080, T4"),
        HardwarePreset(
            "24gb", 24, "vit_small", 64, 8, "RTX 3090/4090, A100, H100: DINO's ViT-S/16 recipe"
        ),
    )
}
_GPU_ROWS = sorted((p for p in PRESETS.values() if p.memory_gb > 0), key=lambda p: p.memory_gb)


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


def preset_for_memory(memory_gb: float | None) -> HardwarePreset:
    """The row for a device with ``memory_gb`` GiB (None: no GPU, the CPU row).

    Below the smallest row, the smallest row with its batch size scaled down
    with the memory (a power of two, at least 2)."""
    if memory_gb is None:
        return PRESETS["cpu"]
    if not memory_gb > 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb!r}")
    fitting = [p for p in _GPU_ROWS if memory_gb >= p.min_memory_gb]
    if fitting:
        return fitting[-1]
    small = _GPU_ROWS[0]
    batch = small.batch_size * memory_gb / small.memory_gb
    power = 2
    while power * 2 <= batch:
        power *= 2
    return dataclasses.replace(
        small, batch_size=power, note=f"{small.note}; batch scaled to {memory_gb:.1f} GiB"
    )


def detect_device_memory(device: str = "auto") -> tuple[str, float | None, bool | None]:
    """``(device, memory in GiB, bf16 supported)`` of a ``hardware.device``
    value ('auto', 'cpu', 'cuda', 'cuda:N'); memory and bf16 are None on the
    CPU."""
    import torch

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
    import torch

    from .models import build_backbone

    with torch.device("meta"):
        model, dim = build_backbone(backbone, patch_size=patch_size)
    return dim, len(model.blocks)


def resolve_preset(
    name: str,
    *,
    device: str = "auto",
    memory_gb: float | None = None,
    bf16: bool | None = None,
    global_crop_size: int = 224,
    local_crop_size: int = 96,
    patch_size: int = 16,
    fixed: dict[str, Any] | None = None,
) -> PresetChoice:
    """The values of preset ``name`` ('auto' or a row of :data:`PRESETS`).

    The memory and bfloat16 support are read from ``device`` unless
    ``memory_gb`` is given (then the device is taken to be a GPU of that
    size; ``bf16`` says whether it supports bfloat16, default yes). ``auto``
    picks the row from the memory. Precision is bf16 on cards with bfloat16
    (Ampere and later), fp16 on older ones, ``auto`` for a GPU row on a
    machine without a GPU, and fp32 for the CPU row. The crop sizes feed the
    memory estimate of ViT rows; ``fixed`` holds the keys of
    :data:`PRESET_KEYS` the configuration sets itself, which the estimate
    uses in place of the row's (``values`` still lists the row's).
    """
    from .throughput import dynamic_batch_size

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
    if row.name == "cpu":
        precision = "fp32"  # autocast on a CPU is slower than float32 on most
    elif has_bf16 is None:
        precision = "auto"
    else:
        precision = "bf16" if has_bf16 else "fp16"

    values = {
        "data.batch_size": row.batch_size,
        "augmentation.num_local_views": row.num_local_views,
        "model.backbone": row.backbone,
        "hardware.precision": precision,
        "hardware.grad_checkpointing": False,
    }
    used = {**values, **(fixed or {})}  # what training will run with
    estimate = None
    if used["model.backbone"].startswith("vit") and memory is not None:
        dim, depth = _vit_shape(used["model.backbone"], patch_size)
        estimate = dynamic_batch_size(
            memory,
            global_crop_size,
            dim,
            patch_size=patch_size,
            depth=depth,
            n_local=used["augmentation.num_local_views"],
            local_resolution=local_crop_size,
            bytes_per_value=4 if used["hardware.precision"] == "fp32" else 2,
        )
        values["hardware.grad_checkpointing"] = (
            row.name != "cpu" and estimate < used["data.batch_size"]
        )
    checkpointing = values["hardware.grad_checkpointing"]
    size = "no GPU" if memory is None else f"{memory:.1f} GiB"
    how = "chosen by memory" if name == "auto" else "named"
    reason = f"preset {row.name} ({how}; device {where}, {size})"
    if estimate is not None:
        reason += f"; memory estimate: batch <= {estimate}"
        if checkpointing:
            reason += ", below the batch size, so gradient checkpointing is on"
    return PresetChoice(row, values, where, memory, estimate, reason)


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
    (:meth:`~dino_opt.throughput.ThroughputOptimizer.find_optimal_batch_size`,
    random crops of the configured sizes) up to ``max_batch_size`` (default
    twice ``cfg.data.batch_size``). Returns the search's result."""
    import torch

    from .throughput import ThroughputOptimizer
    from .trainer import DINOModel, build_loss, build_models, resolve_device

    device = resolve_device(cfg.hardware.device)
    a = cfg.augmentation
    student, teacher = build_models(cfg)
    generator = torch.Generator().manual_seed(cfg.hardware.seed)
    crops = [
        torch.randn(1, 3, side, side, generator=generator)
        for side in [a.global_crop_size] * 2 + [a.local_crop_size] * a.num_local_views
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
