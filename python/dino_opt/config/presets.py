"""The hardware presets table: a training configuration by device memory;
and the demo preset (:data:`DEMO_PRESET`), what ``dino-opt train`` runs
without a config.

The table follows the course guide's "configurations by GPU" (batch size,
backbone and local crops for 8, 12, 16 and 24+ GB cards). A preset sets five
keys::

    data.batch_size  augmentation.num_local_views  model.backbone
    hardware.precision  hardware.activation_checkpointing

the first three from its row; precision and checkpointing depend on the card
and are decided when the preset is resolved for a device
(:func:`dino_opt.tune.resolve_hardware`). This module is data and pure
functions of it: nothing here looks at a device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = [
    "DEMO_PRESET",
    "PRESETS",
    "PRESET_KEYS",
    "PRESET_NAMES",
    "HardwarePreset",
    "preset_for_memory",
]

# The keys a preset sets, as section.key.
PRESET_KEYS = (
    "data.batch_size",
    "augmentation.num_local_views",
    "model.backbone",
    "hardware.precision",
    "hardware.activation_checkpointing",
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
# What hardware.preset takes: off, auto, or a row's name.
PRESET_NAMES = ("off", "auto", *PRESETS)
_GPU_ROWS = sorted((p for p in PRESETS.values() if p.memory_gb > 0), key=lambda p: p.memory_gb)


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


# The demo: the built-in data set, a small ViT and a short schedule, so that
# `dino-opt train` without a config finishes in minutes on a 2-core CPU.
DEMO_PRESET = {
    "data": {"batch_size": 64},
    "augmentation": {
        "global_crop_size": 64,
        "local_crop_size": 32,
        "num_local_views": 4,
        "global_crops_scale": [0.3, 1.0],
        "local_crops_scale": [0.05, 0.3],
        # DINO's blur sigma (0.1, 2) is in pixels of 224-pixel crops; at 64
        # pixels it wiped out the shapes of the always-blurred first view.
        "blur_sigma": [0.05, 0.6],
    },
    "model": {
        "backbone": "vit_tiny",
        "patch_size": 16,
        "drop_path_rate": 0.0,
        "out_dim": 1024,
        "hidden_dim": 512,
        "bottleneck_dim": 128,
    },
    "optim": {"lr": 0.002, "weight_decay": 0.04, "weight_decay_end": 0.1},
    # A short run needs a teacher that follows the student more closely
    # than DINO's 0.996 (an average over ~250 of its 100k+ steps): with 0.99
    # over 93-240 steps the teacher stayed mostly its random initialisation
    # and ended 6-9 k-NN points below the student; 0.9 collapsed its output.
    "schedule": {"epochs": 8, "warmup_epochs": 2, "momentum_teacher": 0.97},
    "logging": {"log_every": 5},
}
