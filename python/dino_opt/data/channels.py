"""Images that are not 8-bit RGB: their layout and their per-channel statistics.

A data set read with ``image_mode="native"`` keeps every image's stored depth
(uint8, uint16, float32) and channel count; its *layout* is that of its first
image, and every other image must share it. Such data has no ImageNet mean
and std: :func:`channel_stats` measures them on a sample of the images (the
loader does it when none are given, ``dino-opt prepare`` writes them beside
prepared data) in the units the loader normalises, ``value / 255``,
``value / 65535`` or the float as stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..ops.library import IMAGENET_MEAN, IMAGENET_STD
from ..ops.native import _C

__all__ = [
    "RGB_ONLY_AUGMENT_KEYS",
    "STATS_FILE",
    "ImageLayout",
    "channel_stats",
    "data_set_layout",
    "normalisation",
    "read_stats_file",
    "write_stats_file",
]

#: The photometric options that are RGB's (colour jitter's saturation and
#: hue, grayscale, solarisation): refused for images of another layout.
RGB_ONLY_AUGMENT_KEYS = ("saturation", "hue", "grayscale_p", "solarize_p_global2")
#: The file beside a prepared data set that records its layout and statistics.
STATS_FILE = "channel_stats.json"
_SCALES = {"uint8": 255.0, "uint16": 65535.0, "float32": 1.0}


class ImageLayout(NamedTuple):
    """What every image of a data set read at its stored depth shares."""

    channels: int
    dtype: str  # "uint8", "uint16", "float32"
    first: str  # the image that set it

    @property
    def rgb8(self) -> bool:
        """3-channel uint8: the 8-bit RGB stage (colour jitter and all)."""
        return self.channels == 3 and self.dtype == "uint8"

    @property
    def scale(self) -> float:
        """The value that maps to 1 before normalisation."""
        return _SCALES[self.dtype]

    def describe(self) -> str:
        return f"{self.channels}-channel {self.dtype}"


def data_set_layout(source, max_pixels: int = 178_956_970, tries: int = 1) -> ImageLayout:
    """The layout of ``source`` (a :class:`~dino_opt.data.DataSource`): its
    first image's, or of the first of ``tries`` that decodes. Raises
    ``ValueError`` naming the image when none does."""
    return ImageLayout(*_C.data_set_layout(source.native, max_pixels=max_pixels, tries=tries))


def channel_stats(
    source, layout: ImageLayout | None = None, max_images: int = 64
) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of ``source``'s images (all their pixels, in
    the loader's units: ``value / layout.scale``), over ``max_images`` images
    spread evenly over the data set (all of them when it is smaller),
    accumulated in float64. Images that do not decode are skipped; none
    decoding raises ``ValueError``."""
    layout = layout or data_set_layout(source)
    n = len(source)
    picks = np.unique(np.linspace(0, n - 1, num=min(n, max_images)).round().astype(np.int64))
    total = np.zeros(layout.channels)
    total_sq = np.zeros(layout.channels)
    count = 0
    for i in picks.tolist():
        try:
            image = _C.decode_raw(source.read(i))
        except ValueError:
            continue
        if image.shape[2] != layout.channels:
            continue
        values = image.to(torch.float64).reshape(-1, layout.channels).numpy() / layout.scale
        total += values.sum(axis=0)
        total_sq += (values * values).sum(axis=0)
        count += values.shape[0]
    if count == 0:
        raise ValueError(f"no image of {source.describe(0)}'s data set decodes: no statistics")
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean * mean, 0.0))
    # A constant channel gets std 1 (normalising it by 0 is undefined).
    std = np.where(std > 0, std, 1.0)
    return [float(v) for v in mean], [float(v) for v in std]


def write_stats_file(folder: str | Path, layout: ImageLayout, mean, std, **extra) -> Path:
    """Writes ``channel_stats.json`` into ``folder``: the layout, the mean and
    std, and ``extra`` (what ``prepare`` records: a DICOM window, counts)."""
    path = Path(folder) / STATS_FILE
    record = {
        "channels": layout.channels,
        "dtype": layout.dtype,
        "mean": list(mean),
        "std": list(std),
        **extra,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_stats_file(folder: str | Path) -> dict | None:
    """``channel_stats.json`` of ``folder`` (or of its parent, for a split
    folder), or None where there is none."""
    for candidate in (Path(folder), Path(folder).parent):
        path = candidate / STATS_FILE
        if candidate.is_dir() and path.is_file():
            return json.loads(path.read_text())
    return None


def normalisation(source, layout: ImageLayout | None, mean=None, std=None) -> tuple[list, list]:
    """The mean and std a loader of ``source`` normalises with: as given
    (one per channel), else ImageNet's for 8-bit RGB (``layout`` None, or a
    3-channel uint8 one), else those ``prepare`` recorded beside a folder
    (``channel_stats.json``), else measured (:func:`channel_stats`). Raises
    ``ValueError`` in one line for one of them alone or a wrong length."""
    rgb = layout is None or layout.rgb8
    channels = 3 if rgb else layout.channels
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std, or neither")
    if mean is None:
        recorded = read_stats_file(source.spec) if not rgb and source.format == "folder" else None
        if rgb:
            mean, std = IMAGENET_MEAN, IMAGENET_STD
        elif recorded and recorded.get("channels") == channels:
            mean, std = recorded["mean"], recorded["std"]
        else:
            mean, std = channel_stats(source, layout)
    mean, std = [float(v) for v in mean], [float(v) for v in std]
    if len(mean) != channels or len(std) != channels:
        what = f"{layout.describe()} images ({layout.first})" if layout else "8-bit RGB images"
        raise ValueError(
            f"mean and std have {len(mean)} and {len(std)} values, but {what} need {channels}"
        )
    return mean, std
