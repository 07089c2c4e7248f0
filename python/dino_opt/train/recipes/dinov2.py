"""The DINOv2 recipe (Oquab et al., 2023): DINO's class-token loss plus
iBOT's masked-patch loss and the KoLeo regulariser, block masks made by the
loader, an optional separate iBOT head, softmax centering or Sinkhorn-Knopp,
DINOv2's per-layer parameter groups and schedules (the last layer frozen by
its learning rate)."""

from __future__ import annotations

import copy

from torch import nn

from ...config import Config
from ...models import DINOHead
from ...ops import Schedules
from ..dinov2 import DINOv2Loss, DINOv2Trainer, DINOv2Wrapper
from ..param_groups import dinov2_param_groups
from .base import register
from .dino import DINORecipe

__all__ = ["DINOv2Recipe"]


class DINOv2Recipe(DINORecipe):
    name = "dinov2"
    # The demo: the DINO demo's data, crops, network and schedule with DINOv2's
    # losses (iBOT, KoLeo), masks and mask token, Sinkhorn-Knopp targets (val
    # 50.6 % against 47.6 % with softmax centering). Without LayerScale: at 1e-5
    # a random network's features are nearly the same for every image (k-NN at
    # chance), so the gain over random initialisation would not compare with DINO's.
    demo_changes = {
        "recipe": {"name": "dinov2", "centering": "sinkhorn_knopp"},
        "model": {"img_size": 224},
    }

    def backbone_options(self, cfg: Config) -> dict:
        # DINOv2 sizes the position embeddings for the global crops; masked
        # patches are replaced by a learned token
        # (with crop-size pairs: the first pair's)
        return {"img_size": cfg.augmentation.crop_size_pairs[0][0], "use_mask_token": True}

    def wrap_models(self, cfg: Config, student: nn.Module, teacher: nn.Module):
        m, ibot_cfg = cfg.model, cfg.recipe.ibot
        ibot = None
        if ibot_cfg.separate_head:
            ibot = DINOHead(
                student.backbone.embed_dim,
                ibot_cfg.out_dim,
                use_bn=m.use_bn_in_head,
                norm_last_layer=m.norm_last_layer,
                hidden_dim=m.hidden_dim,
                bottleneck_dim=m.bottleneck_dim,
            )
        student = DINOv2Wrapper(student.backbone, student.head, ibot)
        teacher = DINOv2Wrapper(teacher.backbone, teacher.head, copy.deepcopy(ibot))
        teacher.requires_grad_(False)
        return student, teacher

    loss_class = DINOv2Loss

    def build_loss(self, cfg: Config) -> nn.Module:
        s, r = cfg.schedule, cfg.recipe
        return self.loss_class(
            cfg.model.out_dim,
            self.patch_head_dim(cfg),
            cfg.augmentation.num_local_views,
            student_temp=s.student_temp,
            center_momentum=s.center_momentum,
            centering=r.centering,
            weights=(r.dino.loss_weight, r.ibot.loss_weight, r.koleo.loss_weight),
            **self.more_loss_options(cfg),
        )

    def more_loss_options(self, cfg: Config) -> dict:
        """Keywords a derived recipe's loss class takes besides DINOv2's."""
        return {}

    def loader_masks(self, cfg: Config) -> dict | None:
        ibot = cfg.recipe.ibot
        return {
            "patch_size": cfg.model.patch_size,
            "ratio": tuple(ibot.mask_ratio_min_max),
            "probability": ibot.mask_sample_probability,
        }

    def param_groups(self, cfg: Config, student: nn.Module) -> list[dict]:
        o = cfg.optim
        return dinov2_param_groups(
            student, o.layerwise_decay, o.patch_embed_lr_mult, o.backbone_lr_mult
        )

    def build_schedules(self, cfg: Config, niter_per_epoch: int, base_lr: float):
        s, o = cfg.schedule, cfg.optim
        return Schedules.dinov2(
            base_lr=base_lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            weight_decay_end=o.weight_decay_end,
            momentum_teacher=s.momentum_teacher,
            warmup_teacher_temp=s.warmup_teacher_temp,
            teacher_temp=s.teacher_temp,
            warmup_teacher_temp_epochs=s.warmup_teacher_temp_epochs,
            freeze_last_layer_epochs=o.freeze_last_layer,
            epochs=s.epochs,
            warmup_epochs=s.warmup_epochs,
            niter_per_epoch=niter_per_epoch,
        )

    def freeze_last_layer(self, cfg: Config) -> int:
        return 0  # the last layers are frozen by their learning-rate schedule

    def trainer_class(self, cfg: Config) -> type:
        return DINOv2Trainer

    def patch_head_dim(self, cfg: Config) -> int:
        ibot = cfg.recipe.ibot
        return ibot.out_dim if ibot.separate_head else cfg.model.out_dim


register(DINOv2Recipe())
