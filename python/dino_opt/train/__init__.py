"""One training step: the memory-optimised trainer, and the builders from a config."""

from .build import (
    DataRoots,
    build_loader,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    data_roots,
    trainer_options,
)
from .trainer import DINOModel, MemoryOptimizedDINOTrainer, param_groups

__all__ = [
    "DINOModel",
    "DataRoots",
    "MemoryOptimizedDINOTrainer",
    "build_loader",
    "build_loss",
    "build_models",
    "build_optimizer",
    "build_schedules",
    "data_roots",
    "param_groups",
    "trainer_options",
]
