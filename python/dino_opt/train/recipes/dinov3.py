"""The DINOv3 recipe (Siméoni et al., 2025): DINOv2's losses (DINO, iBOT,
KoLeo; DINOv3 trains them with a separate iBOT head and Sinkhorn-Knopp
targets, ``recipe.ibot_separate_head`` and ``recipe.centering``) plus Gram
anchoring of the student's patch tokens to a Gram teacher, a frozen copy of
the teacher's backbone (the ``recipe.gram_*`` keys; :mod:`dino_opt.train.dinov3`)."""

from __future__ import annotations

import dataclasses

import numpy as np
from torch import nn

from ...config import Config
from ...ops import warmup_cosine_constant
from ..dinov3 import DINOv3Loss, DINOv3Trainer, GramOptions
from .base import FP32, WeightsReader, register
from .dinov2 import DINOv2Recipe

__all__ = ["DINOv3Recipe", "gram_options", "gram_weight_schedule"]


def gram_options(cfg: Config) -> GramOptions:
    """The :class:`~dino_opt.train.dinov3.GramOptions` of ``cfg.recipe``'s ``gram_*`` keys."""
    r = cfg.recipe
    return GramOptions(
        use_loss=r.gram_use_loss, loss_weight=r.gram_loss_weight, ckpt=r.gram_ckpt,
        it_load_ema_teacher=r.gram_it_load_ema_teacher, rep_update=r.gram_rep_update,
        update_frequency=r.gram_update_frequency, it_first_update=r.gram_it_first_update,
        max_updates=r.gram_max_updates, img_level=r.gram_img_level,
        normalized=r.gram_normalized, remove_neg=r.gram_remove_neg,
        remove_only_teacher_neg=r.gram_remove_only_teacher_neg,
        tokens_used=r.gram_tokens_used, teacher_crop_size=_gram_crop_sizes(cfg),
    )  # fmt: skip


def _gram_crop_sizes(cfg: Config) -> int | dict[int, int] | None:
    """``recipe.gram_teacher_crop_size``; a list (one per crop-size pair) as
    a dict from each pair's global crop side to its Gram teacher side."""
    size = cfg.recipe.gram_teacher_crop_size
    if not isinstance(size, tuple):
        return size
    return {g: s for (g, _), s in zip(cfg.augmentation.crop_size_pairs, size, strict=True)}


def gram_weight_schedule(cfg: Config, niter_per_epoch: int) -> np.ndarray:
    """The Gram loss's weight per iteration (DINOv3's ``gram.loss_weight_schedule``):
    linear from ``gram_loss_weight_start`` to ``gram_loss_weight`` over the
    warm-up epochs, a half cosine to ``gram_loss_weight_end`` over the cosine
    epochs (null: the rest), then constant. With the defaults it is
    ``gram_loss_weight`` throughout."""
    r, n = cfg.recipe, niter_per_epoch
    peak = r.gram_loss_weight
    start = peak if r.gram_loss_weight_start is None else r.gram_loss_weight_start
    end = peak if r.gram_loss_weight_end is None else r.gram_loss_weight_end
    cosine = r.gram_loss_weight_cosine_epochs
    cosine_iters = None if cosine is None else cosine * n
    warmup_iters, total = r.gram_loss_weight_warmup_epochs * n, cfg.schedule.epochs * n
    return warmup_cosine_constant(start, peak, end, warmup_iters, total, cosine_iters)


class DINOv3Recipe(DINOv2Recipe):
    name = "dinov3"
    # The demo: the dinov2 demo (the DINO demo's data, crops, network and
    # schedule) with DINOv3's separate iBOT head, and a Gram teacher taken
    # from the EMA teacher at iteration 40 and refreshed after iterations 80
    # and 120 (the demo makes 93 to 240 optimizer steps).
    demo_changes = {
        "recipe": {
            "name": "dinov3", "centering": "sinkhorn_knopp", "ibot_separate_head": True,
            "ibot_out_dim": 1024, "gram_it_load_ema_teacher": 40, "gram_update_frequency": 40,
            "gram_it_first_update": 80, "gram_max_updates": 2,
        },
        "model": {"img_size": 224},
    }  # fmt: skip

    def wrap_models(self, cfg: Config, student: nn.Module, teacher: nn.Module):
        student, teacher = super().wrap_models(cfg, student, teacher)
        student.keep_patch_tokens = True  # the Gram loss's input
        return student, teacher

    loss_class = DINOv3Loss

    def more_loss_options(self, cfg: Config) -> dict:
        return {"gram": gram_options(cfg)}

    def build_schedules(self, cfg: Config, niter_per_epoch: int, base_lr: float):
        schedules = super().build_schedules(cfg, niter_per_epoch, base_lr)
        gram = gram_weight_schedule(cfg, niter_per_epoch)
        return dataclasses.replace(schedules, gram_weight=gram)

    def trainer_class(self, cfg: Config) -> type:
        return DINOv3Trainer

    def frozen_copies(self, cfg: Config, loss_fn: nn.Module, teacher: nn.Module,
                      reader: WeightsReader | None = None) -> list[nn.Module]:  # fmt: skip
        if not cfg.recipe.gram_use_loss:
            return []  # no Gram teacher
        load = reader.load_backbone if reader is not None else None
        loss_fn.gram_teacher.attach(teacher.backbone, load)
        return [loss_fn.gram_teacher.backbone]

    def frozen_backbone_copies(self, cfg: Config) -> int:
        return int(cfg.recipe.gram_use_loss)  # the Gram teacher

    def frozen_copy_output_bytes(self, cfg: Config, embed_dim: int, batch: int) -> int:
        if not cfg.recipe.gram_use_loss:
            return 0
        # the Gram teacher's patch tokens of the global crops, float32, kept for the Gram loss
        side = cfg.augmentation.largest_crop_sizes[0] // cfg.model.patch_size  # the largest pair
        return 2 * batch * side * side * embed_dim * FP32


register(DINOv3Recipe())
