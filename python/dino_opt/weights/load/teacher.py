"""The frozen teacher of a distillation, opened from any weights: a backbone
(any format :func:`~dino_opt.weights.read_weights` reads: dino_opt runs and
checkpoints, DINO, DINOv2 and DINOv3 files, timm and Hugging Face exports),
or, for a distillation through heads, a dino_opt run or checkpoint's teacher
with its DINO head and its iBOT head where it has one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from torch import nn

from ...config import Config, refuse_code
from ...eval import load_checkpoint
from ...models import feature_width
from ...train import DINOv2Wrapper, WeightsReader, build_models
from .backbone import load_backbone, open_backbone
from .hub import weights_location

__all__ = ["OpenedTeacher", "open_teacher", "weights_reader"]


class OpenedTeacher(NamedTuple):
    """A frozen teacher: its ``network`` (a backbone, or with ``heads`` a
    :class:`~dino_opt.train.DINOv2Wrapper`), ``patch_size`` (1 for a
    network without patches), feature width ``embed_dim``, its heads'
    widths ``out_dim`` and ``ibot_out_dim`` (None without heads; the iBOT
    width is the DINO head's when it is shared) and the weights' ``format``."""

    network: nn.Module
    patch_size: int
    embed_dim: int
    out_dim: int | None
    ibot_out_dim: int | None
    format: str


def _with_heads(path: Path, trust_code: bool) -> OpenedTeacher:
    """A dino_opt run's teacher with its heads, as a DINOv2Wrapper (a network
    its config names as ``package.module:function``: only with ``trust_code``)."""
    try:
        ckpt = load_checkpoint(path, keys=("teacher", "config"))
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(
            f"recipe.distill.mode=heads needs a dino_opt run or checkpoint (a teacher with its "
            f"DINO head); {str(path)!r} is not one ({e}); use recipe.distill.mode=features"
        ) from None
    cfg = Config.from_dict(ckpt["config"])
    refuse_code(cfg, f"recipe.distill.teacher={str(path)!r}", trust_code)
    teacher = build_models(cfg)[1]
    teacher.load_state_dict(ckpt["teacher"])
    if not isinstance(teacher, DINOv2Wrapper):  # a DINO run: its head serves the patches too
        teacher = DINOv2Wrapper(teacher.backbone, teacher.head, None)
    ibot = teacher.ibot_head if teacher.ibot_head is not None else teacher.head
    backbone = teacher.backbone
    return OpenedTeacher(
        teacher,
        getattr(backbone, "patch_size", 1),
        feature_width(backbone),
        teacher.head.last_layer.out_features,
        ibot.last_layer.out_features,
        "dino_opt",
    )


def open_teacher(
    path: str | os.PathLike, heads: bool = False, trust_code: bool = False
) -> OpenedTeacher:
    """The frozen teacher at ``path`` (in eval mode, no gradients): its
    backbone, or with ``heads`` its backbone and DINO heads (a dino_opt run
    or checkpoint only; ValueError naming the file otherwise). ``trust_code``:
    the user's leave to build a network the run's config names as
    ``package.module:function`` (heads only: a backbone is read from its
    weights' keys, never from a config). ``path`` may name released weights
    (:func:`~dino_opt.weights.load.hub.weights_location`)."""
    path = weights_location(path)
    if not path.exists():
        raise FileNotFoundError(f"recipe.distill.teacher={str(path)!r} does not exist")
    if heads:
        opened = _with_heads(path, trust_code)
    else:
        o = open_backbone(path)
        net = o.net
        opened = OpenedTeacher(
            net, getattr(net, "patch_size", 1), feature_width(net), None, None, o.format
        )
    opened.network.requires_grad_(False).eval()
    return opened


def weights_reader() -> WeightsReader:
    """What the recipes may read of weights files (:class:`~dino_opt.train.WeightsReader`):
    :func:`~dino_opt.weights.load_backbone` and :func:`open_teacher`. The
    reader keeps the teacher it opened last: a run that reads the teacher's
    widths when it starts and then attaches it opens its file once."""
    kept: dict = {}

    def open_once(
        path: str | os.PathLike, heads: bool = False, trust_code: bool = False
    ) -> OpenedTeacher:
        key = (str(Path(path).resolve()), bool(heads), bool(trust_code))
        if key not in kept:
            kept.clear()
            kept[key] = open_teacher(path, heads, trust_code)
        return kept[key]

    return WeightsReader(load_backbone=load_backbone, open_teacher=open_once)
