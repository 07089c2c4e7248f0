"""The DINO recipe (Caron et al., 2021): the DINO loss over the class tokens
of 2 global and the local crops, a softmax-centred teacher, DINO's two
parameter groups, schedules and frozen last layer; the base of the others."""

from __future__ import annotations

from torch import nn

from ...config import Config
from ...ops import DINOLoss, Schedules
from ..param_groups import dinov2_param_groups, param_groups
from ..trainer import MemoryOptimizedDINOTrainer
from .base import Recipe, WeightsReader, register

__all__ = ["DINORecipe"]


class DINORecipe(Recipe):
    name = "dino"
    demo_changes: dict = {}  # the demo preset is DINO's

    def backbone_options(self, cfg: Config) -> dict:
        # DINO's position embeddings are sized for 224 pixels whatever the crops
        return {"img_size": 224, "use_mask_token": False}

    def wrap_models(self, cfg: Config, student: nn.Module, teacher: nn.Module):
        return student, teacher

    def build_loss(self, cfg: Config) -> nn.Module:
        s = cfg.schedule
        return DINOLoss(
            cfg.model.out_dim,
            2 + cfg.augmentation.num_local_views,
            s.warmup_teacher_temp,
            s.teacher_temp,
            s.warmup_teacher_temp_epochs,
            s.epochs,
            s.student_temp,
            s.center_momentum,
        )

    def loader_masks(self, cfg: Config) -> dict | None:
        return None

    def param_groups(self, cfg: Config, student: nn.Module) -> list[dict]:
        """DINO's two groups (biases and norms never decay), or DINOv2's
        per-layer groups when a layer-wise decay, patch-embedding or backbone
        multiplier other than 1 asks for them."""
        o = cfg.optim
        if (o.layerwise_decay, o.patch_embed_lr_mult, o.backbone_lr_mult) != (1.0, 1.0, 1.0):
            return dinov2_param_groups(
                student, o.layerwise_decay, o.patch_embed_lr_mult, o.backbone_lr_mult
            )
        return param_groups(student)

    def build_schedules(self, cfg: Config, niter_per_epoch: int, base_lr: float):
        s, o = cfg.schedule, cfg.optim
        return Schedules.dino(
            base_lr=base_lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            weight_decay_end=o.weight_decay_end,
            momentum_teacher=s.momentum_teacher,
            epochs=s.epochs,
            warmup_epochs=s.warmup_epochs,
            niter_per_epoch=niter_per_epoch,
        )

    def freeze_last_layer(self, cfg: Config) -> int:
        return cfg.optim.freeze_last_layer

    def trainer_class(self, cfg: Config) -> type:
        return MemoryOptimizedDINOTrainer

    def frozen_copies(
        self,
        cfg: Config,
        loss_fn: nn.Module,
        teacher: nn.Module,
        reader: WeightsReader | None = None,
    ) -> list[nn.Module]:
        return []

    def resolve(self, cfg: Config, reader: WeightsReader) -> Config:
        return cfg

    def attach_teacher(self, cfg: Config, loss_fn: nn.Module, reader: WeightsReader):
        return None

    def patch_head_dim(self, cfg: Config) -> int:
        return 0

    def frozen_backbone_copies(self, cfg: Config) -> int:
        return 0


register(DINORecipe())
