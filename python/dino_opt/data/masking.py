"""DINOv2's block masks of the global crops' patch tokens (its iBOT loss).

A mask of a ``height x width`` patch grid grows by random rectangles until it
holds the requested number of patches (never more); a batch masks
``int(n_crops * probability)`` of its global crops, the i-th of them with a
share drawn from the i-th of as many equal bins of the ratio range, in a
shuffled order.

Two routes give a training step the same inputs:

* the native loader: ``MultiCropLoader(..., masks=dict(patch_size=14))``
  draws the masks in its threads with the crops (``Batch.masks``, bool
  ``[2B, gh, gw]``), and :func:`mask_targets` derives the token indices and
  weights from them on their device;
* the drop-ins for DINOv2's Python pipeline: :class:`MaskingGenerator` (draws
  from Python's ``random``, as DINOv2's does) and
  :func:`collate_data_and_cast` (same arguments, same output keys).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "MASK_KEYS",
    "MaskingGenerator",
    "collate_data_and_cast",
    "mask_options",
    "mask_targets",
    "mask_upperbound",
]

#: The keys of ``MultiCropLoader(masks={...})`` and their defaults (DINOv2's
#: ``ibot.mask_ratio_min_max`` and ``ibot.mask_sample_probability``; the
#: rectangles of its ``MaskingGenerator``). ``patch_size`` has no default: it
#: must be the model's. ``max_num_patches=None``: half the grid;
#: ``max_aspect=None``: ``1 / min_aspect``.
MASK_KEYS = {
    "patch_size": None,
    "ratio": (0.1, 0.5),
    "probability": 0.5,
    "min_num_patches": 4,
    "max_num_patches": None,
    "min_aspect": 0.3,
    "max_aspect": None,
}


class MaskingGenerator:
    """Block masks of an ``input_size`` patch grid (an int for a square one),
    a drop-in for DINOv2's generator of the same name.

    ``generator(n)`` returns a numpy bool ``[height, width]`` mask of at most
    ``n`` patches, grown by rectangles of area uniform in ``[min_num_patches,
    min(remaining, max_num_patches)]`` and log aspect ratio uniform in
    ``[log min_aspect, log max_aspect]`` (``max_aspect`` defaults to
    ``1 / min_aspect``), each strictly narrower and shorter than the grid and
    adding at least one new patch (10 tries per rectangle); it stops early
    when no rectangle fits. Draws from Python's ``random`` in DINOv2's order,
    so ``random.seed`` reproduces its masks.
    """

    def __init__(
        self,
        input_size: int | tuple[int, int],
        num_masking_patches: int | None = None,
        min_num_patches: float = 4,
        max_num_patches: float | None = None,
        min_aspect: float = 0.3,
        max_aspect: float | None = None,
    ):
        self.height, self.width = input_size if isinstance(input_size, tuple) else (input_size,) * 2
        self.num_patches = self.height * self.width
        self.num_masking_patches = num_masking_patches
        self.min_num_patches = min_num_patches
        self.max_num_patches = num_masking_patches if max_num_patches is None else max_num_patches
        self.log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect or 1 / min_aspect))

    def __repr__(self) -> str:
        lo, hi = self.log_aspect_ratio
        return (
            f"MaskingGenerator({self.height}, {self.width} -> [{self.min_num_patches} ~ "
            f"{self.max_num_patches}], max = {self.num_masking_patches}, {lo:.3f} ~ {hi:.3f})"
        )

    def get_shape(self) -> tuple[int, int]:
        return self.height, self.width

    def __call__(self, num_masking_patches: int = 0) -> np.ndarray:
        mask = np.zeros(self.get_shape(), dtype=bool)
        masked = 0
        while masked < num_masking_patches:
            limit = num_masking_patches - masked
            if self.max_num_patches is not None:
                limit = min(limit, self.max_num_patches)
            added = self._add_rectangle(mask, limit)
            if added == 0:
                break
            masked += added
        return mask

    def _add_rectangle(self, mask: np.ndarray, limit: float) -> int:
        """Up to 10 tries at a rectangle adding 1..limit new patches; the
        patches it added (0: none fitted)."""
        for _ in range(10):
            area = random.uniform(self.min_num_patches, limit)
            aspect = math.exp(random.uniform(*self.log_aspect_ratio))
            h = round(math.sqrt(area * aspect))
            w = round(math.sqrt(area / aspect))
            if h >= self.height or w >= self.width:
                continue
            top = random.randint(0, self.height - h)
            left = random.randint(0, self.width - w)
            block = mask[top : top + h, left : left + w]
            added = h * w - int(block.sum())
            if 0 < added <= limit:
                block[...] = True
                return added
        return 0


def _crops_of(sample: Any) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """(global crops, local crops) of a DINOv2 sample ``({"global_crops": [...],
    "local_crops": [...]}, label)`` or of a :class:`MultiCropDataset` item
    ``{"crops": [global_1, global_2, local...], ...}``."""
    if isinstance(sample, dict) and "crops" in sample:
        return sample["crops"][:2], sample["crops"][2:]
    return sample[0]["global_crops"], sample[0]["local_crops"]


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors) if tensors else torch.empty(0)


def collate_data_and_cast(
    samples_list: Sequence[Any],
    mask_ratio_tuple: tuple[float, float],
    mask_probability: float,
    dtype: torch.dtype,
    n_tokens: int | None = None,
    mask_generator: MaskingGenerator | None = None,
) -> dict:
    """DINOv2's collate: the crops stacked view-major and cast to ``dtype``,
    and the masks of the global crops drawn with ``mask_generator``.

    ``samples_list`` holds DINOv2's samples (``(crops dict, label)`` tuples) or
    :class:`~dino_opt.data.MultiCropDataset` items. ``n_tokens`` defaults to
    the generator's grid size. Returns ``collated_global_crops``,
    ``collated_local_crops``, ``collated_masks`` (bool ``[n_global, n_tokens]``)
    and the quantities :func:`mask_targets` describes. Draws from Python's
    ``random`` in DINOv2's order.
    """
    if mask_generator is None:
        raise ValueError("mask_generator is required (a MaskingGenerator of the patch grid)")
    n = mask_generator.num_patches if n_tokens is None else int(n_tokens)
    crops = [_crops_of(s) for s in samples_list]
    n_global, n_local = len(crops[0][0]), len(crops[0][1])
    global_crops = _stack([c[0][i] for i in range(n_global) for c in crops])
    local_crops = _stack([c[1][i] for i in range(n_local) for c in crops])
    n_crops = len(global_crops)
    n_masked = int(n_crops * mask_probability)
    # float32 edges and draws, as DINOv2 computes them.
    edges = torch.linspace(*mask_ratio_tuple, n_masked + 1)
    masks = [
        torch.from_numpy(mask_generator(int(n * random.uniform(edges[i], edges[i + 1]))))
        for i in range(n_masked)
    ]
    masks += [torch.from_numpy(mask_generator(0)) for _ in range(n_masked, n_crops)]
    random.shuffle(masks)
    targets = mask_targets(torch.stack(masks), mask_ratio_tuple, mask_probability)
    return {
        "collated_global_crops": global_crops.to(dtype),
        "collated_local_crops": local_crops.to(dtype),
        **targets,
    }


def mask_upperbound(
    n_crops: int, n_tokens: int, mask_ratio_tuple: tuple[float, float], mask_probability: float
) -> int:
    """The most masked tokens a batch's plan can ask for: the sum over its
    masked crops of ``int(n_tokens * upper edge of the crop's bin)`` (DINOv2's
    ``upperbound``, computed as its collate does)."""
    n_masked = int(n_crops * mask_probability)
    edges = torch.linspace(*mask_ratio_tuple, n_masked + 1)
    return sum(int(n_tokens * edges[i + 1]) for i in range(n_masked))


def mask_targets(
    masks: torch.Tensor,
    mask_ratio_tuple: tuple[float, float] = (0.1, 0.5),
    mask_probability: float = 0.5,
) -> dict:
    """What DINOv2's collate derives from a batch's masks, on their device.

    ``masks``: bool ``[n_crops, gh, gw]`` (``Batch.masks`` of the native
    loader, or stacked :class:`MaskingGenerator` masks). Returns
    ``collated_masks`` (``[n_crops, gh * gw]``), ``mask_indices_list`` (int64:
    the masked tokens' flat indices over the ``n_crops * gh * gw`` tokens),
    ``masks_weight`` (float32, per masked token ``1 /`` its crop's masked
    count), ``n_masked_patches`` (int64 ``[1]``) and ``upperbound`` (int:
    :func:`mask_upperbound` of the ratio and probability the masks were drawn
    with, never below the masked count).
    """
    if masks.dtype != torch.bool or masks.dim() != 3:
        raise ValueError(
            f"masks must be a bool [n_crops, gh, gw] tensor, got {masks.dtype} {tuple(masks.shape)}"
        )
    flat = masks.flatten(1)
    n_tokens = flat.shape[1]
    indices = flat.flatten().nonzero().flatten()
    per_crop = 1.0 / flat.sum(-1).clamp(min=1.0)
    bound = mask_upperbound(flat.shape[0], n_tokens, mask_ratio_tuple, mask_probability)
    return {
        "collated_masks": flat,
        "mask_indices_list": indices,
        "masks_weight": per_crop[indices // n_tokens],
        "upperbound": max(bound, indices.shape[0]),
        "n_masked_patches": torch.full(
            (1,), indices.shape[0], dtype=torch.long, device=masks.device
        ),
    }


def _number(name: str, value: Any, kind: type) -> Any:
    allowed = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, allowed):
        what = "a number" if kind is float else "an int"
        raise ValueError(f"masks[{name!r}] must be {what}, got {value!r}")
    return kind(value)


def mask_options(masks: dict | None) -> dict:
    """``MultiCropLoader``'s ``masks`` argument checked and completed with
    :data:`MASK_KEYS`' defaults (``{}`` when ``masks`` is None: no masks).
    Raises ``ValueError`` naming the key; the native loader checks the ranges
    (and that ``patch_size`` divides ``global_size``)."""
    if masks is None:
        return {}
    if not isinstance(masks, dict):
        raise ValueError(f"masks must be a dict of {', '.join(MASK_KEYS)} or None, got {masks!r}")
    unknown = sorted(set(masks) - set(MASK_KEYS))
    if unknown:
        raise ValueError(f"unknown masks keys {unknown}; known: {', '.join(MASK_KEYS)}")
    if "patch_size" not in masks:
        raise ValueError(
            "masks needs 'patch_size', the model's (the grid is global_size / patch_size)"
        )
    options = {**MASK_KEYS, **masks}
    try:
        lo, hi = (float(v) for v in options["ratio"])
    except (TypeError, ValueError):
        raise ValueError(
            f"masks['ratio'] must be a pair of floats, got {options['ratio']!r}"
        ) from None
    out = {"patch_size": _number("patch_size", options["patch_size"], int), "ratio": (lo, hi)}
    for key in ("probability", "min_num_patches", "min_aspect"):
        out[key] = _number(key, options[key], float)
    for key in ("max_num_patches", "max_aspect"):
        out[key] = None if options[key] is None else _number(key, options[key], float)
    return out
