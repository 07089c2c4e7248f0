"""The course's names in one place (Module 5, "Training the DINO model").

``from dino_opt.lessons import *`` gives a student every class and function
the lessons use, with the lessons' signatures, each implemented where it
belongs in dino_opt (the module is named beside it)."""

from .analysis import DINOTrainingAnalyzer  # checkpoint and performance reports
from .checkpoint import CheckpointManager  # atomic, verified checkpoint files
from .data import DataLoadingOptimizer  # multi-crop DataLoader set-up
from .distributed import DistributedDINOTrainer, launch_distributed_training  # DDP
from .health import TrainingHealthMonitor  # collapse, gradient, throughput checks
from .job import CheckpointedDINOTrainer  # the fault-tolerant training job
from .memory import MemoryTracker, VRAMProfiler  # memory statistics
from .optimize import ModelOptimizer  # compile, channels_last, SDPA attention
from .profiler import (  # timing of training phases
    DINOProfiler,
    PerformanceMonitor,
    PerformanceProfiler,
    TrainingProfiler,
)
from .throughput import OptimizedDataLoader, ThroughputOptimizer, dynamic_batch_size
from .trainer import MemoryOptimizedDINOTrainer  # AMP, checkpointing, crop batching

__all__ = [
    "CheckpointManager",
    "CheckpointedDINOTrainer",
    "DINOProfiler",
    "DINOTrainingAnalyzer",
    "DataLoadingOptimizer",
    "DistributedDINOTrainer",
    "MemoryOptimizedDINOTrainer",
    "MemoryTracker",
    "ModelOptimizer",
    "OptimizedDataLoader",
    "PerformanceMonitor",
    "PerformanceProfiler",
    "ThroughputOptimizer",
    "TrainingHealthMonitor",
    "TrainingProfiler",
    "VRAMProfiler",
    "dynamic_batch_size",
    "launch_distributed_training",
]
