"""One training step: the memory-optimised trainer (DINO) and the steps of
the DINOv2, DINOv3 and distillation recipes, the parameter groups, and the
builders from a config."""

from .build import (
    DataRoots,
    attach_frozen_copies,
    attach_teacher,
    backbone_options,
    build_loader,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    build_source,
    build_trainer,
    data_roots,
    loader_masks,
    resolve_recipe,
    trainer_options,
)
from .dinov2 import (
    DINOv2Loss,
    DINOv2Trainer,
    DINOv2Wrapper,
    PatchStudentOutputs,
    StudentOutputs,
    TeacherTargets,
)
from .dinov3 import DINOv3Loss, DINOv3Trainer, GramOptions, GramTeacher, refresh_due
from .distill import (
    DistillOptions,
    FeatureDistillLoss,
    FeatureDistillTrainer,
    FeatureDistillWrapper,
    HeadsDistillLoss,
    HeadsDistillTrainer,
    StudentBank,
)
from .param_groups import dinov2_param_groups, layer_id, param_groups
from .recipes import RECIPES, Recipe, WeightsReader, recipe_of
from .trainer import DINOModel, MemoryOptimizedDINOTrainer

__all__ = [
    "DINOModel",
    "DINOv2Loss",
    "DINOv2Trainer",
    "DINOv2Wrapper",
    "DINOv3Loss",
    "DINOv3Trainer",
    "GramOptions",
    "GramTeacher",
    "DataRoots",
    "DistillOptions",
    "FeatureDistillLoss",
    "FeatureDistillTrainer",
    "FeatureDistillWrapper",
    "HeadsDistillLoss",
    "HeadsDistillTrainer",
    "MemoryOptimizedDINOTrainer",
    "PatchStudentOutputs",
    "RECIPES",
    "Recipe",
    "StudentBank",
    "StudentOutputs",
    "TeacherTargets",
    "WeightsReader",
    "attach_frozen_copies",
    "attach_teacher",
    "backbone_options",
    "build_loader",
    "build_source",
    "build_loss",
    "build_models",
    "build_optimizer",
    "build_schedules",
    "build_trainer",
    "data_roots",
    "dinov2_param_groups",
    "layer_id",
    "loader_masks",
    "param_groups",
    "recipe_of",
    "refresh_due",
    "resolve_recipe",
    "trainer_options",
]
