"""The course's names in one place (Module 5, "Training the DINO model").

``from dino_opt.lessons import *`` gives a student every class and function
the lessons use, with the lessons' signatures, each implemented where it
belongs in dino_opt (the module is named beside it)."""

from .checkpoint import CheckpointManager  # atomic, verified checkpoint files
from .data import DataLoadingOptimizer  # multi-crop DataLoader set-up
from .distributed import DistributedDINOTrainer, launch_distributed_training  # DDP
from .job import CheckpointedDINOTrainer  # the fault-tolerant training job
from .observe import (  # memory statistics
    DINOProfiler,
    DINOTrainingAnalyzer,  # checkpoint and performance reports
    MemoryTracker,
    PerformanceMonitor,
    PerformanceProfiler,
    TrainingHealthMonitor,  # collapse, gradient, throughput checks
    TrainingProfiler,
    VRAMProfiler,
)
from .train import MemoryOptimizedDINOTrainer  # AMP, checkpointing, crop batching
from .tune import (
    ModelOptimizer,  # compile, channels_last, SDPA attention
    OptimizedDataLoader,
    ThroughputOptimizer,
    dynamic_batch_size,
)

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
