"""Probes of any weights: the backbone of a run, a checkpoint or weights in
any format :func:`~dino_opt.weights.read_weights` reads, with the data to
judge it on (``dino-opt eval linear|dense``, ``dino-opt show``).

:func:`open_backbone` builds the backbone the weights hold and loads them;
:func:`probe_data` finds the labelled splits (``--data ROOT`` with
``train/``, ``val/`` and ``test/``, or the data of a run's config);
:func:`run_linear_probe` and :func:`run_dense_probe` run the probes of
:mod:`dino_opt.eval` on them, :func:`show_weights` draws their pictures.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from torch import nn

from ..config import Config
from ..data import segmentation_splits, source_exists
from ..eval import ProbeData, dense_probe, linear_probe, load_checkpoint, show
from ..runtime import resolve_device
from ..train import data_roots
from .reading import read_weights
from .transfer import evaluation_backbone, load_strict

__all__ = ["OpenedBackbone", "open_backbone", "probe_data", "run_dense_probe",
           "run_linear_probe", "show_weights"]  # fmt: skip


class OpenedBackbone(NamedTuple):
    """A backbone with its weights loaded: ``net``, the input ``image_size``
    it was trained or exported for, the weights' ``format`` and ``name``,
    and the run's ``config`` where the weights came from dino_opt training."""

    net: nn.Module
    image_size: int
    format: str
    name: str
    config: Config | None


def _run_config(path: Path) -> Config | None:
    """The config of a dino_opt run folder or checkpoint file (None for other weights)."""
    try:
        ckpt = load_checkpoint(path, keys=("config",))
    except (ValueError, FileNotFoundError, RuntimeError, OSError):
        return None
    try:
        return Config.from_dict(ckpt["config"])
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: its config is not valid: {e}") from e


def open_backbone(path: str | os.PathLike, which: str = "teacher") -> OpenedBackbone:
    """The ``which`` backbone (teacher or student) of the weights at ``path``."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    weights = read_weights(path)
    sd = (weights.teacher if which == "teacher" else weights.student)["backbone"]
    net, native = evaluation_backbone(weights, sd)
    load_strict(net, sd, "backbone", weights.path)
    cfg = _run_config(Path(path)) if weights.format == "dino_opt" else None
    # the training crops' side (with crop-size pairs: the first pair's)
    size = cfg.augmentation.crop_size_pairs[0][0] if cfg is not None else native
    return OpenedBackbone(net.eval(), size, weights.format, weights.backbone, cfg)


def probe_data(opened: OpenedBackbone, data: str | os.PathLike | None) -> tuple[Path, ...]:
    """``(train, val, test or None)``: ``data``'s ``train/``, ``val/`` (or
    ``validation/``) and ``test/``, else the data of the run's config."""
    if data is not None:
        root = Path(data)
        val = root / "val" if source_exists(root / "val") else root / "validation"
        test = root / "test"
        found = (root / "train", val, test if source_exists(test) else None)
    elif opened.config is not None:
        roots = data_roots(opened.config)
        found = (roots.knn_train or roots.train, roots.val, roots.test)
    else:
        raise ValueError("weights from outside dino_opt need --data ROOT (train/ and val/)")
    for split in found[:2]:
        if split is None or not source_exists(split):
            raise FileNotFoundError(f"data {str(split)!r} does not exist (need train/ and val/)")
    return found


def run_linear_probe(path: str | os.PathLike, data: str | os.PathLike | None = None, *,
                     which: str = "teacher", image_size: int | None = None,
                     device: str = "auto", **options) -> dict:  # fmt: skip
    """:func:`~dino_opt.eval.linear_probe` of the weights at ``path``."""
    opened = open_backbone(path, which)
    train, val, test = probe_data(opened, data)
    size = image_size or opened.image_size
    result = linear_probe(opened.net, ProbeData(train, val, test), size,
                          device=resolve_device(device), **options)  # fmt: skip
    result.update(weights=str(path), format=opened.format, backbone=opened.name,
                  which=which, data={"train": str(train), "val": str(val),
                                     "test": str(test) if test else None})  # fmt: skip
    return result


def run_dense_probe(path: str | os.PathLike, data: str | os.PathLike | None = None, *,
                    which: str = "teacher", image_size: int | None = None,
                    device: str = "auto", **options) -> dict:  # fmt: skip
    """:func:`~dino_opt.eval.dense.dense_probe` of the weights at ``path`` on
    the segmentation splits of ``data`` (image/mask pairs; the built-in data
    set has them), else of the run's data."""
    opened = open_backbone(path, which)
    root = Path(data) if data is not None else _data_root(opened)
    splits = segmentation_splits(root)
    if splits is None:
        raise ValueError(f"{str(root)!r} has no masks (image/mask pairs) for a dense probe")
    size = image_size or opened.image_size
    result = dense_probe(opened.net, splits["train"], splits["val"], splits.get("test"),
                         image_size=size, device=resolve_device(device), **options)  # fmt: skip
    result.update(weights=str(path), format=opened.format, backbone=opened.name, which=which,
                  data=str(root))  # fmt: skip
    return result


def _data_root(opened: OpenedBackbone) -> Path:
    if opened.config is None:
        raise ValueError("weights from outside dino_opt need --data ROOT")
    return data_roots(opened.config).train.parent


def show_weights(path: str | os.PathLike, images, kind: str = "attention",
                 output_dir: str | os.PathLike = ".", *, which: str = "teacher",
                 image_size: int | None = None, **options) -> list[Path]:  # fmt: skip
    """:func:`~dino_opt.eval.show` of the backbone of the weights at
    ``path``: one PNG per image file of ``images``, in ``output_dir``.
    Images keep their aspect; their longer side becomes ``image_size``
    (default 448 px, in whole patches)."""
    return show(open_backbone(path, which).net, images, kind, output_dir, image_size, **options)
