"""Distillation (``recipe.name: distill``): the student learns from a frozen
teacher opened from ``recipe.distill.teacher`` (any weights dino_opt reads)
instead of from its own EMA, which is kept and is the run's result. Two
modes (``recipe.distill.mode``, :mod:`dino_opt.train.distill`; the losses
read ``recipe.distill`` as it is):
``features`` (the student's tokens, through a projector, matched to the
teacher's; any student backbone) and ``heads`` (DINOv2's losses against the
targets of the teacher's DINO and iBOT heads; a ViT student)."""

from __future__ import annotations

import copy

from torch import nn

from ...config import Config, apply_overrides, default_config
from ...models import feature_width
from ..distill import (
    FeatureDistillLoss,
    FeatureDistillTrainer,
    FeatureDistillWrapper,
    FeatureProjector,
    FrozenTeacher,
    HeadsDistillLoss,
    HeadsDistillTrainer,
    StudentBank,
)
from .base import WeightsReader, register
from .dinov2 import DINOv2Recipe

__all__ = ["DistillRecipe"]


def _student_config(cfg: Config, backbone: str) -> Config:
    """``cfg`` with ``backbone`` as its student (alone; a ViT takes
    ``model.patch_size``, a network without patches the default)."""
    vit = backbone.startswith("vit")
    patch = cfg.model.patch_size if vit else default_config().model.patch_size
    return apply_overrides(
        cfg,
        [
            f"model.backbone={backbone}",
            f"model.patch_size={patch}",
            "recipe.distill.students=[]",
            "recipe.distill.students_init_from=[]",
            "distributed.student_groups=false",
        ],
    )


def _heads(cfg: Config) -> bool:
    return cfg.recipe.distill.mode == "heads"


class DistillRecipe(DINOv2Recipe):
    name = "distill"
    # The demo: a ViT-T/16 student (the DINO demo's network, data, crops and
    # schedule) distilled from the teacher given with recipe.distill.teacher,
    # with the local crops, whitened teacher tokens and MLP projectors (a
    # ResNet-18 from the demo's ViT-S/16 teacher, seed 0, test k-NN / linear:
    # 42.4 / 50.6 without the last two, 66.4 / 74.2 with them; alone 46.6 / 55.0).
    demo_changes = {
        "recipe": {
            "name": "distill",
            "distill": {
                "mode": "features",
                "local_weight": 1.0,
                "whiten": 1e-4,
                "projector_hidden": 2048,
            },
        }
    }
    # The EMA student is never run in training mode: its BatchNorm statistics
    # are the student's, or a ResNet's EMA would be evaluated with its
    # initial ones.
    ema_copies_buffers = True
    external_teacher = True

    def backbone_options(self, cfg: Config) -> dict:
        # DINOv2's (the global crops' grid, a mask token); no mask token without masks
        return {**super().backbone_options(cfg), "use_mask_token": _heads(cfg)}

    def builds_heads(self, cfg: Config) -> bool:
        return _heads(cfg)  # features: the student's backbone and a projector, no DINO head

    def wrap_models(self, cfg: Config, student: nn.Module, teacher: nn.Module | None):
        if _heads(cfg):
            return super().wrap_models(cfg, student, teacher)
        d = cfg.recipe.distill
        width = feature_width(student.backbone)
        projector = FeatureProjector(width, d.teacher_dim or width, d.projector_hidden)
        wrapped = FeatureDistillWrapper(student.backbone, projector)
        return wrapped, copy.deepcopy(wrapped).requires_grad_(False)

    def student_configs(self, cfg: Config) -> list[Config]:
        """``cfg`` (the student ``model.backbone``) and one config per
        backbone of ``recipe.distill.students``."""
        return [cfg, *(_student_config(cfg, name) for name in cfg.student_names[1:])]

    def student_alone(self, cfg: Config, index: int) -> Config:
        """The config of student ``index`` of ``cfg.student_names`` trained alone."""
        return _student_config(cfg, cfg.student_names[index])

    def join_students(self, cfg: Config, pairs: list[tuple[nn.Module, nn.Module]]):
        names = cfg.student_keys
        students = StudentBank({n: s for n, (s, _) in zip(names, pairs, strict=True)})
        return students, StudentBank({n: t for n, (_, t) in zip(names, pairs, strict=True)})

    def param_groups(self, cfg: Config, student: nn.Module) -> list[dict]:
        """DINOv2's groups of each student, one after the other (AdamW's
        update is per parameter: as an optimizer each)."""
        members = student.members.values() if isinstance(student, StudentBank) else [student]
        groups = []
        for member in members:
            groups += super().param_groups(cfg, member)
        return groups

    loss_class = HeadsDistillLoss

    def build_loss(self, cfg: Config) -> nn.Module:
        if _heads(cfg):
            return super().build_loss(cfg)
        return FeatureDistillLoss(cfg.recipe.distill)

    def more_loss_options(self, cfg: Config) -> dict:
        return {"distill": cfg.recipe.distill}

    def loader_masks(self, cfg: Config) -> dict | None:
        return super().loader_masks(cfg) if _heads(cfg) else None

    def trainer_class(self, cfg: Config) -> type:
        return HeadsDistillTrainer if _heads(cfg) else FeatureDistillTrainer

    def resolve(self, cfg: Config, reader: WeightsReader) -> Config:
        """The teacher's widths written into the config:
        ``recipe.distill.teacher_dim`` (features), or the student heads'
        widths (heads: the teacher's prototypes), read by opening the teacher."""
        d = cfg.recipe.distill
        info = reader.open_teacher(d.teacher, _heads(cfg), cfg.model.trust_code)._asdict()
        if not _heads(cfg):
            if d.teacher_dim not in (None, info["embed_dim"]):
                raise ValueError(
                    f"recipe.distill.teacher_dim={d.teacher_dim} but the teacher "
                    f"{d.teacher!r} gives {info['embed_dim']}-wide features"
                )
            return apply_overrides(cfg, [f"recipe.distill.teacher_dim={info['embed_dim']}"])
        separate = info["ibot_out_dim"] != info["out_dim"]
        return apply_overrides(
            cfg,
            [
                f"model.out_dim={info['out_dim']}",
                f"recipe.ibot.separate_head={str(separate).lower()}",
                f"recipe.ibot.out_dim={info['ibot_out_dim']}",
            ],
        )

    def attach_teacher(self, cfg: Config, loss_fn: nn.Module, reader: WeightsReader) -> nn.Module:
        """Opens the teacher (an :class:`~dino_opt.weights.OpenedTeacher`)
        and hands it to the loss; returns its network, for the job to place."""
        d = cfg.recipe.distill
        opened = reader.open_teacher(d.teacher, _heads(cfg), cfg.model.trust_code)
        frozen = FrozenTeacher(opened.network, opened.patch_size, d.teacher_scale)
        loss_fn.attach_teacher(frozen)
        return opened.network

    def frozen_backbone_copies(self, cfg: Config) -> int:
        return 0  # the teacher is not a copy of the student's EMA


register(DistillRecipe())
