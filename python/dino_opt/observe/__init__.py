"""Watching a run: memory, profiler, health, run folder and log, plots, analysis, reports."""

from .analysis import DINOTrainingAnalyzer, format_report
from .health import (
    CollapseError,
    HealthAlert,
    HealthThresholds,
    NonFiniteError,
    TrainingHealthMonitor,
    step_is_finite,
    teacher_entropy_per_row,
)
from .memory import (
    AllocationTrace,
    MemoryTracker,
    VRAMProfiler,
    device_index,
    memory_snapshot,
    nvml_status,
)
from .plots import MEMORY_KEYS, plot_training_curves, read_metrics
from .profiler import (
    DINOProfiler,
    PerformanceMonitor,
    PerformanceProfiler,
    Profiler,
    TrainingProfiler,
    profile_summary,
)
from .runfiles import RunFolder
from .runlog import RunLog

__all__ = [
    "AllocationTrace",
    "CollapseError",
    "DINOProfiler",
    "DINOTrainingAnalyzer",
    "HealthAlert",
    "HealthThresholds",
    "MEMORY_KEYS",
    "MemoryTracker",
    "NonFiniteError",
    "PerformanceMonitor",
    "PerformanceProfiler",
    "Profiler",
    "RunFolder",
    "RunLog",
    "TrainingHealthMonitor",
    "TrainingProfiler",
    "VRAMProfiler",
    "device_index",
    "format_report",
    "memory_snapshot",
    "nvml_status",
    "plot_training_curves",
    "profile_summary",
    "read_metrics",
    "step_is_finite",
    "teacher_entropy_per_row",
]
