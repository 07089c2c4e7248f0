"""The DINOv3 recipe (Siméoni et al., 2025): DINOv2's losses (DINO, iBOT,
KoLeo; DINOv3 trains them with a separate iBOT head and Sinkhorn-Knopp
targets, ``recipe.ibot.separate_head`` and ``recipe.centering``) plus Gram
anchoring of the student's patch tokens to a Gram teacher, a frozen copy of
the teacher's backbone (``recipe.gram``, handed to the loss as it is;
:mod:`dino_opt.train.dinov3`)."""

from __future__ import annotations

import dataclasses

import numpy as np
from torch import nn

from ...config import Config
from ...ops import warmup_cosine_constant
from ..dinov3 import DINOv3Loss, DINOv3Trainer
from .base import WeightsReader, register
from .dinov2 import DINOv2Recipe

__all__ = ["DINOv3Recipe", "gram_weight_schedule"]


def gram_weight_schedule(cfg: Config, niter_per_epoch: int) -> np.ndarray:
    """The Gram loss's weight per iteration (DINOv3's ``gram.loss_weight_schedule``):
    linear from ``recipe.gram.loss_weight_start`` to ``loss_weight`` over the
    warm-up epochs, a half cosine to ``loss_weight_end`` over the cosine
    epochs (null: the rest), then constant. With the defaults it is
    ``loss_weight`` throughout."""
    g, n = cfg.recipe.gram, niter_per_epoch
    peak = g.loss_weight
    start = peak if g.loss_weight_start is None else g.loss_weight_start
    end = peak if g.loss_weight_end is None else g.loss_weight_end
    cosine = g.loss_weight_cosine_epochs
    cosine_iters = None if cosine is None else cosine * n
    warmup_iters, total = g.loss_weight_warmup_epochs * n, cfg.schedule.epochs * n
    return warmup_cosine_constant(start, peak, end, warmup_iters, total, cosine_iters)


class DINOv3Recipe(DINOv2Recipe):
    name = "dinov3"
    # The demo: the dinov2 demo (the DINO demo's data, crops, network and
    # schedule) with DINOv3's separate iBOT head, and a Gram teacher taken
    # from the EMA teacher at iteration 40 and refreshed after iterations 80
    # and 120 (the demo makes 93 to 240 optimizer steps).
    demo_changes = {
        "recipe": {
            "name": "dinov3",
            "centering": "sinkhorn_knopp",
            "ibot": {"separate_head": True, "out_dim": 1024},
            "gram": {
                "it_load_ema_teacher": 40,
                "update_frequency": 40,
                "it_first_update": 80,
                "max_updates": 2,
            },
        },
        "model": {"img_size": 224},
    }

    def wrap_models(self, cfg: Config, student: nn.Module, teacher: nn.Module):
        student, teacher = super().wrap_models(cfg, student, teacher)
        student.keep_patch_tokens = True  # the Gram loss's input
        return student, teacher

    loss_class = DINOv3Loss

    def more_loss_options(self, cfg: Config) -> dict:
        return {"gram": cfg.recipe.gram, "crop_size_pairs": cfg.augmentation.crop_size_pairs}

    def build_schedules(self, cfg: Config, niter_per_epoch: int, base_lr: float):
        schedules = super().build_schedules(cfg, niter_per_epoch, base_lr)
        gram = gram_weight_schedule(cfg, niter_per_epoch)
        return dataclasses.replace(schedules, gram_weight=gram)

    def trainer_class(self, cfg: Config) -> type:
        return DINOv3Trainer

    def frozen_copies(
        self,
        cfg: Config,
        loss_fn: nn.Module,
        teacher: nn.Module,
        reader: WeightsReader | None = None,
    ) -> list[nn.Module]:
        if not cfg.recipe.gram.use_loss:
            return []  # no Gram teacher
        load = reader.load_backbone if reader is not None else None
        loss_fn.gram_teacher.attach(teacher.backbone, load)
        return [loss_fn.gram_teacher.backbone]

    def frozen_backbone_copies(self, cfg: Config) -> int:
        return int(cfg.recipe.gram.use_loss)  # the Gram teacher


register(DINOv3Recipe())
