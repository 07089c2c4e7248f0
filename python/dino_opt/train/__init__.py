"""One training step: the memory-optimised trainer (DINO and the DINOv2
recipe), the parameter groups, and the builders from a config."""

from .build import (
    DataRoots,
    attach_frozen_copies,
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
from .param_groups import dinov2_param_groups, layer_id, param_groups
from .recipes import RECIPES, Recipe, recipe_of
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
    "MemoryOptimizedDINOTrainer",
    "PatchStudentOutputs",
    "RECIPES",
    "Recipe",
    "StudentOutputs",
    "TeacherTargets",
    "attach_frozen_copies",
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
    "trainer_options",
]
