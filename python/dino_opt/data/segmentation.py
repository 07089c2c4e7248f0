"""Segmentation data: images paired with per-pixel label masks.

A :class:`SegmentationSource` is one split: an images folder and a masks
folder, searched recursively, whose files pair up by their path relative to
the folder without its extension (``images/a/b.jpg`` with ``masks/a/b.png``).
A mask is a single-channel PNG (mode ``L`` or ``P``) of the image's size
whose values are class indices; 255 marks pixels to ignore. Class names are
optional: with them, a value must be below their count (or 255).

:func:`segmentation_splits` finds the splits of a data root, in either of
two layouts::

    <root>/<split>/images/...  +  <root>/<split>/masks/...   (split: train, val, test)
    <root>/<split>/<class>/... +  <root>/masks/<split>/<class>/...   (the built-in data set)

Class names come from ``<root>/classes.txt`` or ``<root>/<split>/classes.txt``
(one name a line; line i names label i), or, for the built-in data set, from
its manifest (``background`` and the ten classes). Wrong input raises a
one-line ``ValueError`` or ``FileNotFoundError`` naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from .builtin import BUILTIN_MASKS
from .sources import IMAGE_EXTENSIONS

__all__ = [
    "IGNORE_INDEX",
    "SEGMENTATION_SPLITS",
    "SegmentationSource",
    "check_labels",
    "segmentation_splits",
]

#: The mask value of pixels that no metric or loss counts.
IGNORE_INDEX = 255
#: The split names :func:`segmentation_splits` looks for, in order.
SEGMENTATION_SPLITS = ("train", "val", "test")
_MASK_MODES = ("L", "P")


def _files_by_stem(folder: Path, extensions: Sequence[str], what: str) -> dict[str, Path]:
    """``{relative path without extension: file}`` of the files under
    ``folder`` with one of ``extensions`` (lower-cased), in sorted order."""
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in extensions or not path.is_file():
            continue
        stem = path.relative_to(folder).with_suffix("").as_posix()
        if stem in found:
            raise ValueError(
                f"two {what} files of one name in {str(folder)!r}: "
                f"{str(found[stem])!r} and {str(path)!r}"
            )
        found[stem] = path
    return found


def _folder(path: str | os.PathLike, what: str) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{what} folder {str(path)!r} does not exist")
    return path


class SegmentationSource:
    """One split of segmentation data: ``len(source)`` image/mask pairs.

    ``images`` and ``masks`` are folders (see the module docstring for how
    they pair up); ``classes`` the class names (label i is ``classes[i]``)
    or None; ``num_classes`` the number of labels when no names are given
    (None: not known, no range check). An image without a mask, a mask
    without an image and an empty images folder raise ``ValueError`` here;
    a mask of another size than its image or with a value out of range
    raises it when the pair is read (:meth:`read`)."""

    def __init__(
        self,
        images: str | os.PathLike,
        masks: str | os.PathLike,
        classes: Sequence[str] | None = None,
        num_classes: int | None = None,
    ) -> None:
        self.images_dir, self.masks_dir = _folder(images, "images"), _folder(masks, "masks")
        self.classes = None if classes is None else [str(c) for c in classes]
        self.num_classes = _num_classes(self.classes, num_classes)
        images_by_stem = _files_by_stem(self.images_dir, IMAGE_EXTENSIONS, "image")
        if not images_by_stem:
            raise ValueError(
                f"images folder {str(self.images_dir)!r} holds no images "
                f"({', '.join(IMAGE_EXTENSIONS)})"
            )
        masks_by_stem = _files_by_stem(self.masks_dir, (".png",), "mask")
        for stem, image in images_by_stem.items():
            if stem not in masks_by_stem:
                raise ValueError(
                    f"image {str(image)!r} has no mask: expected {str(self.masks_dir / stem)!r}.png"
                )
        extra = sorted(set(masks_by_stem) - set(images_by_stem))
        if extra:
            raise ValueError(
                f"mask {str(masks_by_stem[extra[0]])!r} has no image in "
                f"{str(self.images_dir)!r} ({len(extra)} such masks)"
            )
        self.pairs = [(images_by_stem[s], masks_by_stem[s]) for s in images_by_stem]

    def __len__(self) -> int:
        return len(self.pairs)

    def __repr__(self) -> str:
        return (
            f"SegmentationSource({str(self.images_dir)!r}, {str(self.masks_dir)!r}, "
            f"{len(self)} pairs, num_classes={self.num_classes})"
        )

    def read(self, index: int, num_classes: int | None = None) -> tuple[Image.Image, np.ndarray]:
        """Pair ``index``: the RGB image and its ``[H, W]`` uint8 mask,
        checked (same size; values below ``num_classes``, default the
        source's, or 255)."""
        image_path, mask_path = self.pairs[index]
        try:
            with Image.open(image_path) as im:
                image = im.convert("RGB")
            with Image.open(mask_path) as m:
                m.load()
                mode, mask = m.mode, np.asarray(m)
        except OSError as e:  # PIL's errors for a file it cannot read
            raise ValueError(f"cannot read {str(image_path)!r} or {str(mask_path)!r}: {e}") from e
        if mode not in _MASK_MODES:
            raise ValueError(
                f"mask {str(mask_path)!r} has mode {mode!r}; a mask is a "
                "single-channel PNG of class indices (mode L or P)"
            )
        if (mask.shape[1], mask.shape[0]) != image.size:
            raise ValueError(
                f"mask {str(mask_path)!r} is {mask.shape[1]}x{mask.shape[0]} but "
                f"its image {str(image_path)!r} is {image.size[0]}x{image.size[1]}"
            )
        check_labels(mask, num_classes if num_classes is not None else self.num_classes, mask_path)
        return image, mask


def check_labels(mask: np.ndarray, num_classes: int | None, name: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``name`` if ``mask`` holds a value that is
    neither below ``num_classes`` nor 255 (no check when it is None)."""
    if num_classes is None:
        return
    bad = mask[(mask >= num_classes) & (mask != IGNORE_INDEX)]
    if bad.size:
        raise ValueError(
            f"mask {str(name)!r} holds label {int(bad.max())}, out of range: "
            f"labels are 0..{num_classes - 1} (255: ignore)"
        )


def _num_classes(classes: list[str] | None, num_classes: int | None) -> int | None:
    if num_classes is not None and (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, int)
        or not 1 <= num_classes <= 255
    ):
        raise ValueError(f"num_classes must be an integer in 1..255, got {num_classes!r}")
    if classes is None:
        return num_classes
    if not classes or len(classes) > 255:
        raise ValueError(f"classes must name 1..255 classes, got {len(classes)}")
    if num_classes is not None and num_classes != len(classes):
        raise ValueError(f"num_classes={num_classes} but {len(classes)} class names were given")
    return len(classes)


# ---------------------------------------------------------------- data roots


def _read_classes(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not names:
        raise ValueError(f"class names file {str(path)!r} is empty")
    return names


def _builtin_classes(root: Path) -> list[str] | None:
    """The mask classes of a built-in data set's manifest (None: not one)."""
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    classes = manifest.get("mask_classes") if isinstance(manifest, dict) else None
    return [str(c) for c in classes] if isinstance(classes, list) else None


def _split_folders(root: Path, split: str) -> tuple[Path, Path] | None:
    """``(images, masks)`` of ``split`` in either layout, or None."""
    if (root / split / "images").is_dir() and (root / split / "masks").is_dir():
        return root / split / "images", root / split / "masks"
    if (root / split).is_dir() and (root / BUILTIN_MASKS / split).is_dir():
        return root / split, root / BUILTIN_MASKS / split
    return None


def _split_classes(root: Path, splits: Sequence[str]) -> list[str] | None:
    """The class names shared by every split; ``ValueError`` if two differ."""
    common = _read_classes(root / "classes.txt") or _builtin_classes(root)
    found = [(s, _read_classes(root / s / "classes.txt") or common) for s in splits]
    first_split, first = found[0]
    for split, classes in found[1:]:
        if classes != first:
            raise ValueError(
                f"classes differ between splits of {str(root)!r}: {first_split} has {first}, "
                f"{split} has {classes}"
            )
    return first


def segmentation_splits(root: str | os.PathLike) -> dict[str, SegmentationSource] | None:
    """The segmentation splits of a data root (layouts in the module
    docstring): ``{"train": source, "val": ..., "test": ...}`` for those of
    :data:`SEGMENTATION_SPLITS` that have images and masks, or None when the
    root has no masks (no ``train`` split with masks), so a caller can run a
    dense evaluation only where the data has masks. Every source has the
    same class names (``ValueError`` naming both splits when they differ)."""
    root = Path(root)
    if not root.is_dir():
        return None
    folders = {s: f for s in SEGMENTATION_SPLITS if (f := _split_folders(root, s)) is not None}
    if "train" not in folders:
        return None
    classes = _split_classes(root, list(folders))
    return {
        split: SegmentationSource(images, masks, classes)
        for split, (images, masks) in folders.items()
    }
